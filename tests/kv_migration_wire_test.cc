#include "kv_migration_wire.h"

#include <catch2/catch.hpp>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "wire_checks.h"

using namespace laminar;
using namespace laminar::internal;
using laminar::testing::check_round_trip;
using laminar::testing::check_truncations;

namespace {

SequenceState full_state(std::uint64_t id) {
  SequenceState s;
  s.sequence = SequenceId(id);
  s.trajectory = TrajectoryId(100 + id);
  s.prompt_id = laminar::PromptId(9);
  s.group_id = laminar::GroupId(4);
  s.group_size = 8;
  s.sample_index = 7;
  s.version = Version(12);
  s.temperature = 0.7f;
  s.top_p = 0.95f;
  s.top_k = 50;
  s.seed = 0xdeadbeefcafef00dULL;
  s.rng_position = 33;
  s.kv_length = 5;
  s.prompt_tokens = {1, 2, 3};
  s.response_tokens = {4, 5, 6};
  s.logprobs = {-0.5f, 0.0f, -std::numeric_limits<float>::infinity()};
  s.engine_state = std::string("eng\0ine", 7);
  return s;
}

MigrationOffer full_offer() {
  return {7, Version(12), {32, 16, 8, 128, DType::kBF16}, {{SequenceId(1), 33, 3}, {SequenceId(2), 0, 0}}};
}

MigrationReservation full_reservation() {
  MigrationReservation m;
  m.lease_ns = 5'000'000'000;
  m.sequences = {{SequenceId(1), {10, 11, 12}}, {SequenceId(2), {}}};
  m.k_pool = {std::byte{1}, std::byte{2}};
  m.v_pool = {std::byte{3}};
  return m;
}

// The same messages as device pools send them: a link and its token, a batch and runs.
MigrationOffer device_offer() {
  MigrationOffer m = full_offer();
  m.pools = KvPools::kDevice;
  return m;
}

MigrationReservation device_reservation() {
  MigrationReservation m = full_reservation();
  m.k_pool.clear();
  m.v_pool.clear();
  m.link = 0x5eed;
  m.link_token.assign(kMigrationLinkTokenBytes, std::byte{0x42});
  return m;
}

MigrationStage full_stage(bool final);

MigrationStage device_stage(bool final) {
  MigrationStage m = full_stage(final);
  m.batch = 9;
  m.sequences[0].runs = {1, 1};
  return m;
}

MigrationStage full_stage(bool final) {
  MigrationStage m{7, 3, final, {{SequenceId(1), 2, {0x1111, 0x2222}, {}, {}}, {SequenceId(2), 0, {}, {}, {}}}};
  if (final) {
    m.sequences[0].state = full_state(1);
    m.sequences[1].state = full_state(2);
  }
  return m;
}

// Each decoder, as one function of the bytes: OK, or the refusal.
template <class M>
Status decodes(Result<M> (*decode)(std::span<const std::byte>), const std::vector<std::byte>& body) {
  Result<M> m = decode(body);
  return m.ok() ? ok_status() : m.status();
}

void check_refused(const Status& st, StatusCode code, const std::string& text) {
  INFO(st.to_string());
  CHECK(st.code() == code);
  CHECK_THAT(st.message(), Catch::Contains(text));
}

}  // namespace

TEST_CASE("kv migration wire: every message round-trips, empty and full") {
  check_round_trip(MigrationOffer{1, Version(0), {1, 1, 1, 1, DType::kF32}, {}}, encode_migration_offer,
                   decode_migration_offer);
  check_round_trip(full_offer(), encode_migration_offer, decode_migration_offer);
  check_round_trip(MigrationReservation{}, encode_migration_reservation, decode_migration_reservation);
  check_round_trip(full_reservation(), encode_migration_reservation, decode_migration_reservation);
  check_round_trip(MigrationReservation{MigrationRefusal{StatusCode::kResourceExhausted, "no pages"}, 0, {}, {}, {}, 0, {}},
                   encode_migration_reservation, decode_migration_reservation);
  check_round_trip(MigrationStage{1, 0, false, {}}, encode_migration_stage, decode_migration_stage);
  check_round_trip(MigrationStage{1, 0, true, {}}, encode_migration_stage, decode_migration_stage);
  check_round_trip(full_stage(false), encode_migration_stage, decode_migration_stage);
  check_round_trip(full_stage(true), encode_migration_stage, decode_migration_stage);
  MigrationStage empty_state{1, 9, true, {{SequenceId(5), 0, {}, SequenceState{}, {}}}};
  empty_state.sequences[0].state->sequence = SequenceId(5);
  check_round_trip(empty_state, encode_migration_stage, decode_migration_stage);
  check_round_trip(MigrationStageAnswer{std::nullopt, 3}, encode_migration_stage_answer,
                   decode_migration_stage_answer);
  check_round_trip(MigrationStageAnswer{MigrationRefusal{StatusCode::kDataLoss, "page 3 checksum"}, 0},
                   encode_migration_stage_answer, decode_migration_stage_answer);
  check_round_trip(MigrationAbort{7, MigrationSide::kDestination, StatusCode::kDeadlineExceeded, "lease ran out"},
                   encode_migration_abort, decode_migration_abort);
  check_round_trip(MigrationAbort{1, MigrationSide::kSource, StatusCode::kCancelled, ""}, encode_migration_abort,
                   decode_migration_abort);
}

TEST_CASE("kv migration wire: device pools' offer, reservation and stages round-trip") {
  check_round_trip(device_offer(), encode_migration_offer, decode_migration_offer);
  check_round_trip(device_reservation(), encode_migration_reservation, decode_migration_reservation);
  check_round_trip(device_stage(false), encode_migration_stage, decode_migration_stage);
  check_round_trip(device_stage(true), encode_migration_stage, decode_migration_stage);
  MigrationStage one_run = device_stage(false);
  one_run.sequences[0].runs = {2};
  check_round_trip(one_run, encode_migration_stage, decode_migration_stage);
  // Runs are on the wire only with a batch: the host path's stage is unchanged by them.
  CHECK(encode_migration_stage(device_stage(false)).size() ==
        encode_migration_stage(full_stage(false)).size() + 2 * 4 + 4 + 4);
  check_truncations(encode_migration_offer(device_offer()), decode_migration_offer);
  check_truncations(encode_migration_reservation(device_reservation()), decode_migration_reservation);
  check_truncations(encode_migration_stage(device_stage(false)), decode_migration_stage);
  check_truncations(encode_migration_stage(device_stage(true)), decode_migration_stage);
}

TEST_CASE("kv migration wire: device pools' fields out of range are refused") {
  std::vector<std::byte> offer = encode_migration_offer(device_offer());
  offer[33] = std::byte{2};  // pools: past kDevice
  check_refused(decodes(decode_migration_offer, offer), StatusCode::kDataLoss, "pools 2 at offset 33");

  const auto reservation = [](const std::function<void(MigrationReservation&)>& change) {
    MigrationReservation m = device_reservation();
    change(m);
    return decodes(decode_migration_reservation, encode_migration_reservation(m));
  };
  check_refused(reservation([](MigrationReservation& m) { m.link = 0; }), StatusCode::kInvalidArgument,
                "migration reservation: link 0x0 with a token of 128 bytes");
  check_refused(reservation([](MigrationReservation& m) { m.link_token.clear(); }), StatusCode::kInvalidArgument,
                "link 0x5eed with a token of 0 bytes");
  check_refused(reservation([](MigrationReservation& m) { m.link_token.pop_back(); }), StatusCode::kInvalidArgument,
                "link 0x5eed with a token of 127 bytes");
  check_refused(reservation([](MigrationReservation& m) { m.link_token.push_back(std::byte{1}); }),
                StatusCode::kInvalidArgument, "link token is 129, above 128");

  const auto stage = [](const std::function<void(MigrationStage&)>& change) {
    MigrationStage m = device_stage(true);
    change(m);
    return decodes(decode_migration_stage, encode_migration_stage(m));
  };
  check_refused(stage([](MigrationStage& m) { m.sequences[0].runs = {1}; }), StatusCode::kInvalidArgument,
                "migration stage: sequence 1: runs of 1 pages for 2 pages");
  check_refused(stage([](MigrationStage& m) { m.sequences[0].runs = {2, 0}; }), StatusCode::kInvalidArgument,
                "sequence 1: a run of 0 pages");
  check_refused(stage([](MigrationStage& m) { m.sequences[0].runs = {1, 1, 1}; }), StatusCode::kInvalidArgument,
                "sequence 1: run count is 3, above 2");
  check_refused(stage([](MigrationStage& m) { m.sequences[1].runs = {1}; }), StatusCode::kInvalidArgument,
                "sequence 2: run count is 1, above 0");
}

TEST_CASE("kv migration wire: the largest messages round-trip") {
  MigrationOffer offer{~std::uint64_t(0), Version(~std::uint64_t(0)), {1, 1, 1, 1, DType::kF16}, {}};
  for (std::uint32_t i = 0; i < kMaxMigrationSequences; ++i) {
    offer.sequences.push_back({SequenceId(i), kMaxMigrationTokens, kMaxMigrationPages});
  }
  check_round_trip(offer, encode_migration_offer, decode_migration_offer);

  MigrationReservation res;
  res.sequences.push_back({SequenceId(1), std::vector<std::int32_t>(kMaxMigrationPages, 3)});
  res.k_pool.assign(kMaxMigrationRegionBytes, std::byte{7});
  res.v_pool.assign(kMaxMigrationRegionBytes, std::byte{8});
  check_round_trip(res, encode_migration_reservation, decode_migration_reservation);
  check_round_trip(
      MigrationReservation{
          MigrationRefusal{StatusCode::kInternal, std::string(kMaxMigrationTextBytes, 'x')}, 0, {}, {}, {}, 0, {}},
      encode_migration_reservation, decode_migration_reservation);

  SequenceState s = full_state(1);
  s.prompt_tokens.assign(kMaxMigrationTokens / 2, 1);
  s.response_tokens.assign(kMaxMigrationTokens / 2, 2);
  s.logprobs.assign(kMaxMigrationTokens / 2, -1.0f);
  s.kv_length = kMaxMigrationTokens;
  s.engine_state.assign(kMaxMigrationEngineBytes, 'e');
  MigrationStage stage{1, ~std::uint32_t(0), true, {{SequenceId(1), 0, {}, s, {}}}};
  stage.sequences[0].checksums.assign(kMaxMigrationPages, 0xabc);
  check_round_trip(stage, encode_migration_stage, decode_migration_stage);
  stage.sequences[0].first_page = kMaxMigrationPages - 1;
  stage.sequences[0].checksums = {1};
  check_round_trip(stage, encode_migration_stage, decode_migration_stage);
}

TEST_CASE("kv migration wire: a long refusal text is cut when encoded") {
  const MigrationAbort a{3, MigrationSide::kSource, StatusCode::kAborted, std::string(kMaxMigrationTextBytes + 5, 'y')};
  Result<MigrationAbort> back = decode_migration_abort(encode_migration_abort(a));
  REQUIRE(back.ok());
  CHECK(back->reason == std::string(kMaxMigrationTextBytes, 'y'));
}

TEST_CASE("kv migration wire: every truncation is kDataLoss naming an offset, and trailing bytes are refused") {
  check_truncations(encode_migration_offer(full_offer()), decode_migration_offer);
  check_truncations(encode_migration_reservation(full_reservation()), decode_migration_reservation);
  check_truncations(
      encode_migration_reservation({MigrationRefusal{StatusCode::kUnavailable, "busy"}, 0, {}, {}, {}, 0, {}}),
      decode_migration_reservation);
  check_truncations(encode_migration_stage(full_stage(false)), decode_migration_stage);
  check_truncations(encode_migration_stage(full_stage(true)), decode_migration_stage);
  check_truncations(encode_migration_stage_answer({std::nullopt, 4}), decode_migration_stage_answer);
  check_truncations(encode_migration_stage_answer({MigrationRefusal{StatusCode::kDataLoss, "bad"}, 0}),
                    decode_migration_stage_answer);
  check_truncations(encode_migration_abort({9, MigrationSide::kDestination, StatusCode::kCancelled, "stop"}),
                    decode_migration_abort);
}

TEST_CASE("kv migration wire: the offer's layout, byte for byte") {
  const MigrationOffer m{0x0102030405060708ULL, Version(5), {2, 16, 4, 64, DType::kF16}, {{SequenceId(3), 17, 2}}};
  const std::vector<std::uint8_t> expected = {
      0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,  // u64 migration id
      5,    0,    0,    0,    0,    0,    0,    0,     // u64 version
      2,    0,    0,    0,                             // i32 num_layers
      16,   0,    0,    0,                             // i32 page_size
      4,    0,    0,    0,                             // i32 num_kv_heads
      64,   0,    0,    0,                             // i32 head_dim
      1,                                               // u8 dtype (kF16)
      0,                                               // u8 pools (host)
      1,    0,    0,    0,                             // u32 n
      3,    0,    0,    0,    0,    0,    0,    0,     // u64 sequence id
      17,   0,    0,    0,    0,    0,    0,    0,     // u64 tokens
      2,    0,    0,    0,                             // u32 pages needed
  };
  const std::vector<std::byte> body = encode_migration_offer(m);
  REQUIRE(body.size() == expected.size());
  CHECK(std::memcmp(body.data(), expected.data(), expected.size()) == 0);
}

TEST_CASE("kv migration wire: malformed enums and flags are kDataLoss at their offset") {
  std::vector<std::byte> offer = encode_migration_offer(full_offer());
  offer[32] = std::byte{6};  // dtype: past kU8
  check_refused(decodes(decode_migration_offer, offer), StatusCode::kDataLoss, "dtype 6 at offset 32");

  std::vector<std::byte> res = encode_migration_reservation(full_reservation());
  res[0] = std::byte{2};
  check_refused(decodes(decode_migration_reservation, res), StatusCode::kDataLoss,
                "granted is 2, not 0 or 1 at offset 0");

  std::vector<std::byte> stage = encode_migration_stage(full_stage(false));
  stage[12] = std::byte{5};
  check_refused(decodes(decode_migration_stage, stage), StatusCode::kDataLoss, "final is 5, not 0 or 1 at offset 12");

  std::vector<std::byte> answer = encode_migration_stage_answer({MigrationRefusal{StatusCode::kInternal, "x"}, 0});
  answer[1] = std::byte{14};  // past kInternal
  check_refused(decodes(decode_migration_stage_answer, answer), StatusCode::kDataLoss, "status code 14 at offset 1");

  std::vector<std::byte> abort = encode_migration_abort({1, MigrationSide::kSource, StatusCode::kAborted, "x"});
  abort[8] = std::byte{2};
  check_refused(decodes(decode_migration_abort, abort), StatusCode::kDataLoss, "side 2 at offset 8");
}

TEST_CASE("kv migration wire: well-formed values out of range are kInvalidArgument") {
  const auto offer = [](const std::function<void(MigrationOffer&)>& change) {
    MigrationOffer m = full_offer();
    change(m);
    return decodes(decode_migration_offer, encode_migration_offer(m));
  };
  check_refused(offer([](MigrationOffer& m) { m.migration_id = 0; }), StatusCode::kInvalidArgument,
                "migration offer: migration id 0");
  check_refused(offer([](MigrationOffer& m) { m.layout.page_size = 0; }), StatusCode::kInvalidArgument,
                "layout of 32 layers, page_size 0");
  check_refused(offer([](MigrationOffer& m) { m.layout.num_layers = -1; }), StatusCode::kInvalidArgument,
                "layout of -1 layers");
  check_refused(offer([](MigrationOffer& m) { m.layout.dtype = DType::kI32; }), StatusCode::kInvalidArgument,
                "layout dtype 3 is not a float type");
  check_refused(offer([](MigrationOffer& m) { m.sequences.resize(kMaxMigrationSequences + 1); }),
                StatusCode::kInvalidArgument, "sequence count is 1025, above 1024");
  check_refused(offer([](MigrationOffer& m) { m.sequences[0].pages_needed = 2; }), StatusCode::kInvalidArgument,
                "sequence 1 of 33 tokens needs 2 pages of 16");
  check_refused(offer([](MigrationOffer& m) { m.sequences[1].tokens = kMaxMigrationTokens + 1; }),
                StatusCode::kInvalidArgument, "sequence 2 of 1048577 tokens");
  check_refused(offer([](MigrationOffer& m) { m.sequences[1].tokens = ~std::uint64_t(0); }),
                StatusCode::kInvalidArgument, "sequence 2 of 18446744073709551615 tokens");
  check_refused(offer([](MigrationOffer& m) { m.sequences[1].pages_needed = kMaxMigrationPages + 1; }),
                StatusCode::kInvalidArgument, "needs 1048577 pages");

  const auto reservation = [](const std::function<void(MigrationReservation&)>& change) {
    MigrationReservation m = full_reservation();
    change(m);
    return decodes(decode_migration_reservation, encode_migration_reservation(m));
  };
  check_refused(reservation([](MigrationReservation& m) { m.sequences.resize(kMaxMigrationSequences + 1); }),
                StatusCode::kInvalidArgument, "migration reservation: sequence count is 1025, above 1024");
  check_refused(reservation([](MigrationReservation& m) { m.sequences[1].pages.resize(kMaxMigrationPages + 1); }),
                StatusCode::kInvalidArgument, "page count is 1048577, above 1048576");
  check_refused(reservation([](MigrationReservation& m) { m.k_pool.resize(kMaxMigrationRegionBytes + 1); }),
                StatusCode::kInvalidArgument, "K pool region is 4097, above 4096");
  check_refused(reservation([](MigrationReservation& m) { m.v_pool.resize(kMaxMigrationRegionBytes + 1); }),
                StatusCode::kInvalidArgument, "V pool region is 4097, above 4096");
  check_refused(reservation([](MigrationReservation& m) { m.refusal = MigrationRefusal{StatusCode::kOk, ""}; }),
                StatusCode::kInvalidArgument, "migration reservation: status code OK for a failure");

  const auto stage = [](const std::function<void(MigrationStage&)>& change) {
    MigrationStage m = full_stage(true);
    change(m);
    return decodes(decode_migration_stage, encode_migration_stage(m));
  };
  check_refused(stage([](MigrationStage& m) { m.migration_id = 0; }), StatusCode::kInvalidArgument,
                "migration stage: migration id 0");
  check_refused(stage([](MigrationStage& m) { m.sequences.resize(kMaxMigrationSequences + 1, m.sequences[1]); }),
                StatusCode::kInvalidArgument, "sequence count is 1025, above 1024");
  check_refused(stage([](MigrationStage& m) { m.sequences[0].first_page = kMaxMigrationPages - 1; }),
                StatusCode::kInvalidArgument, "sequence 1: pages 1048575 to 1048577 past 1048576");
  check_refused(stage([](MigrationStage& m) { m.sequences[0].first_page = ~std::uint32_t(0); }),
                StatusCode::kInvalidArgument, "sequence 1: pages 4294967295 to 4294967297 past 1048576");
  check_refused(stage([](MigrationStage& m) { m.sequences[1].state->sequence = SequenceId(9); }),
                StatusCode::kInvalidArgument, "sequence 2: the state of sequence 9");

  const auto state = [&](const std::function<void(SequenceState&)>& change) {
    return stage([&](MigrationStage& m) { change(*m.sequences[1].state); });
  };
  check_refused(state([](SequenceState& s) { s.logprobs.pop_back(); }), StatusCode::kInvalidArgument,
                "sequence 2: 2 logprobs for 3 response tokens");
  check_refused(state([](SequenceState& s) { s.logprobs[1] = 0.25f; }), StatusCode::kInvalidArgument,
                "sequence 2: logprob 1 is 0.25");
  check_refused(state([](SequenceState& s) { s.logprobs[2] = std::numeric_limits<float>::quiet_NaN(); }),
                StatusCode::kInvalidArgument, "sequence 2: logprob 2 is nan");
  check_refused(state([](SequenceState& s) { s.group_size = 0; }), StatusCode::kInvalidArgument,
                "sequence 2: sample index 7 of a group of 0");
  check_refused(state([](SequenceState& s) { s.sample_index = 8; }), StatusCode::kInvalidArgument,
                "sample index 8 of a group of 8");
  check_refused(state([](SequenceState& s) { s.temperature = -1; }), StatusCode::kInvalidArgument,
                "sequence 2: temperature -1");
  check_refused(state([](SequenceState& s) { s.temperature = std::numeric_limits<float>::infinity(); }),
                StatusCode::kInvalidArgument, "temperature inf");
  check_refused(state([](SequenceState& s) { s.top_p = 0; }), StatusCode::kInvalidArgument, "top_p 0,");
  check_refused(state([](SequenceState& s) { s.top_p = 1.5f; }), StatusCode::kInvalidArgument, "top_p 1.5,");
  check_refused(state([](SequenceState& s) { s.top_k = -1; }), StatusCode::kInvalidArgument, "top_k -1");
  check_refused(state([](SequenceState& s) { s.kv_length = 7; }), StatusCode::kInvalidArgument,
                "sequence 2: kv length 7 past its 6 tokens");
  check_refused(state([](SequenceState& s) { s.prompt_tokens.resize(kMaxMigrationTokens + 1); }),
                StatusCode::kInvalidArgument, "sequence 2: prompt token count is 1048577, above 1048576");
  check_refused(state([](SequenceState& s) { s.prompt_tokens.resize(kMaxMigrationTokens - 2); }),
                StatusCode::kInvalidArgument, "sequence 2: response token count is 3, above 2");
  check_refused(state([](SequenceState& s) { s.engine_state.resize(kMaxMigrationEngineBytes + 1); }),
                StatusCode::kInvalidArgument, "sequence 2: engine state is 1048577, above 1048576");

  check_refused(decodes(decode_migration_stage_answer,
                        encode_migration_stage_answer({MigrationRefusal{StatusCode::kOk, "fine"}, 0})),
                StatusCode::kInvalidArgument, "migration stage answer: status code OK for a failure");
  check_refused(decodes(decode_migration_abort, encode_migration_abort({0, MigrationSide::kSource,
                                                                        StatusCode::kAborted, ""})),
                StatusCode::kInvalidArgument, "migration abort: migration id 0");
  check_refused(decodes(decode_migration_abort, encode_migration_abort({1, MigrationSide::kSource,
                                                                        StatusCode::kOk, ""})),
                StatusCode::kInvalidArgument, "migration abort: status code OK for a failure");
}
