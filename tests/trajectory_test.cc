#include "laminar/trajectory.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <string>

using laminar::Trajectory;

namespace {

// Every field set to a value whose bytes tell it from its neighbours.
Trajectory pinned_trajectory() {
  Trajectory t;
  t.id = laminar::TrajectoryId(0x0102030405060708ull);
  t.prompt_id = 0x1112131415161718ull;
  t.group_id = 0x2122232425262728ull;
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
