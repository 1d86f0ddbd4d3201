#include "laminar/weight_manifest.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

namespace laminar {

namespace {

constexpr std::uint64_t kU64Max = std::numeric_limits<std::uint64_t>::max();

// Rounds up to kAlignment; false on overflow.
bool align_up(std::uint64_t x, std::uint64_t* out) {
  const std::uint64_t a = WeightManifest::kAlignment;
  if (x > kU64Max - (a - 1)) return false;
  *out = (x + a - 1) / a * a;
  return true;
}

// product(shape) * elem; false on overflow.
bool byte_size(std::span<const std::int64_t> shape, std::size_t elem, std::uint64_t* out) {
  std::uint64_t n = elem;
  for (std::int64_t d : shape) {
    const auto ud = static_cast<std::uint64_t>(d);
    if (ud != 0 && n > kU64Max / ud) return false;
    n *= ud;
  }
  *out = n;
  return true;
}

Status validate_entry(const WeightManifest::Entry& e) {
  if (e.name.empty()) return invalid_argument("tensor with an empty name");
  if (e.shape.size() > std::size_t(TensorView::kMaxDims)) {
    return invalid_argument(fmt::format("tensor '{}': {} dims, at most {} are supported", e.name,
                                        e.shape.size(), TensorView::kMaxDims));
  }
  for (std::size_t i = 0; i < e.shape.size(); ++i) {
    if (e.shape[i] <= 0) {
      return invalid_argument(fmt::format("tensor '{}': dim {} is {} in shape {}; dims must be positive",
                                          e.name, i, e.shape[i], e.shape));
    }
  }
  std::uint64_t n = 0;
  if (!byte_size(e.shape, dtype_size(e.dtype), &n)) {
    return invalid_argument(fmt::format("tensor '{}': shape {} of {} overflows 64-bit byte counts", e.name,
                                        e.shape, dtype_name(e.dtype)));
  }
  if (n != e.nbytes) {
    return invalid_argument(fmt::format("tensor '{}': nbytes is {} but shape {} of {} needs {}", e.name,
                                        e.nbytes, e.shape, dtype_name(e.dtype), n));
  }
  if (e.offset % WeightManifest::kAlignment != 0) {
    return invalid_argument(fmt::format("tensor '{}': offset {} is not a multiple of {}", e.name, e.offset,
                                        WeightManifest::kAlignment));
  }
  if (e.offset > kU64Max - e.nbytes) {
    return invalid_argument(
        fmt::format("tensor '{}': offset {} + nbytes {} overflows 64 bits", e.name, e.offset, e.nbytes));
  }
  return ok_status();
}

}  // namespace

bool operator==(const WeightManifest::Entry& a, const WeightManifest::Entry& b) {
  return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.nbytes == b.nbytes &&
         a.offset == b.offset;
}

bool operator==(const WeightManifest& a, const WeightManifest& b) {
  return a.entries_ == b.entries_ && a.total_bytes_ == b.total_bytes_;
}


Status WeightManifest::add(std::string_view name, DType dtype, std::span<const std::int64_t> shape) {
  Entry e;
  e.name = std::string(name);
  e.dtype = dtype;
  e.shape.assign(shape.begin(), shape.end());
  if (index_.count(e.name) != 0) {
    return invalid_argument(fmt::format("tensor '{}' is already in the manifest", e.name));
  }
  // Shape first so the byte size below is meaningful.
  for (std::size_t i = 0; i < e.shape.size(); ++i) {
    if (e.shape[i] <= 0) {
      return invalid_argument(fmt::format("tensor '{}': dim {} is {} in shape {}; dims must be positive",
                                          e.name, i, e.shape[i], e.shape));
    }
  }
  if (!byte_size(e.shape, dtype_size(dtype), &e.nbytes)) {
    return invalid_argument(fmt::format("tensor '{}': shape {} of {} overflows 64-bit byte counts", e.name,
                                        e.shape, dtype_name(dtype)));
  }
  e.offset = total_bytes_;
  std::uint64_t end = 0;
  if (e.offset > kU64Max - e.nbytes || !align_up(e.offset + e.nbytes, &end)) {
    return invalid_argument(fmt::format("tensor '{}': placing {} bytes at offset {} overflows 64 bits",
                                        e.name, e.nbytes, e.offset));
  }
  LAMINAR_RETURN_IF_ERROR(validate_entry(e));
  index_.emplace(e.name, entries_.size());
  entries_.push_back(std::move(e));
  total_bytes_ = end;
  return ok_status();
}

Result<WeightManifest> WeightManifest::from_entries(std::vector<Entry> entries) {
  WeightManifest m;
  std::uint64_t end = 0;
  for (const Entry& e : entries) {
    LAMINAR_RETURN_IF_ERROR(validate_entry(e));
    if (m.index_.count(e.name) != 0) {
      return invalid_argument(fmt::format("tensor '{}' appears twice in the manifest", e.name));
    }
    // Tensors are laid out in order, so each must start at or after the previous one's end.
    if (e.offset < end) {
      return invalid_argument(fmt::format(
          "tensor '{}': offset {} overlaps the previous tensor, which ends at {}", e.name, e.offset, end));
    }
    if (!align_up(e.offset + e.nbytes, &end)) {
      return invalid_argument(fmt::format("tensor '{}': end of the buffer overflows 64 bits", e.name));
    }
    m.index_.emplace(e.name, m.entries_.size());
    m.entries_.push_back(e);
  }
  m.total_bytes_ = end;
  return m;
}

std::string WeightManifest::to_json() const {
  nlohmann::json tensors = nlohmann::json::array();
  for (const Entry& e : entries_) {
    tensors.push_back({{"name", e.name},
                       {"dtype", std::string(dtype_name(e.dtype))},
                       {"shape", e.shape},
                       {"nbytes", e.nbytes},
                       {"offset", e.offset}});
  }
  nlohmann::json j = {{"version", 1},
                      {"alignment", kAlignment},
                      {"total_bytes", total_bytes_},
                      {"tensors", std::move(tensors)}};
  return j.dump();
}

Result<WeightManifest> WeightManifest::from_json(std::string_view text) {
  using nlohmann::json;
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return invalid_argument("manifest is not valid JSON");
  if (!j.is_object()) return invalid_argument("manifest JSON must be an object");
  auto uint_field = [](const json& obj, const char* key, std::string_view what,
                       std::uint64_t* out) -> Status {
    auto it = obj.find(key);
    if (it == obj.end()) return invalid_argument(fmt::format("{}: missing field '{}'", what, key));
    if (!it->is_number_unsigned()) {
      return invalid_argument(fmt::format("{}: field '{}' must be a non-negative integer, got {}", what, key,
                                          it->dump()));
    }
    *out = it->get<std::uint64_t>();
    return ok_status();
  };
  std::uint64_t format_version = 0, alignment = 0, total = 0;
  LAMINAR_RETURN_IF_ERROR(uint_field(j, "version", "manifest", &format_version));
  if (format_version != 1) {
    return invalid_argument(fmt::format("manifest format version {} is not supported (expected 1)",
                                        format_version));
  }
  LAMINAR_RETURN_IF_ERROR(uint_field(j, "alignment", "manifest", &alignment));
  if (alignment != kAlignment) {
    return invalid_argument(fmt::format("manifest alignment {} is not {}", alignment, kAlignment));
  }
  LAMINAR_RETURN_IF_ERROR(uint_field(j, "total_bytes", "manifest", &total));
  auto tensors = j.find("tensors");
  if (tensors == j.end() || !tensors->is_array()) {
    return invalid_argument("manifest: field 'tensors' must be an array");
  }
  std::vector<Entry> entries;
  entries.reserve(tensors->size());
  for (std::size_t i = 0; i < tensors->size(); ++i) {
    const json& t = (*tensors)[i];
    if (!t.is_object()) return invalid_argument(fmt::format("manifest: tensor #{} is not an object", i));
    Entry e;
    auto name = t.find("name");
    if (name == t.end() || !name->is_string()) {
      return invalid_argument(fmt::format("manifest: tensor #{} has no string 'name'", i));
    }
    e.name = name->get<std::string>();
    const std::string what = fmt::format("tensor '{}'", e.name);
    auto dtype = t.find("dtype");
    if (dtype == t.end() || !dtype->is_string()) {
      return invalid_argument(fmt::format("{}: missing string field 'dtype'", what));
    }
    Result<DType> dt = parse_dtype(dtype->get<std::string>());
    if (!dt.ok()) return dt.status().with_context(what);
    e.dtype = *dt;
    auto shape = t.find("shape");
    if (shape == t.end() || !shape->is_array()) {
      return invalid_argument(fmt::format("{}: missing array field 'shape'", what));
    }
    for (const json& d : *shape) {
      if (!d.is_number_integer()) {
        return invalid_argument(fmt::format("{}: shape {} holds a non-integer", what, shape->dump()));
      }
      e.shape.push_back(d.get<std::int64_t>());
    }
    LAMINAR_RETURN_IF_ERROR(uint_field(t, "nbytes", what, &e.nbytes));
    LAMINAR_RETURN_IF_ERROR(uint_field(t, "offset", what, &e.offset));
    entries.push_back(std::move(e));
  }
  Result<WeightManifest> m = from_entries(std::move(entries));
  if (!m.ok()) return m.status();
  if (m->total_bytes() != total) {
    return invalid_argument(fmt::format("manifest: total_bytes is {} but the tensors end at {}", total,
                                        m->total_bytes()));
  }
  return m;
}

Result<const WeightManifest::Entry*> WeightManifest::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  if (it == index_.end()) return not_found(fmt::format("no tensor named '{}' in the manifest", name));
  return &entries_[it->second];
}

Status WeightManifest::check_view(std::string_view name, const TensorView& view) const {
  Result<const Entry*> e = find(name);
  if (!e.ok()) return e.status();
  const Entry& entry = **e;
  if (view.dtype() != entry.dtype) {
    return invalid_argument(fmt::format("tensor '{}': view has dtype {} but the manifest says {}", name,
                                        dtype_name(view.dtype()), dtype_name(entry.dtype)));
  }
  if (!std::ranges::equal(view.shape(), entry.shape)) {
    return invalid_argument(fmt::format("tensor '{}': view has shape {} but the manifest says {}", name,
                                        view.shape(), entry.shape));
  }
  return ok_status();
}

}  // namespace laminar
