// The repack protocol's message bodies (see repack_wire.h).
#include "repack_wire.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <string_view>

#include "byte_codec.h"

namespace laminar::internal {
namespace {

constexpr std::string_view kReport = "repack report";
constexpr std::string_view kOrders = "repack orders";

template <class Out>
void write_address(ByteWriter<Out>& w, std::string_view address) {
  LAMINAR_CHECK(address.size() <= kMaxRepackAddressBytes);
  w.prefixed(address);
}

Status read_address(ByteReader& r, std::string_view what, std::string& out) {
  std::uint32_t n = 0;
  LAMINAR_RETURN_IF_ERROR(read_count(r, "address length", kMaxRepackAddressBytes, what, n));
  if (n == 0) return invalid_argument(fmt::format("{}: empty migrator address", what));
  out = std::string(r.bytes("address", n));
  return r.status();
}

bool read_flag(ByteReader& r, std::string_view field) {
  const std::size_t at = r.offset();
  const std::uint8_t v = r.u8(field);
  if (v > 1) r.fail(at, fmt::format("{} is {}, not 0 or 1", field, v));
  return v == 1;
}

bool same_sequence(const SequenceSnapshot& a, const SequenceSnapshot& b) {
  return a.id == b.id && a.tokens == b.tokens && a.pages == b.pages &&
         a.expected_remaining_tokens == b.expected_remaining_tokens;
}

}  // namespace

bool operator==(const RepackReport& a, const RepackReport& b) {
  const WorkerSnapshot& x = a.snapshot;
  const WorkerSnapshot& y = b.snapshot;
  return a.report == b.report && a.migrating == b.migrating && a.migrator_address == b.migrator_address &&
         x.id == y.id && x.version == y.version && x.pages_total == y.pages_total &&
         x.pages_used == y.pages_used && x.slots_total == y.slots_total && x.slots_used == y.slots_used &&
         x.step_time == y.step_time && x.waiting_prompts == y.waiting_prompts &&
         x.kv_stopped_growing == y.kv_stopped_growing &&
         std::equal(x.sequences.begin(), x.sequences.end(), y.sequences.begin(), y.sequences.end(), same_sequence);
}

std::vector<std::byte> encode_repack_report(const RepackReport& m) {
  const WorkerSnapshot& s = m.snapshot;
  LAMINAR_CHECK(s.sequences.size() <= kMaxRepackSequences);
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.reserve(70 + m.migrator_address.size() + 33 * s.sequences.size());
  w.u32(s.id.value());
  w.u64(m.report);
  w.u8(m.migrating ? 1 : 0);
  write_address(w, m.migrator_address);
  w.u64(s.version.value());
  w.i64(s.pages_total);
  w.i64(s.pages_used);
  w.i32(s.slots_total);
  w.i32(s.slots_used);
  w.i64(s.step_time.count());
  w.i64(s.waiting_prompts);
  w.u8(s.kv_stopped_growing ? 1 : 0);
  write_count(w, s.sequences.size());
  for (const SequenceSnapshot& q : s.sequences) {
    w.u64(q.id.value());
    w.i64(q.tokens);
    w.i64(q.pages);
    w.u8(q.expected_remaining_tokens ? 1 : 0);
    if (q.expected_remaining_tokens) w.i64(*q.expected_remaining_tokens);
  }
  return out;
}

Result<RepackReport> decode_repack_report(std::span<const std::byte> body) {
  ByteReader r(body, kReport);
  RepackReport m;
  WorkerSnapshot& s = m.snapshot;
  s.id = WorkerId(r.u32("worker id"));
  m.report = r.u64("report number");
  m.migrating = read_flag(r, "migrating");
  LAMINAR_RETURN_IF_ERROR(r.status());
  const std::string what = fmt::format("{}: worker {}", kReport, s.id.value());
  if (m.report == 0) return invalid_argument(fmt::format("{}: report number 0", what));
  LAMINAR_RETURN_IF_ERROR(read_address(r, what, m.migrator_address));
  s.version = Version(r.u64("version"));
  s.pages_total = r.i64("pages_total");
  s.pages_used = r.i64("pages_used");
  s.slots_total = r.i32("slots_total");
  s.slots_used = r.i32("slots_used");
  s.step_time = Duration(r.i64("step_time_ns"));
  s.waiting_prompts = r.i64("waiting_prompts");
  s.kv_stopped_growing = read_flag(r, "kv_stopped_growing");
  std::uint32_t n = 0;
  LAMINAR_RETURN_IF_ERROR(read_count(r, "sequence count", kMaxRepackSequences, what, n));
  s.sequences.resize(n);
  for (SequenceSnapshot& q : s.sequences) {
    q.id = SequenceId(r.u64("sequence id"));
    q.tokens = r.i64("tokens");
    q.pages = r.i64("pages");
    if (read_flag(r, "expected")) q.expected_remaining_tokens = r.i64("expected remaining tokens");
    LAMINAR_RETURN_IF_ERROR(r.status());
  }
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return m;
}

std::vector<std::byte> encode_repack_orders(const RepackOrders& m) {
  LAMINAR_CHECK(m.destinations.size() <= kMaxRepackSequences);
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.u64(m.plan);
  w.u64(m.report);
  w.u64(m.version.value());
  write_count(w, m.destinations.size());
  for (const RepackDestination& d : m.destinations) {
    w.u32(d.worker.value());
    write_address(w, d.migrator_address);
    write_count(w, d.sequences.size());
    for (SequenceId q : d.sequences) w.u64(q.value());
  }
  return out;
}

Result<RepackOrders> decode_repack_orders(std::span<const std::byte> body) {
  ByteReader r(body, kOrders);
  RepackOrders m;
  m.plan = r.u64("plan number");
  m.report = r.u64("report number");
  m.version = Version(r.u64("version"));
  LAMINAR_RETURN_IF_ERROR(r.status());
  if (m.plan == 0 || m.report == 0) {
    return invalid_argument(fmt::format("{}: plan number {}, report number {}", kOrders, m.plan, m.report));
  }
  std::uint32_t d = 0;
  LAMINAR_RETURN_IF_ERROR(read_count(r, "destination count", kMaxRepackSequences, kOrders, d));
  m.destinations.resize(d);
  std::set<WorkerId> workers;
  std::set<SequenceId> sequences;
  for (RepackDestination& dest : m.destinations) {
    dest.worker = WorkerId(r.u32("worker id"));
    LAMINAR_RETURN_IF_ERROR(r.status());
    const std::string what = fmt::format("{}: destination {}", kOrders, dest.worker.value());
    if (!workers.insert(dest.worker).second) return invalid_argument(fmt::format("{} named twice", what));
    LAMINAR_RETURN_IF_ERROR(read_address(r, what, dest.migrator_address));
    std::uint32_t n = 0;
    const std::uint64_t left = kMaxRepackSequences - sequences.size();
    LAMINAR_RETURN_IF_ERROR(read_count(r, "sequence count", left, what, n));
    if (n == 0) return invalid_argument(fmt::format("{} without sequences", what));
    dest.sequences.resize(n);
    for (SequenceId& q : dest.sequences) {
      q = SequenceId(r.u64("sequence id"));
      LAMINAR_RETURN_IF_ERROR(r.status());
      if (!sequences.insert(q).second) {
        return invalid_argument(fmt::format("{}: sequence {} named twice", what, q.value()));
      }
    }
  }
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return m;
}

}  // namespace laminar::internal
