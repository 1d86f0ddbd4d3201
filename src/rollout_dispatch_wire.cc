#include "rollout_dispatch_wire.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <string>

#include "byte_codec.h"

namespace laminar::internal {
namespace {

constexpr const char* kRequest = "dispatch request";
constexpr const char* kGrant = "dispatch grant";
constexpr const char* kSnapshot = "dispatcher snapshot";
constexpr std::size_t kGroupHeaderBytes = 8 + 1 + 8 + 8;
constexpr std::size_t kSampleBytes = 8 + 8 + 4 + 8 + 4;  // with an empty payload

// n u64 ids, the count checked against `limit` and against the bytes left.
Status read_ids(ByteReader& r, std::string_view field, std::size_t limit, std::string_view what,
                std::vector<TrajectoryId>& out) {
  std::uint32_t n = 0;
  LAMINAR_RETURN_IF_ERROR(read_count(r, field, limit, what, n));
  std::vector<std::uint64_t> raw;
  r.array(field, n, raw);
  LAMINAR_RETURN_IF_ERROR(r.status());
  out.reserve(n);
  for (std::uint64_t id : raw) out.emplace_back(id);
  return ok_status();
}

}  // namespace

std::vector<std::byte> encode_dispatch_request(const DispatchRequestMessage& m) {
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.reserve(33 + 8 * (m.request.held.size() + m.request.returned.size()));
  w.u32(m.worker.value());
  w.u64(m.request.version.value());
  w.u32(m.request.free_slots);
  w.i64(m.request.wait.count());
  w.u8(m.request.idle_pull ? 1 : 0);
  write_count(w, m.request.held.size());
  for (TrajectoryId id : m.request.held) w.u64(id.value());
  write_count(w, m.request.returned.size());
  for (TrajectoryId id : m.request.returned) w.u64(id.value());
  return out;
}

Result<DispatchRequestMessage> decode_dispatch_request(std::span<const std::byte> body, std::size_t max_held) {
  ByteReader r(body, kRequest);
  DispatchRequestMessage m;
  m.worker = WorkerId(r.u32("worker"));
  m.request.version = Version(r.u64("version"));
  m.request.free_slots = r.u32("free_slots");
  m.request.wait = Duration(r.i64("wait"));
  const std::uint8_t idle_pull = r.u8("idle_pull");
  LAMINAR_RETURN_IF_ERROR(r.status());
  if (m.request.wait < Duration::zero()) {
    return invalid_argument(fmt::format("{}: wait {} ns", kRequest, m.request.wait.count()));
  }
  if (idle_pull > 1) return invalid_argument(fmt::format("{}: idle_pull flag {}", kRequest, idle_pull));
  m.request.idle_pull = idle_pull == 1;
  LAMINAR_RETURN_IF_ERROR(read_ids(r, "held count", max_held, kRequest, m.request.held));
  LAMINAR_RETURN_IF_ERROR(read_ids(r, "returned count", max_held, kRequest, m.request.returned));
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return m;
}

std::vector<std::byte> encode_grant(const Grant& g) {
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.u8(std::uint8_t(g.kind));
  w.u8(g.interrupt ? 1 : 0);
  w.u64(g.pull_version.value());
  w.u64(g.newest.value());
  write_count(w, g.samples.size());
  for (const Sample& s : g.samples) {
    w.u64(s.id.value());
    w.u64(s.prompt_index);
    w.u32(s.sample_index);
    w.u64(s.seed);
    w.prefixed(s.payload);
  }
  write_count(w, g.drop.size());
  for (TrajectoryId id : g.drop) w.u64(id.value());
  return out;
}

Result<Grant> decode_grant(std::span<const std::byte> body, std::size_t max_samples, std::size_t max_drop,
                           std::size_t max_payload) {
  ByteReader r(body, kGrant);
  Grant g;
  const std::size_t kind_at = r.offset();
  const std::uint8_t kind = r.u8("kind");
  const std::uint8_t interrupt = r.u8("interrupt");
  g.pull_version = Version(r.u64("pull_version"));
  g.newest = Version(r.u64("newest"));
  LAMINAR_RETURN_IF_ERROR(r.status());
  if (kind > std::uint8_t(GrantKind::kNothing)) {
    return invalid_argument(fmt::format("{}: kind {} at offset {} is unknown", kGrant, kind, kind_at));
  }
  if (interrupt > 1) return invalid_argument(fmt::format("{}: interrupt flag {}", kGrant, interrupt));
  g.kind = GrantKind(kind);
  g.interrupt = interrupt == 1;
  std::uint32_t n = 0;
  LAMINAR_RETURN_IF_ERROR(read_count(r, "sample count", max_samples, kGrant, n));
  if (std::uint64_t(n) * kSampleBytes > r.left()) {
    r.fail(r.offset(), fmt::format("sample count {} runs past the end", n));
    return r.status();
  }
  g.samples.resize(n);
  for (Sample& s : g.samples) {
    s.id = TrajectoryId(r.u64("sample id"));
    s.prompt_index = r.u64("prompt_index");
    s.sample_index = r.u32("sample_index");
    s.seed = r.u64("seed");
    s.payload = std::string(r.prefixed("payload", max_payload));
    LAMINAR_RETURN_IF_ERROR(r.status());
  }
  LAMINAR_RETURN_IF_ERROR(read_ids(r, "drop count", max_drop, kGrant, g.drop));
  LAMINAR_RETURN_IF_ERROR(r.finish());
  if ((g.kind == GrantKind::kWork) != !g.samples.empty()) {
    return invalid_argument(fmt::format("{}: kind {} with {} samples", kGrant, kind, g.samples.size()));
  }
  return g;
}

std::vector<std::byte> encode_snapshot(const DispatcherSnapshot& s) {
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.reserve(24 + s.open.size() * (kGroupHeaderBytes + s.group_size));
  w.u32(s.group_size);
  w.u64(s.first_prompt);
  w.u64(s.groups_made);
  write_count(w, s.open.size());
  for (const DispatcherSnapshot::Group& g : s.open) {
    w.u64(g.index);
    w.u8(g.stream ? 1 : 0);
    w.u64(g.version_min.value());
    w.u64(g.version_max.value());
    for (DispatcherSnapshot::SampleState st : g.samples) w.u8(std::uint8_t(st));
  }
  return out;
}

Result<DispatcherSnapshot> decode_snapshot(std::span<const std::byte> bytes) {
  ByteReader r(bytes, kSnapshot);
  DispatcherSnapshot s;
  s.group_size = r.u32("group_size");
  s.first_prompt = r.u64("first_prompt");
  s.groups_made = r.u64("groups_made");
  const std::size_t count_at = r.offset();
  const std::uint32_t n = r.u32("open count");
  LAMINAR_RETURN_IF_ERROR(r.status());
  // Each group's bytes before any is allocated: a count the bytes cannot hold is refused whole.
  if (s.group_size == 0 && n > 0) return invalid_argument(fmt::format("{}: group_size 0", kSnapshot));
  if (n > 0 && (s.group_size > r.left() || n > r.left() / (kGroupHeaderBytes + s.group_size))) {
    r.fail(count_at, fmt::format("open count {} of groups of {} runs past the end", n, s.group_size));
    return r.status();
  }
  s.open.resize(n);
  for (DispatcherSnapshot::Group& g : s.open) {
    g.index = r.u64("group index");
    const std::size_t stream_at = r.offset();
    const std::uint8_t stream = r.u8("stream");
    g.version_min = Version(r.u64("version_min"));
    g.version_max = Version(r.u64("version_max"));
    const std::string_view states = r.bytes("sample states", s.group_size);
    LAMINAR_RETURN_IF_ERROR(r.status());
    if (stream > 1) return invalid_argument(fmt::format("{}: stream flag {} at offset {}", kSnapshot, stream, stream_at));
    g.stream = stream == 1;
    for (char c : states) {
      if (std::uint8_t(c) > std::uint8_t(DispatcherSnapshot::SampleState::kCompleted)) {
        return invalid_argument(fmt::format("{}: group {} has a sample in state {}", kSnapshot, g.index, int(std::uint8_t(c))));
      }
      g.samples.push_back(DispatcherSnapshot::SampleState(std::uint8_t(c)));
    }
  }
  LAMINAR_RETURN_IF_ERROR(r.finish());
  LAMINAR_RETURN_IF_ERROR(check_snapshot(s));
  return s;
}

Status check_snapshot(const DispatcherSnapshot& s) {
  if (s.group_size == 0) return invalid_argument(fmt::format("{}: group_size 0", kSnapshot));
  const std::uint64_t max_prompt = std::numeric_limits<std::uint64_t>::max() / s.group_size - 1;
  if (s.first_prompt > max_prompt || s.groups_made > max_prompt - s.first_prompt) {
    return invalid_argument(fmt::format("{}: first_prompt {} and {} groups made overflow trajectory ids of groups of {}",
                                        kSnapshot, s.first_prompt, s.groups_made, s.group_size));
  }
  std::optional<std::uint64_t> previous;
  for (const DispatcherSnapshot::Group& g : s.open) {
    if (g.index >= s.groups_made || (previous && g.index <= *previous)) {
      return invalid_argument(fmt::format("{}: open group {} is not below {} groups made and after group {}", kSnapshot,
                                          g.index, s.groups_made, previous ? std::to_string(*previous) : "none"));
    }
    previous = g.index;
    if (g.samples.size() != s.group_size) {
      return invalid_argument(fmt::format("{}: open group {} has {} samples, not {}", kSnapshot, g.index,
                                          g.samples.size(), s.group_size));
    }
    for (DispatcherSnapshot::SampleState st : g.samples) {
      if (st > DispatcherSnapshot::SampleState::kCompleted) {
        return invalid_argument(fmt::format("{}: group {} has a sample in state {}", kSnapshot, g.index, int(st)));
      }
    }
    if (std::ranges::all_of(g.samples, [](auto st) { return st == DispatcherSnapshot::SampleState::kCompleted; })) {
      return invalid_argument(fmt::format("{}: open group {} has every sample completed", kSnapshot, g.index));
    }
    if (!g.stream && g.version_min > g.version_max) {
      return invalid_argument(fmt::format("{}: group {} is for versions [{}, {}]", kSnapshot, g.index,
                                          g.version_min.value(), g.version_max.value()));
    }
  }
  return ok_status();
}

}  // namespace laminar::internal
