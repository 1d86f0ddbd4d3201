#include "laminar/kv_cache.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "kernels/tensor_args.h"

namespace laminar {

namespace {

bool is_float(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }

}  // namespace

Status validate(const KvLayout& l) {
  if (l.num_pages <= 0) return invalid_argument(fmt::format("KvLayout: num_pages must be positive, got {}", l.num_pages));
  if (l.page_size <= 0) return invalid_argument(fmt::format("KvLayout: page_size must be positive, got {}", l.page_size));
  if (l.num_kv_heads <= 0) {
    return invalid_argument(fmt::format("KvLayout: num_kv_heads must be positive, got {}", l.num_kv_heads));
  }
  if (l.head_dim <= 0) return invalid_argument(fmt::format("KvLayout: head_dim must be positive, got {}", l.head_dim));
  if (!is_float(l.dtype)) {
    return invalid_argument(fmt::format("KvLayout: dtype {} is not f32, f16 or bf16", dtype_name(l.dtype)));
  }
  if (l.num_layers <= 0) {
    return invalid_argument(fmt::format("KvLayout: num_layers must be positive, got {}", l.num_layers));
  }
  // In double, so the product of six factors cannot overflow before the check.
  const double bytes = double(l.num_layers) * l.num_pages * l.page_size * l.num_kv_heads * l.head_dim *
                       double(dtype_size(l.dtype));
  if (bytes > double(std::int64_t(1) << 62)) {
    return invalid_argument(fmt::format("KvLayout: a pool of {} bytes is too large", bytes));
  }
  return ok_status();
}

Status validate(const PageTable& t, const KvLayout& l) {
  LAMINAR_RETURN_IF_ERROR(validate(l));
  if (t.batch < 0) return invalid_argument(fmt::format("page table: batch is negative ({})", t.batch));
  if (t.indptr == nullptr) return invalid_argument("page table: indptr is null");
  if (t.indptr[0] != 0) return invalid_argument(fmt::format("page table: indptr[0] must be 0, got {}", t.indptr[0]));
  if (t.batch == 0) return ok_status();
  if (t.last_page_len == nullptr) return invalid_argument("page table: last_page_len is null");
  for (std::int32_t b = 0; b < t.batch; ++b) {
    const std::int32_t pages = t.indptr[b + 1] - t.indptr[b];
    if (t.indptr[b + 1] < t.indptr[b]) {
      return invalid_argument(fmt::format("page table: indptr decreases at sequence {} ({} -> {})", b, t.indptr[b],
                                          t.indptr[b + 1]));
    }
    const std::int32_t last = t.last_page_len[b];
    if (pages == 0 && last != 0) {
      return invalid_argument(fmt::format("page table: sequence {} has no pages but last_page_len {}", b, last));
    }
    if (pages > 0 && (last < 1 || last > l.page_size)) {
      return invalid_argument(fmt::format("page table: sequence {} has last_page_len {} outside 1..{}", b, last,
                                          l.page_size));
    }
  }
  if (t.indptr[t.batch] > 0 && t.indices == nullptr) return invalid_argument("page table: indices is null");
  for (std::int32_t i = 0; i < t.indptr[t.batch]; ++i) {
    if (t.indices[i] < 0 || t.indices[i] >= l.num_pages) {
      return invalid_argument(fmt::format("page table: indices[{}] = {} is outside the pool of {} pages", i,
                                          t.indices[i], l.num_pages));
    }
  }
  return ok_status();
}

// Everything the cache holds; the public class is a move-only handle to it, so moving a cache
// moves one pointer and the pools stay where they are.
struct PagedKvCache::State {
  struct Sequence {
    std::vector<std::int32_t> pages;
    std::int64_t length = 0;
  };
  struct FreeDeleter {
    void operator()(unsigned char* p) const noexcept { std::free(p); }
  };

  KvLayout layout;
  unsigned char* k = nullptr;  // [num_layers, num_pages, page_size, num_kv_heads, head_dim] of layout.dtype
  unsigned char* v = nullptr;
  Device device = Device::cpu();
  // Set when the cache allocated the pools; null for adopted ones.
  std::unique_ptr<unsigned char[], FreeDeleter> k_owned;
  std::unique_ptr<unsigned char[], FreeDeleter> v_owned;
  std::vector<std::int32_t> free;  // a stack: the most recently freed page is reused first
  std::unordered_map<SequenceId, Sequence> seqs;
  std::vector<bool> reserved;  // [num_pages]: taken by reserve_pages and not given back or adopted
  std::int32_t reserved_count = 0;

  std::int64_t pages_for(std::int64_t tokens) const noexcept { return (tokens + layout.page_size - 1) / layout.page_size; }

  void init_free_list() {
    free.reserve(std::size_t(layout.num_pages));
    for (std::int32_t p = layout.num_pages - 1; p >= 0; --p) free.push_back(p);
    reserved.assign(std::size_t(layout.num_pages), false);
  }

  // kInvalidArgument naming the page for one not reserved or given twice.
  Status check_reserved(std::span<const std::int32_t> pages) const {
    std::unordered_set<std::int32_t> seen;
    for (std::int32_t p : pages) {
      if (p < 0 || p >= layout.num_pages || !reserved[std::size_t(p)]) {
        return invalid_argument(fmt::format("PagedKvCache: page {} is not reserved", p));
      }
      if (!seen.insert(p).second) return invalid_argument(fmt::format("PagedKvCache: page {} given twice", p));
    }
    return ok_status();
  }

  // Preconditions: check_reserved(pages) is OK.
  void return_reserved(std::span<const std::int32_t> pages) {
    for (auto p = pages.rbegin(); p != pages.rend(); ++p) {
      reserved[std::size_t(*p)] = false;
      free.push_back(*p);
    }
    reserved_count -= std::int32_t(pages.size());
  }

  TensorView pool_view(unsigned char* base) const {
    const std::int64_t shape[5] = {layout.num_layers, layout.num_pages, layout.page_size, layout.num_kv_heads,
                                   layout.head_dim};
    // The layout was validated and the memory is there, so the view is well formed.
    auto view = TensorView::contiguous(base, layout.dtype, shape, device);
    LAMINAR_CHECK_MSG(view.ok(), view.status().to_string());
    return *view;
  }

  Status check_layer(std::int32_t layer) const {
    if (layer < 0 || layer >= layout.num_layers) {
      return out_of_range(fmt::format("PagedKvCache: layer {} outside a cache of {} layers", layer, layout.num_layers));
    }
    return ok_status();
  }

  Result<void*> page_address(unsigned char* base, std::int32_t layer, std::int32_t page) const {
    LAMINAR_RETURN_IF_ERROR(check_layer(layer));
    if (page < 0 || page >= layout.num_pages) {
      return out_of_range(fmt::format("PagedKvCache: page {} outside a pool of {} pages", page, layout.num_pages));
    }
    return static_cast<void*>(base + std::int64_t(layer) * layout.layer_bytes() +
                              std::int64_t(page) * layout.page_bytes());
  }
};

PagedKvCache::PagedKvCache(std::unique_ptr<State> state) : s_(std::move(state)) {}
PagedKvCache::PagedKvCache(PagedKvCache&&) noexcept = default;
PagedKvCache& PagedKvCache::operator=(PagedKvCache&&) noexcept = default;
PagedKvCache::~PagedKvCache() = default;

Result<PagedKvCache> PagedKvCache::create(const KvLayout& layout) {
  LAMINAR_RETURN_IF_ERROR(validate(layout));
  auto c = std::make_unique<State>();
  c->layout = layout;
  const auto bytes = std::size_t(layout.pool_bytes());
  // 64-byte alignment: whole cache lines per page start, and aligned vector loads in the kernels.
  const std::size_t rounded = (bytes + 63) / 64 * 64;
  c->k_owned.reset(static_cast<unsigned char*>(std::aligned_alloc(64, rounded)));
  c->v_owned.reset(static_cast<unsigned char*>(std::aligned_alloc(64, rounded)));
  if (!c->k_owned || !c->v_owned) {
    return resource_exhausted(fmt::format("PagedKvCache: cannot allocate two pools of {} bytes", bytes));
  }
  c->k = c->k_owned.get();
  c->v = c->v_owned.get();
  std::memset(c->k, 0, bytes);
  std::memset(c->v, 0, bytes);
  c->init_free_list();
  return PagedKvCache(std::move(c));
}

Result<PagedKvCache> PagedKvCache::create(const KvLayout& layout, const TensorView& k_pool,
                                          const TensorView& v_pool) {
  namespace ta = kernels::tensor_args;
  constexpr const char* k = "PagedKvCache";
  LAMINAR_RETURN_IF_ERROR(validate(layout));
  const std::int64_t shape[5] = {layout.num_layers, layout.num_pages, layout.page_size, layout.num_kv_heads,
                                 layout.head_dim};
  for (const auto& [name, pool] : {std::pair<const char*, const TensorView&>{"k_pool", k_pool}, {"v_pool", v_pool}}) {
    // One layer's pools may come without the layer dimension, as they did before layers existed.
    const auto expected = layout.num_layers == 1 && pool.ndim() == 4 ? std::span<const std::int64_t>(shape).subspan(1)
                                                                      : std::span<const std::int64_t>(shape);
    if (!std::ranges::equal(pool.shape(), expected)) {
      return ta::mismatch(k, name, fmt::format("shape {} but the layout gives {}", ta::shape_string(pool.shape()),
                                               ta::shape_string(expected)));
    }
    if (pool.dtype() != layout.dtype) {
      return ta::mismatch(k, name, fmt::format("dtype {} but the layout's is {}", dtype_name(pool.dtype()),
                                               dtype_name(layout.dtype)));
    }
    LAMINAR_RETURN_IF_ERROR(ta::expect_dense(k, name, pool));
  }
  ta::Placement where(k);
  LAMINAR_RETURN_IF_ERROR(where.add("k_pool", k_pool));
  LAMINAR_RETURN_IF_ERROR(where.add("v_pool", v_pool));
  const auto k_begin = reinterpret_cast<std::uintptr_t>(k_pool.data());
  const auto v_begin = reinterpret_cast<std::uintptr_t>(v_pool.data());
  const auto bytes = std::uintptr_t(layout.pool_bytes());
  if (k_begin < v_begin + bytes && v_begin < k_begin + bytes) {
    return invalid_argument("PagedKvCache: v_pool: overlaps k_pool");
  }
  auto c = std::make_unique<State>();
  c->layout = layout;
  c->k = static_cast<unsigned char*>(k_pool.data());
  c->v = static_cast<unsigned char*>(v_pool.data());
  c->device = k_pool.device();
  c->init_free_list();
  return PagedKvCache(std::move(c));
}

TensorView PagedKvCache::k_pool() const { return s_->pool_view(s_->k); }
TensorView PagedKvCache::v_pool() const { return s_->pool_view(s_->v); }

Result<PagedKv> PagedKvCache::view(std::int32_t layer) const {
  LAMINAR_RETURN_IF_ERROR(s_->check_layer(layer));
  KvLayout one = s_->layout;
  one.num_layers = 1;
  const std::int64_t offset = std::int64_t(layer) * s_->layout.layer_bytes();
  return PagedKv{s_->k + offset, s_->v + offset, one};
}

Result<void*> PagedKvCache::k_page(std::int32_t layer, std::int32_t page) const {
  return s_->page_address(s_->k, layer, page);
}
Result<void*> PagedKvCache::v_page(std::int32_t layer, std::int32_t page) const {
  return s_->page_address(s_->v, layer, page);
}

Status PagedKvCache::add_sequence(SequenceId id) {
  if (s_->seqs.contains(id)) return already_exists(fmt::format("PagedKvCache: sequence {} is already live", id.value()));
  s_->seqs.emplace(id, State::Sequence{});
  return ok_status();
}

Status PagedKvCache::append_tokens(SequenceId id, std::int64_t n) {
  if (n < 0) return invalid_argument(fmt::format("PagedKvCache: append of {} tokens", n));
  auto it = s_->seqs.find(id);
  if (it == s_->seqs.end()) return not_found(fmt::format("PagedKvCache: no sequence {}", id.value()));
  State::Sequence& s = it->second;
  const std::int64_t need = s_->pages_for(s.length + n) - std::int64_t(s.pages.size());
  if (need > std::int64_t(s_->free.size())) {
    return resource_exhausted(fmt::format("PagedKvCache: sequence {} needs {} more pages, {} free", id.value(), need,
                                          s_->free.size()));
  }
  for (std::int64_t i = 0; i < need; ++i) {
    s.pages.push_back(s_->free.back());
    s_->free.pop_back();
  }
  s.length += n;
  return ok_status();
}

Status PagedKvCache::release(SequenceId id) {
  auto it = s_->seqs.find(id);
  if (it == s_->seqs.end()) return not_found(fmt::format("PagedKvCache: no sequence {}", id.value()));
  for (auto p = it->second.pages.rbegin(); p != it->second.pages.rend(); ++p) s_->free.push_back(*p);
  s_->seqs.erase(it);
  return ok_status();
}

Result<std::vector<std::int32_t>> PagedKvCache::reserve_pages(std::int32_t n) {
  if (n < 1) return invalid_argument(fmt::format("PagedKvCache: reserving {} pages", n));
  if (std::size_t(n) > s_->free.size()) {
    return resource_exhausted(fmt::format("PagedKvCache: reserving {} pages, {} free", n, s_->free.size()));
  }
  std::vector<std::int32_t> pages(s_->free.end() - n, s_->free.end());
  std::reverse(pages.begin(), pages.end());  // in the order append_tokens would have taken them
  s_->free.resize(s_->free.size() - std::size_t(n));
  for (std::int32_t p : pages) s_->reserved[std::size_t(p)] = true;
  s_->reserved_count += n;
  return pages;
}

Status PagedKvCache::unreserve_pages(std::span<const std::int32_t> pages) {
  LAMINAR_RETURN_IF_ERROR(s_->check_reserved(pages));
  s_->return_reserved(pages);
  return ok_status();
}

Status PagedKvCache::adopt_sequence(SequenceId id, std::span<const std::int32_t> pages, std::int64_t length) {
  if (s_->seqs.contains(id)) return already_exists(fmt::format("PagedKvCache: sequence {} is already live", id.value()));
  if (length < 0) return invalid_argument(fmt::format("PagedKvCache: sequence {} of length {}", id.value(), length));
  LAMINAR_RETURN_IF_ERROR(s_->check_reserved(pages));
  const std::int64_t need = s_->pages_for(length);
  if (need > std::int64_t(pages.size())) {
    return invalid_argument(fmt::format("PagedKvCache: sequence {} of {} tokens needs {} pages, given {}", id.value(),
                                        length, need, pages.size()));
  }
  State::Sequence s;
  s.pages.assign(pages.begin(), pages.begin() + need);
  s.length = length;
  for (std::int32_t p : s.pages) s_->reserved[std::size_t(p)] = false;
  s_->reserved_count -= std::int32_t(need);
  s_->return_reserved(pages.subspan(std::size_t(need)));
  s_->seqs.emplace(id, std::move(s));
  return ok_status();
}

Result<PagedKvCache::TokenSlot> PagedKvCache::token_slot(SequenceId id, std::int64_t pos, std::int32_t layer) {
  LAMINAR_RETURN_IF_ERROR(s_->check_layer(layer));
  auto it = s_->seqs.find(id);
  if (it == s_->seqs.end()) return not_found(fmt::format("PagedKvCache: no sequence {}", id.value()));
  if (pos < 0 || pos >= it->second.length) {
    return out_of_range(fmt::format("PagedKvCache: token {} of sequence {} of length {}", pos, id.value(),
                                    it->second.length));
  }
  TokenSlot slot;
  slot.page = it->second.pages[std::size_t(pos / s_->layout.page_size)];
  slot.offset = std::int32_t(pos % s_->layout.page_size);
  const std::int64_t row_bytes = s_->layout.token_elems() * std::int64_t(dtype_size(s_->layout.dtype));
  // The page came from this cache's free list, so it is in range.
  slot.k = static_cast<unsigned char*>(*k_page(layer, slot.page)) + slot.offset * row_bytes;
  slot.v = static_cast<unsigned char*>(*v_page(layer, slot.page)) + slot.offset * row_bytes;
  return slot;
}

Result<std::int64_t> PagedKvCache::length(SequenceId id) const {
  auto it = s_->seqs.find(id);
  if (it == s_->seqs.end()) return not_found(fmt::format("PagedKvCache: no sequence {}", id.value()));
  return it->second.length;
}

Result<std::span<const std::int32_t>> PagedKvCache::pages(SequenceId id) const {
  auto it = s_->seqs.find(id);
  if (it == s_->seqs.end()) return not_found(fmt::format("PagedKvCache: no sequence {}", id.value()));
  return std::span<const std::int32_t>(it->second.pages);
}

Status PagedKvCache::build_page_table(std::span<const SequenceId> ids, PageTableBuffer* out) const {
  if (out == nullptr) return invalid_argument("PagedKvCache::build_page_table: out is null");
  std::unordered_set<SequenceId> seen;
  for (SequenceId id : ids) {
    if (!s_->seqs.contains(id)) return not_found(fmt::format("PagedKvCache: no sequence {}", id.value()));
    if (!seen.insert(id).second) {
      return invalid_argument(fmt::format("PagedKvCache: sequence {} appears twice in the batch", id.value()));
    }
  }
  out->indptr.assign(1, 0);
  out->indices.clear();
  out->last_page_len.clear();
  for (SequenceId id : ids) {
    const State::Sequence& s = s_->seqs.at(id);
    out->indices.insert(out->indices.end(), s.pages.begin(), s.pages.end());
    out->indptr.push_back(std::int32_t(out->indices.size()));
    out->last_page_len.push_back(
        s.length == 0 ? 0 : std::int32_t(s.length - (std::int64_t(s.pages.size()) - 1) * s_->layout.page_size));
  }
  return ok_status();
}

const KvLayout& PagedKvCache::layout() const noexcept { return s_->layout; }
Device PagedKvCache::device() const noexcept { return s_->device; }
bool PagedKvCache::owns_pools() const noexcept { return s_->k_owned != nullptr; }
std::int32_t PagedKvCache::free_pages() const noexcept { return std::int32_t(s_->free.size()); }
std::int32_t PagedKvCache::used_pages() const noexcept { return s_->layout.num_pages - free_pages(); }
std::int32_t PagedKvCache::reserved_pages() const noexcept { return s_->reserved_count; }
std::size_t PagedKvCache::num_sequences() const noexcept { return s_->seqs.size(); }

}  // namespace laminar
