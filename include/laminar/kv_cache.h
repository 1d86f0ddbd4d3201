// kv_cache.h: the paged KV layout the attention kernels read, and a host-side PagedKvCache that
// owns the pools, hands out pages and keeps each sequence's page list.
//
// A rollout worker stores the keys and values of every live sequence in two page pools (K and V,
// [num_layers, num_pages, page_size, num_kv_heads, head_dim]). A sequence owns a list of pages; a
// page id names the same page in every layer, so one list serves the whole model. A decode batch
// is described by a CSR page table (indptr / indices / last_page_len) built from those lists for
// the sequences in the batch, in any order: the kernels give each sequence the same bits whatever
// its batch mates, and read one layer at a time (view(layer)). The KvMigrator moves a sequence by
// copying its pages in every layer and its length.
//
// Threads: none. A PagedKvCache is not thread-safe: the decode loop that owns it makes every call
// (a KvMigrator sharing it calls it only from the host's calls into the migrator).
//
//   auto cache = laminar::PagedKvCache::create({.num_pages = 1024, .page_size = 16, .num_kv_heads = 8,
//                                               .head_dim = 128, .dtype = DType::kBF16, .num_layers = 32});
//   LAMINAR_RETURN_IF_ERROR(cache->add_sequence(SequenceId(7)));
//   LAMINAR_RETURN_IF_ERROR(cache->append_tokens(SequenceId(7), prompt_len));  // pages for all layers
//   auto slot = cache->token_slot(SequenceId(7), 0, layer);                   // write K/V there
//   LAMINAR_RETURN_IF_ERROR(cache->build_page_table(batch_ids, &table));      // one table, every layer
//
// An engine that already holds its K/V pools (its own tensors, on the host or a CUDA device) hands
// them over as views instead: PagedKvCache::create(layout, k_view, v_view) keeps the page
// bookkeeping and leaves the memory to its owner.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "laminar/status.h"
#include "laminar/types.h"

namespace laminar {

// Geometry and element type of a pair of K/V page pools holding num_layers layers.
struct KvLayout {
  std::int32_t num_pages = 0;
  std::int32_t page_size = 0;  // tokens per page
  std::int32_t num_kv_heads = 0;
  std::int32_t head_dim = 0;
  DType dtype = DType::kBF16;  // f32, f16 or bf16
  // Last, so {num_pages, page_size, num_kv_heads, head_dim, dtype} still means one layer. The
  // kernels take one layer's layout (num_layers 1) and refuse any other.
  std::int32_t num_layers = 1;

  // Elements of one token's K (or V) row: num_kv_heads * head_dim.
  std::int64_t token_elems() const noexcept { return std::int64_t(num_kv_heads) * head_dim; }
  // Bytes of one page of one pool.
  std::int64_t page_bytes() const noexcept {
    return std::int64_t(page_size) * token_elems() * std::int64_t(dtype_size(dtype));
  }
  // Bytes of one layer of one pool: num_pages pages.
  std::int64_t layer_bytes() const noexcept { return page_bytes() * num_pages; }
  // Bytes of one whole pool (K or V), all layers.
  std::int64_t pool_bytes() const noexcept { return layer_bytes() * num_layers; }
};

// kInvalidArgument naming the field when a count (num_layers included) is not positive, the dtype
// is not a float type, or a pool of all layers would exceed 2^62 bytes.
Status validate(const KvLayout& layout);

// A view of the two pools (host or device memory, as the kernel's stream says): for the kernels,
// one layer of a PagedKvCache (layout.num_layers 1).
struct PagedKv {
  const void* k_pages = nullptr;  // [num_pages, page_size, num_kv_heads, head_dim] of layout.dtype
  const void* v_pages = nullptr;  // [num_pages, page_size, num_kv_heads, head_dim] of layout.dtype
  KvLayout layout;
};

// The CSR page table of a batch. Sequence b owns pages indices[indptr[b] .. indptr[b + 1]) in
// token order; its length is (pages - 1) * page_size + last_page_len[b], or 0 with no pages.
struct PageTable {
  const std::int32_t* indptr = nullptr;         // [batch + 1], indptr[0] = 0, non-decreasing
  const std::int32_t* indices = nullptr;        // [indptr[batch]], each in [0, num_pages)
  const std::int32_t* last_page_len = nullptr;  // [batch], 1..page_size; 0 for a sequence with no pages
  std::int32_t batch = 0;
};

// Checks a page table in host memory against a layout: indptr starts at 0 and never decreases,
// every page index is in range, every last_page_len fits its sequence. kInvalidArgument naming the
// sequence, the field and the value otherwise.
Status validate(const PageTable& table, const KvLayout& layout);

// Tokens of sequence b (the table must have been validated).
inline std::int64_t sequence_length(const PageTable& t, std::int32_t b, std::int32_t page_size) {
  const std::int32_t pages = t.indptr[b + 1] - t.indptr[b];
  return pages == 0 ? 0 : std::int64_t(pages - 1) * page_size + t.last_page_len[b];
}

// Owns the CSR arrays of a page table built by PagedKvCache::build_page_table.
struct PageTableBuffer {
  std::vector<std::int32_t> indptr;
  std::vector<std::int32_t> indices;
  std::vector<std::int32_t> last_page_len;

  PageTable view() const {
    return {indptr.data(), indices.data(), last_page_len.data(), std::int32_t(last_page_len.size())};
  }
};

// K/V pools (allocated in host memory, or adopted from the host application) with a page allocator
// and per-sequence page lists shared by all layers. Not thread-safe: one rollout worker's decode
// loop owns it.
//
// A move-only value, as a std::vector is (docs/conventions.md): it runs no thread, installs no
// handler and hands out no callback, so nothing refers to its address, and moving it moves a
// pointer while the pools stay where they are. The decode loop holds it by value; a host that
// shares it with a KvMigrator holds it in a std::shared_ptr (KvMigrator::allocate_cache returns one).
//
// The pools are layer-major, [num_layers, num_pages, page_size, num_kv_heads, head_dim]: a model
// runs layer by layer, so each layer's pool is one contiguous block that the kernels read as an
// ordinary 4-D pool, and an engine that keeps one tensor per layer stacks into this shape.
class PagedKvCache {
 public:
  // Allocates both pools (zero-filled). kInvalidArgument for a bad layout, kResourceExhausted when
  // the memory is not there.
  static Result<PagedKvCache> create(const KvLayout& layout);
  // Adopts pools the host already allocated, without owning them: they are neither cleared nor
  // freed, and must outlive the cache. Preconditions:
  //   k_pool and v_pool are [num_layers, num_pages, page_size, num_kv_heads, head_dim] of
  //   layout.dtype, dense; with num_layers 1 the 4-D [num_pages, ...] is accepted too;
  //   both on the host (pageable or page-locked) or both on one CUDA device.
  // On a device, token_slot() and k_page() / v_page() give device addresses. kInvalidArgument
  // naming the pool and the mismatch.
  static Result<PagedKvCache> create(const KvLayout& layout, const TensorView& k_pool, const TensorView& v_pool);

  // A moved-from cache may only be destroyed or assigned to.
  PagedKvCache(PagedKvCache&& other) noexcept;
  PagedKvCache& operator=(PagedKvCache&& other) noexcept;
  ~PagedKvCache();

  // Where token `pos` of a sequence lives: its K and V rows, each [num_kv_heads, head_dim].
  struct TokenSlot {
    void* k = nullptr;  // [num_kv_heads, head_dim] of dtype
    void* v = nullptr;  // [num_kv_heads, head_dim] of dtype
    std::int32_t page = 0;
    std::int32_t offset = 0;  // token index inside the page
  };

  // kAlreadyExists if the id is live.
  Status add_sequence(SequenceId id);
  // Grows a sequence by n tokens, taking pages from the free list as needed. kResourceExhausted
  // (and no change) when there are not enough free pages; kNotFound for an unknown id;
  // kInvalidArgument for negative n.
  Status append_tokens(SequenceId id, std::int64_t n);
  // Returns the sequence's pages to the free list. kNotFound for an unknown id.
  Status release(SequenceId id);

  // Pages held for a sequence that is on its way here (KvMigrator): taken out of the free list but
  // no sequence's yet, so neither the decode loop nor another reservation touches them.
  // kResourceExhausted (and no change) when fewer than n are free; kInvalidArgument for n < 1.
  Result<std::vector<std::int32_t>> reserve_pages(std::int32_t n);
  // Returns reserved pages to the free list. kInvalidArgument naming the page (and no change) for
  // one not reserved or given twice.
  Status unreserve_pages(std::span<const std::int32_t> pages);
  // Makes sequence `id` of `length` tokens from reserved pages: the first ceil(length / page_size)
  // are its pages in token order, the rest return to the free list. kAlreadyExists if the id is
  // live; kInvalidArgument (and no change) for a page not reserved or given twice, a negative
  // length, or too few pages for it.
  Status adopt_sequence(SequenceId id, std::span<const std::int32_t> pages, std::int64_t length);
  std::int32_t reserved_pages() const noexcept;

  // Token `pos` of a sequence in one layer. kNotFound / kOutOfRange (pos beyond the sequence's
  // length, or layer outside [0, num_layers)).
  Result<TokenSlot> token_slot(SequenceId id, std::int64_t pos, std::int32_t layer);
  Result<std::int64_t> length(SequenceId id) const;
  // The sequence's pages in token order (valid until the next append or release).
  Result<std::span<const std::int32_t>> pages(SequenceId id) const;

  // Fills `out` with the CSR table of `ids` in that order. kNotFound for an unknown id,
  // kInvalidArgument for an id given twice.
  Status build_page_table(std::span<const SequenceId> ids, PageTableBuffer* out) const;

  const KvLayout& layout() const noexcept;
  // One layer's pools for the kernels (its layout has num_layers 1). kOutOfRange for a layer
  // outside [0, num_layers).
  Result<PagedKv> view(std::int32_t layer) const;
  // The pools as tensors: [num_layers, num_pages, page_size, num_kv_heads, head_dim] of layout().dtype.
  TensorView k_pool() const;
  TensorView v_pool() const;
  // Where the pools live: the host for pools the cache allocated.
  Device device() const noexcept;
  // False for pools adopted from the host application.
  bool owns_pools() const noexcept;
  // Page `page` of one layer: [page_size, num_kv_heads, head_dim]. kOutOfRange naming the layer or
  // the page when outside the layout.
  Result<void*> k_page(std::int32_t layer, std::int32_t page) const;
  Result<void*> v_page(std::int32_t layer, std::int32_t page) const;
  std::int32_t free_pages() const noexcept;
  // Pages of live sequences and reserved ones.
  std::int32_t used_pages() const noexcept;
  std::size_t num_sequences() const noexcept;

 private:
  struct State;
  explicit PagedKvCache(std::unique_ptr<State> state);
  std::unique_ptr<State> s_;
};

}  // namespace laminar
