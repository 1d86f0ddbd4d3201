// weight_manifest.h: WeightManifest, the table of contents of one policy version's weights.
//
// An ordered list of named tensors (dtype, shape, byte size) laid out back to back in one flat
// buffer, each starting on a 256-byte boundary (what CUDA copies and DLPack consumers expect).
// The actor builds one when it publishes, relays forward it as JSON ahead of the bytes, and
// pullers use it to find their shard and to check that destination buffers match.
//
// Threads: none. A plain value: const calls may run concurrently, add() needs its caller's lock.
//
//   laminar::WeightManifest m;
//   auto st = m.add("embed.weight", laminar::DType::kBF16, {32000, 4096});
//   st = m.add("lm_head.weight", laminar::DType::kBF16, {32000, 4096});
//   std::string text = m.to_json();            // ship it
//   auto back = laminar::WeightManifest::from_json(text);  // validated on the way in
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "laminar/status.h"
#include "laminar/types.h"

namespace laminar {

class WeightManifest {
 public:
  static constexpr std::uint64_t kAlignment = 256;

  struct Entry {
    std::string name;
    DType dtype = DType::kF32;
    std::vector<std::int64_t> shape;
    std::uint64_t nbytes = 0;  // product(shape) * dtype_size(dtype)
    std::uint64_t offset = 0;  // from the start of the flat buffer, a multiple of kAlignment
  };

  WeightManifest() = default;

  // Appends a tensor at the next aligned offset. kInvalidArgument (naming the tensor) for an empty
  // or duplicate name, a zero or negative dim, more than TensorView::kMaxDims dims, or a byte size
  // or offset that overflows 64 bits. On error the manifest is unchanged.
  Status add(std::string_view name, DType dtype, std::span<const std::int64_t> shape);
  Status add(std::string_view name, DType dtype, std::initializer_list<std::int64_t> shape) {
    return add(name, dtype, std::span<const std::int64_t>(shape.begin(), shape.size()));
  }

  // Builds from explicit entries (offsets given), e.g. decoded from a peer, and validates them.
  static Result<WeightManifest> from_entries(std::vector<Entry> entries);
  // JSON round trip: {"version":1,"alignment":256,"total_bytes":N,"tensors":[{"name","dtype","shape",
  // "nbytes","offset"},...]}. Every field is checked; errors name the tensor and the field.
  std::string to_json() const;
  static Result<WeightManifest> from_json(std::string_view text);

  std::span<const Entry> entries() const noexcept { return entries_; }
  std::size_t size() const noexcept { return entries_.size(); }
  bool empty() const noexcept { return entries_.empty(); }
  // Bytes of the flat buffer: the end of the last tensor rounded up to kAlignment.
  std::uint64_t total_bytes() const noexcept { return total_bytes_; }

  // kNotFound naming the tensor when absent.
  Result<const Entry*> find(std::string_view name) const;

  // kInvalidArgument when `view` does not have the dtype and shape the manifest gives `name`,
  // kNotFound when the manifest has no such tensor.
  Status check_view(std::string_view name, const TensorView& view) const;

  friend bool operator==(const WeightManifest& a, const WeightManifest& b);

 private:
  std::vector<Entry> entries_;
  std::unordered_map<std::string, std::size_t> index_;
  std::uint64_t total_bytes_ = 0;
};

bool operator==(const WeightManifest::Entry& a, const WeightManifest::Entry& b);

}  // namespace laminar
