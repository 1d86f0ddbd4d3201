#include "laminar/status.h"

#include <catch2/catch.hpp>
#include <memory>
#include <set>
#include <string>

namespace {

laminar::Status fails_when(bool bad) {
  if (bad) return laminar::invalid_argument("x is 3");
  return laminar::ok_status();
}

laminar::Status chain(bool bad) {
  LAMINAR_RETURN_IF_ERROR(fails_when(bad));
  return laminar::unavailable("reached the end");
}

laminar::Result<std::unique_ptr<int>> make(int v) {
  if (v < 0) return laminar::out_of_range("v is negative: " + std::to_string(v));
  return std::make_unique<int>(v);
}

}  // namespace

TEST_CASE("Status carries code and message", "[status]") {
  laminar::Status ok;
  CHECK(ok.ok());
  CHECK(ok.to_string() == "OK");
  laminar::Status st = laminar::data_loss("chunk 3 checksum 0x12 != 0x34");
  CHECK_FALSE(st.ok());
  CHECK(st.code() == laminar::StatusCode::kDataLoss);
  CHECK(st.to_string() == "DATA_LOSS: chunk 3 checksum 0x12 != 0x34");
  CHECK(st.with_context("pull v7").to_string() == "DATA_LOSS: pull v7: chunk 3 checksum 0x12 != 0x34");
  CHECK(ok.with_context("ignored").ok());
}

TEST_CASE("every code has a distinct name", "[status]") {
  using C = laminar::StatusCode;
  const C all[] = {C::kOk, C::kInvalidArgument, C::kNotFound, C::kAlreadyExists, C::kFailedPrecondition,
                   C::kOutOfRange, C::kResourceExhausted, C::kUnavailable, C::kAborted,
                   C::kDeadlineExceeded, C::kCancelled, C::kDataLoss, C::kUnimplemented, C::kInternal};
  std::set<std::string_view> names;
  for (C c : all) names.insert(laminar::status_code_name(c));
  CHECK(names.size() == std::size(all));
  CHECK(names.count("UNKNOWN") == 0);
}

TEST_CASE("LAMINAR_RETURN_IF_ERROR returns the first error", "[status]") {
  CHECK(chain(true).code() == laminar::StatusCode::kInvalidArgument);
  CHECK(chain(false).code() == laminar::StatusCode::kUnavailable);
}

TEST_CASE("Result holds a move-only value or a status", "[status]") {
  auto good = make(4);
  REQUIRE(good.ok());
  CHECK(**good == 4);
  CHECK(good.status().ok());
  std::unique_ptr<int> taken = std::move(good).value();
  CHECK(*taken == 4);

  auto bad = make(-1);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == laminar::StatusCode::kOutOfRange);
  CHECK(bad.status().message() == "v is negative: -1");

  laminar::Result<int> r = laminar::not_found("no tensor 'w'");
  CHECK(r.value_or(9) == 9);
}
