#include "workload.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "json_fields.h"
#include "sim_random.h"

namespace laminar::sim {
namespace {

using internal::Need;
using internal::ObjectReader;
using internal::standard_normal;
using internal::uniform01;
using nlohmann::json;

// Standard normal quantile 0.99, for the paper preset's sigma.
constexpr double kZ99 = 2.3263478740408408;

// P(Z <= z) and P(Z > z), each computed directly so the far tail keeps its precision.
double normal_cdf(double z) { return 0.5 * std::erfc(-z / std::sqrt(2.0)); }
double normal_upper(double z) { return 0.5 * std::erfc(z / std::sqrt(2.0)); }

// SplitMix64's finaliser: decorrelates the per-step seeds derived from (seed, step).
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

Result<Distribution> distribution_from(const json& j, const std::string& path, bool allow_max,
                                       std::int64_t* max_tokens);

Result<std::vector<double>> read_values_file(const std::string& file, const std::string& path) {
  std::ifstream in(file);
  if (!in) return invalid_argument(fmt::format("{}: cannot open '{}'", path, file));
  std::vector<double> values;
  std::string token;
  while (in >> token) {
    char* end = nullptr;
    double v = std::strtod(token.c_str(), &end);
    if (end == token.c_str() || *end != '\0') {
      return invalid_argument(fmt::format("{}: '{}' holds '{}', not a number", path, file, token));
    }
    values.push_back(v);
  }
  return values;
}

Result<Distribution> distribution_body(ObjectReader& r, const std::string& path) {
  std::string kind;
  LAMINAR_RETURN_IF_ERROR(r.text("kind", kind, Need::kRequired));
  Result<Distribution> d = invalid_argument(fmt::format(
      "{}: unknown kind '{}' (lognormal, pareto, mixture, observed, constant)", r.path_of("kind"), kind));
  if (kind == "constant") {
    double v = 0;
    LAMINAR_RETURN_IF_ERROR(r.non_negative("value", v, Need::kRequired));
    d = Distribution::constant(v);
  } else if (kind == "lognormal") {
    double sigma = 0;
    LAMINAR_RETURN_IF_ERROR(r.positive("sigma", sigma, Need::kRequired));
    if (r.has("median") == r.has("mean")) {
      return invalid_argument(fmt::format("{}: give exactly one of median and mean", path));
    }
    double center = 0;
    if (r.has("median")) {
      LAMINAR_RETURN_IF_ERROR(r.positive("median", center, Need::kRequired));
      d = Distribution::log_normal(center, sigma);
    } else {
      LAMINAR_RETURN_IF_ERROR(r.positive("mean", center, Need::kRequired));
      d = Distribution::log_normal_from_mean(center, sigma);
    }
  } else if (kind == "pareto") {
    double scale = 0, alpha = 0;
    LAMINAR_RETURN_IF_ERROR(r.positive("scale", scale, Need::kRequired));
    LAMINAR_RETURN_IF_ERROR(r.positive("alpha", alpha, Need::kRequired));
    d = Distribution::pareto(scale, alpha);
  } else if (kind == "mixture") {
    const json* c = r.child("components");
    if (c == nullptr || !c->is_array() || c->empty()) {
      return invalid_argument(fmt::format("{}: must be a non-empty array", r.path_of("components")));
    }
    std::vector<std::pair<double, Distribution>> parts;
    for (std::size_t i = 0; i < c->size(); ++i) {
      std::string cpath = fmt::format("{}[{}]", r.path_of("components"), i);
      Result<ObjectReader> cr = ObjectReader::open((*c)[i], cpath);
      if (!cr.ok()) return cr.status();
      double w = 0;
      LAMINAR_RETURN_IF_ERROR(cr->positive("weight", w, Need::kRequired));
      Result<Distribution> part = distribution_body(*cr, cpath);
      if (!part.ok()) return part.status();
      LAMINAR_RETURN_IF_ERROR(cr->finish());
      parts.emplace_back(w, std::move(*part));
    }
    d = Distribution::mixture(std::move(parts));
  } else if (kind == "observed") {
    if (r.has("values") == r.has("file")) {
      return invalid_argument(fmt::format("{}: give exactly one of values and file", path));
    }
    std::vector<double> values;
    if (r.has("values")) {
      const json* v = r.child("values");
      if (!v->is_array()) return invalid_argument(fmt::format("{}: must be an array", r.path_of("values")));
      for (std::size_t i = 0; i < v->size(); ++i) {
        if (!(*v)[i].is_number()) {
          return invalid_argument(fmt::format("{}[{}]: must be a number, got {}", r.path_of("values"), i,
                                              (*v)[i].dump()));
        }
        values.push_back((*v)[i].get<double>());
      }
    } else {
      std::string file;
      LAMINAR_RETURN_IF_ERROR(r.text("file", file, Need::kRequired));
      Result<std::vector<double>> read = read_values_file(file, r.path_of("file"));
      if (!read.ok()) return read.status();
      values = std::move(*read);
    }
    d = Distribution::observed(std::move(values));
  }
  if (!d.ok()) return d.status().with_context(path);
  return d;
}

// A Distribution object; with `allow_max`, also its "max" (written to *max_tokens).
Result<Distribution> distribution_from(const json& j, const std::string& path, bool allow_max,
                                       std::int64_t* max_tokens) {
  Result<ObjectReader> r = ObjectReader::open(j, path);
  if (!r.ok()) return r.status();
  if (allow_max) LAMINAR_RETURN_IF_ERROR(r->integer("max", *max_tokens, 1, Need::kRequired));
  Result<Distribution> d = distribution_body(*r, path);
  if (!d.ok()) return d.status();
  LAMINAR_RETURN_IF_ERROR(r->finish());
  return d;
}

std::int64_t clamp_length(double x, std::int64_t lo, std::int64_t hi) {
  if (!(x < static_cast<double>(hi))) return hi;  // also catches +inf from a heavy tail
  return std::clamp<std::int64_t>(std::llround(x), lo, hi);
}

Status check_length(const LengthSpec& s, std::string_view name) {
  if (s.max_tokens < 1) {
    return invalid_argument(fmt::format("{}.max: must be >= 1, got {}", name, s.max_tokens));
  }
  return ok_status();
}

}  // namespace

Result<Distribution> Distribution::constant(double value) {
  if (!std::isfinite(value) || value < 0) {
    return invalid_argument(fmt::format("constant: value must be finite and >= 0, got {}", value));
  }
  Distribution d;
  d.a_ = value;
  return d;
}

Result<Distribution> Distribution::log_normal(double median, double sigma) {
  if (!std::isfinite(median) || median <= 0) {
    return invalid_argument(fmt::format("lognormal: median must be > 0, got {}", median));
  }
  if (!std::isfinite(sigma) || sigma <= 0) {
    return invalid_argument(fmt::format("lognormal: sigma must be > 0, got {}", sigma));
  }
  Distribution d;
  d.kind_ = Kind::kLogNormal;
  d.a_ = std::log(median);
  d.b_ = sigma;
  return d;
}

Result<Distribution> Distribution::log_normal_from_mean(double mean, double sigma) {
  if (!std::isfinite(mean) || mean <= 0) {
    return invalid_argument(fmt::format("lognormal: mean must be > 0, got {}", mean));
  }
  if (!std::isfinite(sigma) || sigma <= 0) {
    return invalid_argument(fmt::format("lognormal: sigma must be > 0, got {}", sigma));
  }
  // E[X] = median * exp(sigma^2 / 2) for a log-normal.
  return log_normal(mean * std::exp(-sigma * sigma / 2), sigma);
}

Result<Distribution> Distribution::pareto(double scale, double alpha) {
  if (!std::isfinite(scale) || scale <= 0) {
    return invalid_argument(fmt::format("pareto: scale must be > 0, got {}", scale));
  }
  if (!std::isfinite(alpha) || alpha <= 0) {
    return invalid_argument(fmt::format("pareto: alpha must be > 0, got {}", alpha));
  }
  Distribution d;
  d.kind_ = Kind::kPareto;
  d.a_ = scale;
  d.b_ = alpha;
  return d;
}

Result<Distribution> Distribution::mixture(std::vector<std::pair<double, Distribution>> components) {
  if (components.empty()) return invalid_argument("mixture: needs at least one component");
  double total = 0;
  for (std::size_t i = 0; i < components.size(); ++i) {
    double w = components[i].first;
    if (!std::isfinite(w) || w <= 0) {
      return invalid_argument(fmt::format("mixture: components[{}].weight must be > 0, got {}", i, w));
    }
    total += w;
  }
  Distribution d;
  d.kind_ = Kind::kMixture;
  double cumulative = 0;
  for (auto& [w, part] : components) {
    cumulative += w;
    d.weights_.push_back(cumulative / total);
    d.components_.push_back(std::move(part));
  }
  d.weights_.back() = 1.0;
  return d;
}

Result<Distribution> Distribution::observed(std::vector<double> values) {
  if (values.empty()) return invalid_argument("observed: needs at least one value");
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i]) || values[i] < 0) {
      return invalid_argument(fmt::format("observed: values[{}] must be finite and >= 0, got {}", i,
                                          values[i]));
    }
  }
  std::sort(values.begin(), values.end());
  Distribution d;
  d.kind_ = Kind::kObserved;
  d.values_ = std::move(values);
  return d;
}

Result<Distribution> Distribution::from_json(std::string_view text, std::string_view what) {
  Result<json> j = internal::parse_json(text, what);
  if (!j.ok()) return j.status();
  return distribution_from(*j, std::string(what), /*allow_max=*/false, nullptr);
}

double Distribution::sample(double z, double pick) const {
  switch (kind_) {
    case Kind::kConstant:
      return a_;
    case Kind::kLogNormal:
      return std::exp(a_ + b_ * z);
    case Kind::kPareto:
      // Inverse of P(X > x) = (scale / x)^alpha at the upper tail probability of z.
      return a_ * std::pow(normal_upper(z), -1.0 / b_);
    case Kind::kObserved: {
      auto n = static_cast<double>(values_.size());
      auto i = static_cast<std::size_t>(std::min(n - 1, std::floor(normal_cdf(z) * n)));
      return values_[i];
    }
    case Kind::kMixture: {
      std::size_t i = std::upper_bound(weights_.begin(), weights_.end(), pick) - weights_.begin();
      i = std::min(i, weights_.size() - 1);
      // Rescale `pick` within the chosen component, so a nested mixture gets its own uniform.
      double lo = i == 0 ? 0.0 : weights_[i - 1];
      double inner = (pick - lo) / (weights_[i] - lo);
      return components_[i].sample(z, std::clamp(inner, 0.0, std::nextafter(1.0, 0.0)));
    }
  }
  return a_;
}

double Distribution::draw(std::mt19937_64& rng) const {
  double z = standard_normal(rng);
  return sample(z, uniform01(rng));
}

double Distribution::median() const {
  switch (kind_) {
    case Kind::kConstant: return a_;
    case Kind::kLogNormal: return std::exp(a_);
    case Kind::kPareto: return a_ * std::pow(2.0, 1.0 / b_);
    case Kind::kObserved: return values_[values_.size() / 2];
    case Kind::kMixture: return std::nan("");
  }
  return a_;
}

WorkloadConfig WorkloadConfig::paper_math() {
  WorkloadConfig c;
  c.seed = 1;
  c.prompts_per_step = 512;
  c.samples_per_prompt = 16;
  c.prompt_length = {*Distribution::log_normal(256, 0.5), 2048};
  c.response_length = {*Distribution::log_normal(1500, std::log(10.0) / kZ99), 16384};
  c.group_correlation = 0.5;
  return c;
}

Result<WorkloadConfig> WorkloadConfig::preset(std::string_view name) {
  if (name == "paper_math") return paper_math();
  return invalid_argument(fmt::format("preset: unknown workload preset '{}' (paper_math)", name));
}

Result<WorkloadConfig> WorkloadConfig::from_json(std::string_view text) {
  Result<json> j = internal::parse_json(text, "workload");
  if (!j.ok()) return j.status();
  Result<ObjectReader> r = ObjectReader::open(*j, "");
  if (!r.ok()) return r.status();

  WorkloadConfig c;
  Need need = Need::kRequired;
  if (r->has("preset")) {
    std::string name;
    LAMINAR_RETURN_IF_ERROR(r->text("preset", name, Need::kRequired));
    Result<WorkloadConfig> p = preset(name);
    if (!p.ok()) return p.status();
    c = std::move(*p);
    need = Need::kOptional;
  }
  std::int64_t seed = static_cast<std::int64_t>(c.seed);
  LAMINAR_RETURN_IF_ERROR(r->integer("seed", seed, 0, Need::kOptional));
  c.seed = static_cast<std::uint64_t>(seed);
  LAMINAR_RETURN_IF_ERROR(r->integer("prompts_per_step", c.prompts_per_step, 1, need));
  LAMINAR_RETURN_IF_ERROR(r->integer("samples_per_prompt", c.samples_per_prompt, 1, need));
  for (auto [name, spec] : {std::pair<const char*, LengthSpec*>{"prompt_length", &c.prompt_length},
                            std::pair<const char*, LengthSpec*>{"response_length", &c.response_length}}) {
    const json* v = r->child(name);
    if (v == nullptr) {
      if (need == Need::kRequired) return invalid_argument(fmt::format("{}: required field is missing", name));
      continue;
    }
    Result<Distribution> d = distribution_from(*v, name, /*allow_max=*/true, &spec->max_tokens);
    if (!d.ok()) return d.status();
    spec->distribution = std::move(*d);
  }
  // Optional even without a preset: independent lengths and no tools are the plain defaults.
  LAMINAR_RETURN_IF_ERROR(r->fraction("group_correlation", c.group_correlation, Need::kOptional));
  if (const json* t = r->child("tool_calls")) {
    Result<ObjectReader> tr = ObjectReader::open(*t, "tool_calls");
    if (!tr.ok()) return tr.status();
    ToolCallSpec& tc = c.tool_calls;
    LAMINAR_RETURN_IF_ERROR(tr->fraction("call_probability", tc.call_probability, Need::kRequired));
    LAMINAR_RETURN_IF_ERROR(tr->integer("max_calls", tc.max_calls, 0, Need::kRequired));
    for (auto [name, dist] :
         {std::pair<const char*, Distribution*>{"env_latency_s", &tc.env_latency_s},
          std::pair<const char*, Distribution*>{"observation_tokens", &tc.observation_tokens}}) {
      const json* v = tr->child(name);
      if (v == nullptr) return invalid_argument(fmt::format("{}: required field is missing", tr->path_of(name)));
      Result<Distribution> d = distribution_from(*v, tr->path_of(name), /*allow_max=*/false, nullptr);
      if (!d.ok()) return d.status();
      *dist = std::move(*d);
    }
    LAMINAR_RETURN_IF_ERROR(tr->finish());
  }
  LAMINAR_RETURN_IF_ERROR(r->finish());
  LAMINAR_RETURN_IF_ERROR(c.validate());
  return c;
}

Status WorkloadConfig::validate() const {
  if (prompts_per_step < 1) {
    return invalid_argument(fmt::format("prompts_per_step: must be >= 1, got {}", prompts_per_step));
  }
  if (samples_per_prompt < 1) {
    return invalid_argument(fmt::format("samples_per_prompt: must be >= 1, got {}", samples_per_prompt));
  }
  LAMINAR_RETURN_IF_ERROR(check_length(prompt_length, "prompt_length"));
  LAMINAR_RETURN_IF_ERROR(check_length(response_length, "response_length"));
  // 1 would make every sample of a group identical: that is samples_per_prompt = 1, said plainly.
  if (!(group_correlation >= 0 && group_correlation < 1)) {
    return invalid_argument(fmt::format("group_correlation: must be in [0, 1), got {}", group_correlation));
  }
  if (!(tool_calls.call_probability >= 0 && tool_calls.call_probability <= 1)) {
    return invalid_argument(fmt::format("tool_calls.call_probability: must be in [0, 1], got {}",
                                        tool_calls.call_probability));
  }
  if (tool_calls.max_calls < 0) {
    return invalid_argument(fmt::format("tool_calls.max_calls: must be >= 0, got {}", tool_calls.max_calls));
  }
  return ok_status();
}

std::int64_t StepWorkload::total_response_tokens() const {
  std::int64_t n = 0;
  for (const PromptGroup& g : groups) {
    for (const SampleSpec& s : g.samples) n += s.response_tokens;
  }
  return n;
}

std::int64_t StepWorkload::total_prompt_tokens() const {
  std::int64_t n = 0;
  for (const PromptGroup& g : groups) n += g.prompt_tokens * static_cast<std::int64_t>(g.samples.size());
  return n;
}

Result<Workload> Workload::create(WorkloadConfig config) {
  LAMINAR_RETURN_IF_ERROR(config.validate());
  return Workload(std::move(config));
}

Result<StepWorkload> Workload::step(std::int64_t step) const {
  if (step < 0) return invalid_argument(fmt::format("step: must be >= 0, got {}", step));
  const WorkloadConfig& c = config_;
  std::mt19937_64 rng(mix(c.seed ^ mix(static_cast<std::uint64_t>(step))));
  // Gaussian copula: z = sqrt(rho) * shared + sqrt(1 - rho) * own has unit variance and
  // correlation rho between two samples of one prompt.
  const double shared_weight = std::sqrt(c.group_correlation);
  const double own_weight = std::sqrt(1.0 - c.group_correlation);
  const ToolCallSpec& tc = c.tool_calls;

  StepWorkload out;
  out.step = step;
  out.groups.reserve(static_cast<std::size_t>(c.prompts_per_step));
  for (std::int64_t p = 0; p < c.prompts_per_step; ++p) {
    PromptGroup g;
    g.prompt_index = p;
    g.prompt_tokens = clamp_length(c.prompt_length.distribution.draw(rng), 1, c.prompt_length.max_tokens);
    const double shared = standard_normal(rng);
    g.samples.reserve(static_cast<std::size_t>(c.samples_per_prompt));
    for (std::int64_t s = 0; s < c.samples_per_prompt; ++s) {
      SampleSpec x;
      double z = shared_weight * shared + own_weight * standard_normal(rng);
      x.response_tokens = clamp_length(c.response_length.distribution.sample(z, uniform01(rng)), 1,
                                       c.response_length.max_tokens);
      std::int64_t calls = 0;
      while (calls < tc.max_calls && uniform01(rng) < tc.call_probability) ++calls;
      // Each segment generates at least one token.
      calls = std::min(calls, x.response_tokens - 1);
      const std::int64_t segments = calls + 1;
      for (std::int64_t t = 0; t < segments; ++t) {
        Turn turn;
        turn.generate_tokens = x.response_tokens / segments + (t < x.response_tokens % segments ? 1 : 0);
        if (t < calls) {
          // Capped at 1e9 s so a heavy tail cannot overflow the nanosecond count.
          double latency_s = std::min(tc.env_latency_s.draw(rng), 1e9);
          turn.env_latency = Duration(std::llround(latency_s * 1e9));
          turn.observation_tokens =
              clamp_length(tc.observation_tokens.draw(rng), 0, std::numeric_limits<std::int32_t>::max());
        }
        x.turns.push_back(turn);
      }
      g.samples.push_back(std::move(x));
    }
    out.groups.push_back(std::move(g));
  }
  return out;
}

}  // namespace laminar::sim
