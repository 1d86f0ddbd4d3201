// json_fields.h: checked reading of one JSON object's fields for the simulator's configs.
//
// Every field is type- and range-checked, and a field nobody asked for is an error, so a typo in a
// config fails loudly instead of silently keeping a default. Messages carry the field's full path:
//
//   auto r = internal::ObjectReader::open(j, "gpu");
//   if (!r.ok()) return r.status();
//   LAMINAR_RETURN_IF_ERROR(r->positive("hbm_bytes", gpu.hbm_bytes, Need::kOptional));
//   LAMINAR_RETURN_IF_ERROR(r->finish());   // "gpu.hbm_byts: unknown field"
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "laminar/status.h"

namespace laminar::sim::internal {

enum class Need { kRequired, kOptional };

class ObjectReader {
 public:
  // kInvalidArgument naming `path` when `j` is not an object.
  static Result<ObjectReader> open(const nlohmann::json& j, std::string path);

  bool has(std::string_view key) const { return j_->contains(key); }
  // "path.key" (or "key" at the top level).
  std::string path_of(std::string_view key) const;
  // The field's value, marking it read; nullptr when absent.
  const nlohmann::json* child(std::string_view key);

  // A kOptional field that is absent leaves `out` unchanged.
  Status positive(std::string_view key, double& out, Need need);      // finite, > 0
  Status non_negative(std::string_view key, double& out, Need need);  // finite, >= 0
  Status fraction(std::string_view key, double& out, Need need);      // in [0, 1]
  Status integer(std::string_view key, std::int64_t& out, std::int64_t min, Need need);
  Status text(std::string_view key, std::string& out, Need need);

  // kInvalidArgument naming the first field that no call above asked for.
  Status finish() const;

 private:
  ObjectReader(const nlohmann::json& j, std::string path) : j_(&j), path_(std::move(path)) {}
  Result<double> number(std::string_view key);

  const nlohmann::json* j_;
  std::string path_;
  std::set<std::string, std::less<>> read_;
};

// Parses `text` as JSON without exceptions; kInvalidArgument naming `what` when it is not JSON.
Result<nlohmann::json> parse_json(std::string_view text, std::string_view what);

}  // namespace laminar::sim::internal
