// expect_code.h: a Catch2 check that a call failed the way it should (needs catch.hpp, so it is for
// test files only).
//
//   laminar::testing::expect_code(queue->push(t), laminar::StatusCode::kInvalidArgument, "group_size");
#pragma once

#include <catch2/catch.hpp>

#include <string>

#include "laminar/status.h"

namespace laminar::testing {

// Checks that `st` has code `code` and that its message contains `needle`, the name of what was
// wrong; the whole status is shown when either check fails.
inline void expect_code(const Status& st, StatusCode code, const std::string& needle) {
  INFO(st.to_string());
  CHECK(st.code() == code);
  CHECK_THAT(st.message(), Catch::Contains(needle));
}

}  // namespace laminar::testing
