// PagedKvCache over pools the caller allocated (torch tensors or NumPy arrays, adopted through
// DLPack): the block allocator and page tables that paged_decode reads.
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "laminar/kv_cache.h"

namespace laminar::python {
namespace {

// The cache, shared with a KvMigrator, owning the borrowed pools it reads and writes. The last
// reference may go on a migrator's thread, so releasing the pools takes the GIL.
std::shared_ptr<PagedKvCache> adopt(const KvLayout& layout, py::handle k_pool, py::handle v_pool) {
  auto pools = std::make_unique<std::pair<DlpackTensor, DlpackTensor>>(DlpackTensor::borrow(k_pool, "k_pool"),
                                                                         DlpackTensor::borrow(v_pool, "v_pool"));
  auto cache = new PagedKvCache(unwrap(PagedKvCache::create(layout, pools->first.view(), pools->second.view())));
  return std::shared_ptr<PagedKvCache>(cache, [pools = pools.release()](PagedKvCache* c) {
    delete c;
    py::gil_scoped_acquire gil;
    delete pools;
  });
}

std::string dtype_of(const KvLayout& l) { return std::string(dtype_name(l.dtype)); }

}  // namespace

void bind_kv_cache(py::module_& m) {
  py::class_<KvLayout> layout_class(m, "KvLayout", R"doc(
The shape of a paged KV cache (keywords too): num_layers pools of num_pages pages, each page
page_size tokens of num_kv_heads x head_dim elements of dtype ("f32", "f16" or "bf16").)doc");
  def_kwargs_init(layout_class);
  layout_class.def_readwrite("num_pages", &KvLayout::num_pages)
      .def_readwrite("page_size", &KvLayout::page_size, "Tokens per page.")
      .def_readwrite("num_kv_heads", &KvLayout::num_kv_heads)
      .def_readwrite("head_dim", &KvLayout::head_dim)
      .def_readwrite("num_layers", &KvLayout::num_layers)
      .def_property(
          "dtype", &dtype_of, [](KvLayout& l, const std::string& name) { l.dtype = unwrap(parse_dtype(name)); },
          "\"f32\", \"f16\" or \"bf16\".")
      .def_property_readonly("page_bytes", &KvLayout::page_bytes, "Bytes of one page of one layer's K (or V).");

  py::class_<PagedKvCache, std::shared_ptr<PagedKvCache>>(m, "PagedKvCache", R"doc(
Block allocator and per-sequence page tables over K and V pools the caller allocated and keeps
writing: k_pool and v_pool are tensors (torch or NumPy, through DLPack, used in place)
[num_layers, num_pages, page_size, num_kv_heads, head_dim] of the layout's dtype, dense (with one
layer, the 4-D [num_pages, ...] too). The cache keeps them alive. A sequence's K/V of token pos in
a layer go at pool[layer, page, offset] for (page, offset) = token_slot(id, pos, layer).)doc")
      .def(py::init(&adopt),
           py::arg("layout"), py::arg("k_pool"), py::arg("v_pool"),
           "InvalidArgumentError for a bad layout or a pool whose shape, dtype or strides do not match it.")
      .def_property_readonly("layout", [](const PagedKvCache& c) { return c.layout(); })
      .def("add_sequence", [](PagedKvCache& c, SequenceId id) { check(c.add_sequence(id)); }, py::arg("id"),
           "Starts an empty sequence; AlreadyExistsError if the id is live.")
      .def("append_tokens", [](PagedKvCache& c, SequenceId id, std::int64_t n) { check(c.append_tokens(id, n)); },
           py::arg("id"), py::arg("n"),
           "Grows a sequence by n tokens, taking pages as needed; ResourceExhaustedError (and no change) when "
           "too few are free, NotFoundError for an unknown id.")
      .def("release", [](PagedKvCache& c, SequenceId id) { check(c.release(id)); }, py::arg("id"),
           "Returns the sequence's pages to the free list.")
      .def("length", [](const PagedKvCache& c, SequenceId id) { return unwrap(c.length(id)); }, py::arg("id"),
           "Tokens of the sequence.")
      .def("pages", [](const PagedKvCache& c, SequenceId id) { return to_numpy<std::int32_t>(unwrap(c.pages(id))); },
           py::arg("id"), "int32 array: the sequence's pages in token order.")
      .def(
          "token_slot",
          [](PagedKvCache& c, SequenceId id, std::int64_t pos, std::int32_t layer) {
            PagedKvCache::TokenSlot s = unwrap(c.token_slot(id, pos, layer));
            return py::make_tuple(s.page, s.offset);
          },
          py::arg("id"), py::arg("pos"), py::arg("layer") = 0,
          "(page, offset) of token pos in the pools; OutOfRangeError past the sequence's length or the layers.")
      .def(
          "build_page_table",
          [](const PagedKvCache& c, const std::vector<SequenceId>& ids) {
            PageTableBuffer t;
            check(c.build_page_table(ids, &t));
            return py::make_tuple(to_numpy<std::int32_t>(t.indptr), to_numpy<std::int32_t>(t.indices),
                                  to_numpy<std::int32_t>(t.last_page_len));
          },
          py::arg("ids"),
          "(indptr, indices, last_page_len), int32 arrays of the sequences in that order: what paged_decode "
          "takes. NotFoundError for an unknown id, InvalidArgumentError for one given twice.")
      .def(
          "reserve_pages", [](PagedKvCache& c, std::int32_t n) { return unwrap(c.reserve_pages(n)); },
          py::arg("n"), "Takes n pages out of the free list for a sequence on its way here; a list of pages.")
      .def(
          "unreserve_pages",
          [](PagedKvCache& c, const std::vector<std::int32_t>& pages) { check(c.unreserve_pages(pages)); },
          py::arg("pages"), "Returns reserved pages to the free list.")
      .def(
          "adopt_sequence",
          [](PagedKvCache& c, SequenceId id, const std::vector<std::int32_t>& pages, std::int64_t length) {
            check(c.adopt_sequence(id, pages, length));
          },
          py::arg("id"), py::arg("pages"), py::arg("length"),
          "Makes sequence id of length tokens from reserved pages (the first ones, in token order).")
      .def_property_readonly("free_pages", [](const PagedKvCache& c) { return c.free_pages(); })
      .def_property_readonly("used_pages", [](const PagedKvCache& c) { return c.used_pages(); })
      .def_property_readonly("reserved_pages", [](const PagedKvCache& c) { return c.reserved_pages(); })
      .def_property_readonly("num_sequences", [](const PagedKvCache& c) { return c.num_sequences(); });
}

}  // namespace laminar::python
