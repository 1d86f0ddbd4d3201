#include "repack_wire.h"

#include <catch2/catch.hpp>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "wire_checks.h"

using namespace laminar;
using namespace laminar::internal;
using laminar::testing::check_round_trip;
using laminar::testing::check_truncations;

namespace {

RepackReport full_report() {
  RepackReport m;
  m.report = 42;
  m.migrating = true;
  m.migrator_address = "127.0.0.1:41234";
  WorkerSnapshot& s = m.snapshot;
  s.id = WorkerId(3);
  s.version = Version(7);
  s.pages_total = 1000;
  s.pages_used = 12;
  s.slots_total = 64;
  s.slots_used = 3;
  s.step_time = std::chrono::milliseconds(25);
  s.waiting_prompts = 0;
  s.kv_stopped_growing = true;
  s.sequences = {{SequenceId(10), 33, 3, std::nullopt}, {SequenceId(11), 17, 2, 400}};
  return m;
}

RepackOrders full_orders() {
  return {5, 42, Version(7),
          {{WorkerId(1), "127.0.0.1:5000", {SequenceId(10), SequenceId(12)}},
           {WorkerId(2), "10.0.0.2:6000", {SequenceId(11)}}}};
}

template <class M>
void check_refused(const Result<M>& r, StatusCode code, const std::string& text) {
  REQUIRE_FALSE(r.ok());
  INFO(r.status().to_string());
  CHECK(r.status().code() == code);
  CHECK_THAT(r.status().message(), Catch::Contains(text));
}

}  // namespace

TEST_CASE("repack wire: both messages round-trip, empty and full") {
  RepackReport empty;
  empty.report = 1;
  empty.migrator_address = "h:1";
  check_round_trip(empty, encode_repack_report, decode_repack_report);
  check_round_trip(full_report(), encode_repack_report, decode_repack_report);
  check_round_trip(RepackOrders{1, 1, Version(0), {}}, encode_repack_orders, decode_repack_orders);
  check_round_trip(full_orders(), encode_repack_orders, decode_repack_orders);
}

TEST_CASE("repack wire: the largest messages round-trip") {
  RepackReport report = full_report();
  report.report = ~std::uint64_t(0);
  report.migrator_address.assign(kMaxRepackAddressBytes, 'a');
  report.snapshot.sequences.clear();
  for (std::uint32_t i = 0; i < kMaxRepackSequences; ++i) {
    report.snapshot.sequences.push_back({SequenceId(i), -1, std::int64_t(i), std::int64_t(i) * 3});
  }
  check_round_trip(report, encode_repack_report, decode_repack_report);

  RepackOrders orders{~std::uint64_t(0), ~std::uint64_t(0), Version(~std::uint64_t(0)), {}};
  for (std::uint32_t i = 0; i < kMaxRepackSequences; ++i) {
    orders.destinations.push_back({WorkerId(i), std::string(kMaxRepackAddressBytes, 'b'), {SequenceId(i)}});
  }
  check_round_trip(orders, encode_repack_orders, decode_repack_orders);
  RepackOrders one{1, 1, Version(1), {{WorkerId(9), "x:1", {}}}};
  for (std::uint32_t i = 0; i < kMaxRepackSequences; ++i) one.destinations[0].sequences.push_back(SequenceId(i));
  check_round_trip(one, encode_repack_orders, decode_repack_orders);
}

TEST_CASE("repack wire: every truncation is kDataLoss naming an offset, and trailing bytes are refused") {
  check_truncations(encode_repack_report(full_report()), decode_repack_report);
  check_truncations(encode_repack_orders(full_orders()), decode_repack_orders);
}

TEST_CASE("repack wire: the report's layout, byte for byte") {
  RepackReport m;
  m.report = 0x0102030405060708ULL;
  m.migrator_address = "h:1";
  m.snapshot.id = WorkerId(2);
  m.snapshot.version = Version(5);
  m.snapshot.pages_total = 9;
  m.snapshot.pages_used = 1;
  m.snapshot.slots_total = 4;
  m.snapshot.slots_used = 1;
  m.snapshot.step_time = Duration(3);
  m.snapshot.kv_stopped_growing = true;
  m.snapshot.sequences = {{SequenceId(6), 4, 1, 8}};
  const std::vector<std::uint8_t> expected = {
      2,    0,    0,    0,                           // u32 worker id
      0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,  // u64 report number
      0,                                             // flag migrating
      3,    0,    0,    0,    'h',  ':',  '1',       // blob migrator address
      5,    0,    0,    0,    0,    0,    0,    0,     // u64 version
      9,    0,    0,    0,    0,    0,    0,    0,     // i64 pages_total
      1,    0,    0,    0,    0,    0,    0,    0,     // i64 pages_used
      4,    0,    0,    0,                           // i32 slots_total
      1,    0,    0,    0,                           // i32 slots_used
      3,    0,    0,    0,    0,    0,    0,    0,     // i64 step_time_ns
      0,    0,    0,    0,    0,    0,    0,    0,     // i64 waiting_prompts
      1,                                             // flag kv_stopped_growing
      1,    0,    0,    0,                           // u32 n
      6,    0,    0,    0,    0,    0,    0,    0,     // u64 sequence id
      4,    0,    0,    0,    0,    0,    0,    0,     // i64 tokens
      1,    0,    0,    0,    0,    0,    0,    0,     // i64 pages
      1,                                             // flag expected
      8,    0,    0,    0,    0,    0,    0,    0,     // i64 expected remaining tokens
  };
  const std::vector<std::byte> body = encode_repack_report(m);
  REQUIRE(body.size() == expected.size());
  CHECK(std::memcmp(body.data(), expected.data(), expected.size()) == 0);
}

TEST_CASE("repack wire: out-of-range values are kInvalidArgument naming the field") {
  RepackReport report = full_report();
  report.report = 0;
  check_refused(decode_repack_report(encode_repack_report(report)), StatusCode::kInvalidArgument,
                "worker 3: report number 0");
  report = full_report();
  report.migrator_address.clear();
  check_refused(decode_repack_report(encode_repack_report(report)), StatusCode::kInvalidArgument,
                "empty migrator address");

  // Lengths and counts past their bounds, written by hand (the encoders refuse to).
  std::vector<std::byte> body = encode_repack_report(full_report());
  const std::uint32_t long_address = kMaxRepackAddressBytes + 1;
  std::memcpy(body.data() + 13, &long_address, 4);
  check_refused(decode_repack_report(body), StatusCode::kInvalidArgument, "address length is 257, above 256");
  body = encode_repack_report(full_report());
  const std::size_t count_at = body.size() - 2 * 25 - 8 - 4;  // before two sequences, one with expected
  const std::uint32_t many = kMaxRepackSequences + 1;
  std::memcpy(body.data() + count_at, &many, 4);
  check_refused(decode_repack_report(body), StatusCode::kInvalidArgument, "sequence count is 1025, above 1024");

  body = encode_repack_report(full_report());
  body[12] = std::byte{2};  // the migrating flag
  check_refused(decode_repack_report(body), StatusCode::kDataLoss, "migrating is 2, not 0 or 1 at offset 12");

  RepackOrders orders = full_orders();
  orders.plan = 0;
  check_refused(decode_repack_orders(encode_repack_orders(orders)), StatusCode::kInvalidArgument, "plan number 0");
  orders = full_orders();
  orders.report = 0;
  check_refused(decode_repack_orders(encode_repack_orders(orders)), StatusCode::kInvalidArgument,
                "report number 0");
  orders = full_orders();
  orders.destinations[1].worker = orders.destinations[0].worker;
  check_refused(decode_repack_orders(encode_repack_orders(orders)), StatusCode::kInvalidArgument,
                "destination 1 named twice");
  orders = full_orders();
  orders.destinations[1].sequences = {SequenceId(12)};
  check_refused(decode_repack_orders(encode_repack_orders(orders)), StatusCode::kInvalidArgument,
                "destination 2: sequence 12 named twice");
  orders = full_orders();
  orders.destinations[1].sequences.clear();
  check_refused(decode_repack_orders(encode_repack_orders(orders)), StatusCode::kInvalidArgument,
                "destination 2 without sequences");
  orders = full_orders();
  orders.destinations[0].migrator_address.clear();
  check_refused(decode_repack_orders(encode_repack_orders(orders)), StatusCode::kInvalidArgument,
                "destination 1: empty migrator address");

  // One sequence more than a whole orders message holds, spread over two destinations.
  orders = {1, 1, Version(1), {{WorkerId(1), "a:1", {}}, {WorkerId(2), "b:1", {}}}};
  for (std::uint32_t i = 0; i < kMaxRepackSequences; ++i) orders.destinations[0].sequences.push_back(SequenceId(i));
  orders.destinations[1].sequences.push_back(SequenceId(kMaxRepackSequences));
  check_refused(decode_repack_orders(encode_repack_orders(orders)), StatusCode::kInvalidArgument,
                "destination 2: sequence count is 1, above 0");
}
