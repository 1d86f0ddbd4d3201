#include "rollout_dispatch_wire.h"

#include <fmt/format.h>

#include <string>

#include "byte_codec.h"

namespace laminar::internal {
namespace {

constexpr const char* kRequest = "dispatch request";
constexpr const char* kGrant = "dispatch grant";
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

}  // namespace laminar::internal
