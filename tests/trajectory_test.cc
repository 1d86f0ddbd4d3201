#include "laminar/trajectory.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "expect_code.h"

using laminar::StatusCode;
using laminar::Trajectory;
using laminar::testing::expect_code;

namespace {

// Every field set to a value whose bytes tell it from its neighbours.
Trajectory pinned_trajectory() {
  Trajectory t;
  t.id = laminar::TrajectoryId(0x0102030405060708ull);
  t.prompt_id = laminar::PromptId(0x1112131415161718ull);
  t.group_id = laminar::GroupId(0x2122232425262728ull);
  t.group_size = 4;
  t.sample_index = 2;
  t.version = laminar::Version(9);
  t.prompt_tokens = {1, 2, 3};
  t.response_tokens = {10, 11};
  t.logprobs = {-0.5f, -1.25f};
  t.rewards = {1.0f, -0.5f};
  t.finish_reason = laminar::FinishReason::kLength;
  t.timings = {100, 250};
  t.metadata = R"({"k":1})";
  return t;
}

std::string to_hex(const std::string& bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  for (unsigned char c : bytes) {
    hex += kDigits[c >> 4];
    hex += kDigits[c & 15];
  }
  return hex;
}

}  // namespace

// Write-ahead logs on disk and remote producers of older builds carry these bytes: a change here is
// a format change and needs a new format number.
TEST_CASE("trajectory encoding: the bytes of format 1 are pinned", "[encoding]") {
  const Trajectory t = pinned_trajectory();
  std::string bytes;
  encode_trajectory(t, bytes);
  const std::string want =
      "0100000004000000"                                  // format, group_size
      "0807060504030201" "1817161514131211"               // id, prompt_id
      "2827262524232221" "0900000000000000"               // group_id, version
      "02000000" "01" "000000"                            // sample_index, finish_reason, padding
      "6400000000000000" "fa00000000000000"               // generation start, end (ns)
      "03000000" "02000000" "02000000" "07000000"         // prompt, response, reward, metadata counts
      "010000000200000003000000"                          // prompt_tokens
      "0a0000000b000000"                                  // response_tokens
      "000000bf0000a0bf"                                  // logprobs
      "0000803f000000bf"                                  // rewards
      "7b226b223a317d";                                   // metadata
  CHECK(to_hex(bytes) == want);
  CHECK(bytes.size() == laminar::encoded_trajectory_size(t));
  auto back = laminar::decode_trajectory(bytes);
  REQUIRE(back.ok());
  CHECK(*back == t);
}

TEST_CASE("trajectory decoding refuses truncated, padded or corrupt bytes, naming the field and its offset",
          "[encoding][bad-input]") {
  const Trajectory t = pinned_trajectory();
  std::string bytes;
  encode_trajectory(t, bytes);
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    INFO("first " << n << " bytes");
    expect_code(laminar::decode_trajectory(std::string_view(bytes).substr(0, n)).status(), StatusCode::kDataLoss,
                "cut short at offset");
  }
  expect_code(laminar::decode_trajectory(std::string_view(bytes).substr(0, 66)).status(), StatusCode::kDataLoss,
              "encoded trajectory: num_prompt cut short at offset 64 (2 of 4 bytes)");
  expect_code(laminar::decode_trajectory(bytes + "x").status(), StatusCode::kDataLoss,
              "encoded trajectory: 1 trailing bytes at offset 123");

  std::string bad_format = bytes;
  bad_format[0] = 9;
  expect_code(laminar::decode_trajectory(bad_format).status(), StatusCode::kDataLoss,
              "format 9 (expected 1) at offset 0");
  std::string bad_padding = bytes;
  bad_padding[46] = 1;
  expect_code(laminar::decode_trajectory(bad_padding).status(), StatusCode::kDataLoss,
              "nonzero padding at offset 45");
  // A corrupt count no longer adds up.
  std::string bad_len = bytes;
  bad_len[64] ^= 0x40;  // num_prompt: 67
  expect_code(laminar::decode_trajectory(bad_len).status(), StatusCode::kDataLoss,
              "prompt_tokens cut short at offset 80 (43 of 67 x 4 bytes)");
  std::string huge = bytes;
  std::memset(huge.data() + 68, 0xff, 4);  // num_response
  expect_code(laminar::decode_trajectory(huge).status(), StatusCode::kDataLoss,
              "response_tokens cut short at offset 92 (31 of 4294967295 x 4 bytes)");
  // A corrupt log-prob decodes into a trajectory that fails validation.
  std::string bad_lp = bytes;
  const std::size_t lp0 = 80 + 4 * (t.prompt_tokens.size() + t.response_tokens.size());
  const float nan = NAN;
  std::memcpy(bad_lp.data() + lp0, &nan, 4);
  expect_code(laminar::decode_trajectory(bad_lp).status(), StatusCode::kInvalidArgument, "logprobs[0]");
  // Without the contents check it decodes as it was written; the fields are checked still.
  auto unchecked = laminar::decode_trajectory(bad_lp, /*contents=*/false);
  REQUIRE(unchecked.ok());
  CHECK(std::isnan(unchecked->logprobs[0]));
  std::string bad_index = bytes;
  bad_index[40] = 7;  // sample_index 7 in a group of 3
  expect_code(laminar::decode_trajectory(bad_index, false).status(), StatusCode::kInvalidArgument, "sample_index");
}
