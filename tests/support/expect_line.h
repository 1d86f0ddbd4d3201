// expect_line.h: a Catch2 check on a child's output, for the multi-process tests (needs catch.hpp,
// so it is for test files only, not for laminar_test_support's benchmark users).
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "process.h"

namespace laminar::testing {

// Reads `child`'s lines until one starts with `prefix` and returns the rest of it; every line read
// (the matching one too) is kept in `seen` when given. Fails the test on a read error, including no
// such line within `timeout`.
inline std::string expect_line(ChildProcess& child, const std::string& prefix, std::chrono::milliseconds timeout,
                               std::vector<std::string>* seen = nullptr) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    auto line = child.read_line(std::max(left, std::chrono::milliseconds(1)));
    INFO("pid " << child.pid() << " waiting for '" << prefix << "': " << line.status().to_string());
    REQUIRE(line.ok());
    if (seen) seen->push_back(*line);
    if (line->rfind(prefix, 0) == 0) return line->substr(prefix.size());
  }
}

}  // namespace laminar::testing
