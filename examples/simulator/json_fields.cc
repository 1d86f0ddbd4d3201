#include "json_fields.h"

#include <cmath>

#include <fmt/format.h>

namespace laminar::sim::internal {

Result<ObjectReader> ObjectReader::open(const nlohmann::json& j, std::string path) {
  if (!j.is_object()) {
    return invalid_argument(fmt::format("{}: must be a JSON object, got {}",
                                        path.empty() ? "config" : path, j.dump()));
  }
  return ObjectReader(j, std::move(path));
}

std::string ObjectReader::path_of(std::string_view key) const {
  return path_.empty() ? std::string(key) : fmt::format("{}.{}", path_, key);
}

const nlohmann::json* ObjectReader::child(std::string_view key) {
  auto it = j_->find(key);
  if (it == j_->end()) return nullptr;
  read_.emplace(key);
  return &*it;
}

Result<double> ObjectReader::number(std::string_view key) {
  const nlohmann::json* v = child(key);
  if (v == nullptr) return not_found(fmt::format("{}: required field is missing", path_of(key)));
  if (!v->is_number()) {
    return invalid_argument(fmt::format("{}: must be a number, got {}", path_of(key), v->dump()));
  }
  double x = v->get<double>();
  if (!std::isfinite(x)) return invalid_argument(fmt::format("{}: must be finite", path_of(key)));
  return x;
}

namespace {
// A missing required field is the caller's input to fix, like any other bad field.
Status missing(const Status& s) { return invalid_argument(s.message()); }
}  // namespace

Status ObjectReader::positive(std::string_view key, double& out, Need need) {
  if (need == Need::kOptional && !has(key)) return ok_status();
  Result<double> x = number(key);
  if (!x.ok()) return missing(x.status());
  if (!(*x > 0)) return invalid_argument(fmt::format("{}: must be > 0, got {}", path_of(key), *x));
  out = *x;
  return ok_status();
}

Status ObjectReader::non_negative(std::string_view key, double& out, Need need) {
  if (need == Need::kOptional && !has(key)) return ok_status();
  Result<double> x = number(key);
  if (!x.ok()) return missing(x.status());
  if (*x < 0) return invalid_argument(fmt::format("{}: must be >= 0, got {}", path_of(key), *x));
  out = *x;
  return ok_status();
}

Status ObjectReader::fraction(std::string_view key, double& out, Need need) {
  if (need == Need::kOptional && !has(key)) return ok_status();
  Result<double> x = number(key);
  if (!x.ok()) return missing(x.status());
  if (*x < 0 || *x > 1) {
    return invalid_argument(fmt::format("{}: must be in [0, 1], got {}", path_of(key), *x));
  }
  out = *x;
  return ok_status();
}

Status ObjectReader::integer(std::string_view key, std::int64_t& out, std::int64_t min, Need need) {
  if (need == Need::kOptional && !has(key)) return ok_status();
  const nlohmann::json* v = child(key);
  if (v == nullptr) return invalid_argument(fmt::format("{}: required field is missing", path_of(key)));
  if (!v->is_number_integer()) {
    return invalid_argument(fmt::format("{}: must be an integer, got {}", path_of(key), v->dump()));
  }
  if (v->is_number_unsigned() && v->get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX)) {
    return invalid_argument(fmt::format("{}: too large, got {}", path_of(key), v->dump()));
  }
  std::int64_t x = v->get<std::int64_t>();
  if (x < min) return invalid_argument(fmt::format("{}: must be >= {}, got {}", path_of(key), min, x));
  out = x;
  return ok_status();
}

Status ObjectReader::text(std::string_view key, std::string& out, Need need) {
  if (need == Need::kOptional && !has(key)) return ok_status();
  const nlohmann::json* v = child(key);
  if (v == nullptr) return invalid_argument(fmt::format("{}: required field is missing", path_of(key)));
  if (!v->is_string()) {
    return invalid_argument(fmt::format("{}: must be a string, got {}", path_of(key), v->dump()));
  }
  out = v->get<std::string>();
  return ok_status();
}

Status ObjectReader::finish() const {
  for (auto it = j_->begin(); it != j_->end(); ++it) {
    if (!read_.contains(it.key())) {
      return invalid_argument(fmt::format("{}: unknown field", path_of(it.key())));
    }
  }
  return ok_status();
}

Result<nlohmann::json> parse_json(std::string_view text, std::string_view what) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return invalid_argument(fmt::format("{}: not valid JSON", what));
  return j;
}

}  // namespace laminar::sim::internal
