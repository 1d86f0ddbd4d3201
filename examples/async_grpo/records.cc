#include "records.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

namespace async_grpo {
namespace {

using laminar::Result;
using laminar::Status;
using nlohmann::json;

constexpr std::array<std::string_view, kNumSpanKinds> kSpanKindNames = {
    "decode", "prefill", "pull", "migrate_out", "migrate_in", "train", "publish", "idle-wait"};

Status check_interval(std::string_view what, std::int64_t start_ns, std::int64_t end_ns) {
  if (start_ns < 0) return laminar::invalid_argument(fmt::format("{}: start_ns {} is negative", what, start_ns));
  if (end_ns < start_ns) {
    return laminar::invalid_argument(
        fmt::format("{}: end_ns {} is before start_ns {}", what, end_ns, start_ns));
  }
  return laminar::ok_status();
}

Status check(const Span& s) {
  LAMINAR_RETURN_IF_ERROR(check_name("span", s.process));
  return check_interval(fmt::format("{} span of {}", span_kind_name(s.kind), s.process), s.start_ns, s.end_ns);
}

Status check(const RewardPoint& r) {
  if (r.time_ns < 0) return laminar::invalid_argument(fmt::format("reward: time_ns {} is negative", r.time_ns));
  if (!std::isfinite(r.mean_reward)) {
    return laminar::invalid_argument(fmt::format("reward at version {}: mean_reward {} is not finite", r.version,
                                                 r.mean_reward));
  }
  if (r.samples == 0) {
    return laminar::invalid_argument(fmt::format("reward at version {}: samples is 0", r.version));
  }
  return laminar::ok_status();
}

Status check(const TrajectoryFact& t) {
  if (t.trained_version < t.behaviour_version) {
    return laminar::invalid_argument(fmt::format("trajectory: trained_version {} is before behaviour_version {}",
                                                 t.trained_version, t.behaviour_version));
  }
  if (t.length == 0) return laminar::invalid_argument("trajectory: length is 0");
  return laminar::ok_status();
}

Status check(const RepackEvent& r) {
  if (r.time_ns < 0) return laminar::invalid_argument(fmt::format("repack: time_ns {} is negative", r.time_ns));
  return laminar::ok_status();
}

Status check(const WeightSync& w) {
  LAMINAR_RETURN_IF_ERROR(check_name("weight sync", w.process));
  return check_interval(fmt::format("weight sync of {} to version {}", w.process, w.version), w.start_ns,
                        w.end_ns);
}

json to_json(const Span& s) {
  return {{"type", "span"},          {"process", s.process},     {"worker", s.worker},
          {"kind", span_kind_name(s.kind)}, {"start_ns", s.start_ns},   {"end_ns", s.end_ns},
          {"version", s.version},    {"sequences", s.sequences}, {"bytes", s.bytes},
          {"tokens", s.tokens}};
}
json to_json(const RewardPoint& r) {
  return {{"type", "reward"},
          {"time_ns", r.time_ns},
          {"version", r.version},
          {"mean_reward", r.mean_reward},
          {"samples", r.samples}};
}
json to_json(const TrajectoryFact& t) {
  return {{"type", "trajectory"},
          {"behaviour_version", t.behaviour_version},
          {"trained_version", t.trained_version},
          {"length", t.length},
          {"group", t.group}};
}
json to_json(const RepackEvent& r) {
  return {{"type", "repack"}, {"time_ns", r.time_ns}, {"moved_sequences", r.moved_sequences}, {"bytes", r.bytes}};
}
json to_json(const WeightSync& w) {
  return {{"type", "weight_sync"},
          {"process", w.process},
          {"version", w.version},
          {"start_ns", w.start_ns},
          {"end_ns", w.end_ns}};
}

// One field of a record: its key and where its value goes.
template <class T>
struct Field {
  const char* key;
  T* out;
};
// Spelled out for clang before 17, which deduces no aggregate's template arguments (the fuzz target
// builds this file with clang).
template <class T>
Field(const char*, T*) -> Field<T>;

// Reads the fields of one decoded object, rejecting missing, mistyped and unknown ones.
class Fields {
 public:
  Fields(const json& obj, std::string_view type) : obj_(obj), type_(type) {}

  // Reads every field of a record that has exactly these: the keys are written once, so the
  // fields read and the fields allowed cannot drift apart. The first field that fails stops it.
  template <class... T>
  Status read(Field<T>... fields) const {
    LAMINAR_RETURN_IF_ERROR(check_keys({std::string_view(fields.key)...}));
    Status st;
    (void)((st = get(fields.key, fields.out)).ok() && ...);
    return st;
  }

  Status check_keys(std::initializer_list<std::string_view> keys) const {
    for (auto it = obj_.begin(); it != obj_.end(); ++it) {
      bool known = it.key() == "type";
      for (std::string_view k : keys) known = known || it.key() == k;
      if (!known) return laminar::invalid_argument(fmt::format("{} record: unknown field '{}'", type_, it.key()));
    }
    return laminar::ok_status();
  }

  Status get(const char* key, std::uint64_t* out) const {
    Result<const json*> v = find(key);
    if (!v.ok()) return v.status();
    if (!(*v)->is_number_unsigned()) return wrong(key, "a non-negative integer", **v);
    *out = (*v)->get<std::uint64_t>();
    return laminar::ok_status();
  }
  Status get(const char* key, std::uint32_t* out) const {
    std::uint64_t wide = 0;
    LAMINAR_RETURN_IF_ERROR(get(key, &wide));
    if (wide > std::numeric_limits<std::uint32_t>::max()) return wrong(key, "a 32-bit integer", *find(key).value());
    *out = static_cast<std::uint32_t>(wide);
    return laminar::ok_status();
  }
  Status get(const char* key, std::int64_t* out) const {
    Result<const json*> v = find(key);
    if (!v.ok()) return v.status();
    bool fits = (*v)->is_number_integer() &&
                !((*v)->is_number_unsigned() &&
                  (*v)->get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()));
    if (!fits) return wrong(key, "a 64-bit integer", **v);
    *out = (*v)->get<std::int64_t>();
    return laminar::ok_status();
  }
  Status get(const char* key, double* out) const {
    Result<const json*> v = find(key);
    if (!v.ok()) return v.status();
    if (!(*v)->is_number()) return wrong(key, "a number", **v);
    *out = (*v)->get<double>();
    return laminar::ok_status();
  }
  Status get(const char* key, std::string* out) const {
    Result<const json*> v = find(key);
    if (!v.ok()) return v.status();
    if (!(*v)->is_string()) return wrong(key, "a string", **v);
    *out = (*v)->get<std::string>();
    return laminar::ok_status();
  }

 private:
  Result<const json*> find(const char* key) const {
    auto it = obj_.find(key);
    if (it == obj_.end()) return laminar::invalid_argument(fmt::format("{} record: missing field '{}'", type_, key));
    return &*it;
  }
  Status wrong(const char* key, std::string_view expected, const json& got) const {
    return laminar::invalid_argument(fmt::format("{} record: field '{}' must be {}, got {}", type_, key, expected,
                                                 got.dump(-1, ' ', false, json::error_handler_t::replace)));
  }

  const json& obj_;
  std::string_view type_;
};

Result<Record> decode_span(const Fields& f) {
  Span s;
  std::string kind;
  LAMINAR_RETURN_IF_ERROR(f.read(Field{"process", &s.process}, Field{"worker", &s.worker}, Field{"kind", &kind},
                                 Field{"start_ns", &s.start_ns}, Field{"end_ns", &s.end_ns},
                                 Field{"version", &s.version}, Field{"sequences", &s.sequences},
                                 Field{"bytes", &s.bytes}, Field{"tokens", &s.tokens}));
  Result<SpanKind> k = parse_span_kind(kind);
  if (!k.ok()) return k.status();
  s.kind = *k;
  return Record(std::move(s));
}

Result<Record> decode_reward(const Fields& f) {
  RewardPoint r;
  LAMINAR_RETURN_IF_ERROR(f.read(Field{"time_ns", &r.time_ns}, Field{"version", &r.version},
                                 Field{"mean_reward", &r.mean_reward}, Field{"samples", &r.samples}));
  return Record(r);
}

Result<Record> decode_trajectory(const Fields& f) {
  TrajectoryFact t;
  LAMINAR_RETURN_IF_ERROR(f.read(Field{"behaviour_version", &t.behaviour_version},
                                 Field{"trained_version", &t.trained_version}, Field{"length", &t.length},
                                 Field{"group", &t.group}));
  return Record(t);
}

Result<Record> decode_repack(const Fields& f) {
  RepackEvent r;
  LAMINAR_RETURN_IF_ERROR(f.read(Field{"time_ns", &r.time_ns}, Field{"moved_sequences", &r.moved_sequences},
                                 Field{"bytes", &r.bytes}));
  return Record(r);
}

Result<Record> decode_weight_sync(const Fields& f) {
  WeightSync w;
  LAMINAR_RETURN_IF_ERROR(f.read(Field{"process", &w.process}, Field{"version", &w.version},
                                 Field{"start_ns", &w.start_ns}, Field{"end_ns", &w.end_ns}));
  return Record(std::move(w));
}

}  // namespace

Status check_name(std::string_view what, std::string_view name) {
  if (name.empty() || name.size() > 64) {
    return laminar::invalid_argument(
        fmt::format("{}: name must be 1 to 64 characters, got {}", what, name.size()));
  }
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
              c == '-' || c == '.';
    if (!ok) {
      return laminar::invalid_argument(
          fmt::format("{}: name '{}' may hold only letters, digits, '_', '-' and '.'", what, name));
    }
  }
  return laminar::ok_status();
}

std::string_view span_kind_name(SpanKind kind) noexcept {
  auto i = static_cast<std::size_t>(kind);
  return i < kSpanKindNames.size() ? kSpanKindNames[i] : std::string_view("unknown");
}

Result<SpanKind> parse_span_kind(std::string_view name) {
  for (std::size_t i = 0; i < kSpanKindNames.size(); ++i) {
    if (kSpanKindNames[i] == name) return static_cast<SpanKind>(i);
  }
  return laminar::invalid_argument(fmt::format(
      "unknown span kind '{}' (expected decode, prefill, pull, migrate_out, migrate_in, train, publish or "
      "idle-wait)",
      name));
}

void Records::add(Record record) {
  std::visit(
      [this](auto&& r) {
        using T = std::decay_t<decltype(r)>;
        if constexpr (std::is_same_v<T, Span>) spans.push_back(std::move(r));
        if constexpr (std::is_same_v<T, RewardPoint>) rewards.push_back(r);
        if constexpr (std::is_same_v<T, TrajectoryFact>) trajectories.push_back(r);
        if constexpr (std::is_same_v<T, RepackEvent>) repacks.push_back(r);
        if constexpr (std::is_same_v<T, WeightSync>) syncs.push_back(std::move(r));
      },
      std::move(record));
}

void Records::append(Records other) {
  auto move_all = [](auto& into, auto& from) {
    into.insert(into.end(), std::make_move_iterator(from.begin()), std::make_move_iterator(from.end()));
  };
  move_all(spans, other.spans);
  move_all(rewards, other.rewards);
  move_all(trajectories, other.trajectories);
  move_all(repacks, other.repacks);
  move_all(syncs, other.syncs);
}

Status validate_record(const Record& record) {
  return std::visit([](const auto& r) { return check(r); }, record);
}

Result<std::string> encode_record(const Record& record) {
  LAMINAR_RETURN_IF_ERROR(validate_record(record));
  json j = std::visit([](const auto& r) { return to_json(r); }, record);
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

Result<Record> decode_record(std::string_view line) {
  json j = json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return laminar::invalid_argument("not valid JSON");
  if (!j.is_object()) return laminar::invalid_argument("a record must be a JSON object");
  auto type = j.find("type");
  if (type == j.end() || !type->is_string()) return laminar::invalid_argument("record has no string field 'type'");
  const std::string t = type->get<std::string>();
  Fields f(j, t);
  Result<Record> r = laminar::invalid_argument(
      fmt::format("unknown record type '{}' (expected span, reward, trajectory, repack or weight_sync)", t));
  if (t == "span") r = decode_span(f);
  if (t == "reward") r = decode_reward(f);
  if (t == "trajectory") r = decode_trajectory(f);
  if (t == "repack") r = decode_repack(f);
  if (t == "weight_sync") r = decode_weight_sync(f);
  if (!r.ok()) return r.status();
  LAMINAR_RETURN_IF_ERROR(validate_record(*r));
  return r;
}

Result<Records> parse_records(std::string_view text, std::string_view source) {
  Records out;
  std::size_t line_no = 0;
  while (!text.empty()) {
    ++line_no;
    std::size_t nl = text.find('\n');
    if (nl == std::string_view::npos) {
      return laminar::data_loss(fmt::format("{} line {}: truncated record (no newline at the end): '{}'", source,
                                            line_no, text.substr(0, 80)));
    }
    std::string_view line = text.substr(0, nl);
    text.remove_prefix(nl + 1);
    Result<Record> r = decode_record(line);
    if (!r.ok()) return r.status().with_context(fmt::format("{} line {}", source, line_no));
    out.add(std::move(*r));
  }
  return out;
}

Result<Records> read_records(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return laminar::not_found(fmt::format("cannot read record file {}", path.string()));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return laminar::unavailable(fmt::format("reading record file {} failed", path.string()));
  return parse_records(text.str(), path.string());
}

ActorWaits actor_waits(const Records& records) {
  ActorWaits w;
  for (const Span& sp : records.spans) {
    if (sp.kind == SpanKind::kIdleWait && sp.process == "actor") w.by_end_ns[sp.end_ns] = sp.end_ns - sp.start_ns;
  }
  std::int64_t first = INT64_MAX;
  for (const auto& [end, ns] : w.by_end_ns) {
    w.total_ns += ns;
    first = std::min(first, end - ns);
  }
  if (!w.by_end_ns.empty()) w.first_start_ns = first;
  return w;
}

Result<Records> read_record_dir(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return laminar::not_found(fmt::format("record directory {} does not exist", dir.string()));
  }
  std::vector<std::filesystem::path> files;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().extension() == ".jsonl" && it->is_regular_file(ec)) files.push_back(it->path());
  }
  if (ec) return laminar::unavailable(fmt::format("listing record directory {}: {}", dir.string(), ec.message()));
  std::sort(files.begin(), files.end());
  Records all;
  for (const std::filesystem::path& f : files) {
    Result<Records> r = read_records(f);
    if (!r.ok()) return r.status();
    all.append(std::move(*r));
  }
  return all;
}

Result<RecordWriter> RecordWriter::open(const std::filesystem::path& path) {
  std::unique_ptr<std::FILE, FileCloser> f(std::fopen(path.c_str(), "wb"));
  if (!f) return laminar::unavailable(fmt::format("cannot open record file {} for writing", path.string()));
  return RecordWriter(std::move(f), path);
}

Status RecordWriter::write(const Record& record) {
  Result<std::string> line = encode_record(record);
  if (!line.ok()) return line.status();
  line->push_back('\n');
  std::lock_guard<std::mutex> lock(*mu_);
  if (std::fwrite(line->data(), 1, line->size(), file_.get()) != line->size() || std::fflush(file_.get()) != 0) {
    return laminar::unavailable(fmt::format("writing record file {} failed", path_.string()));
  }
  return laminar::ok_status();
}

}  // namespace async_grpo
