// make_transport.h: a Transport for a test that runs its peers in its own process (needs
// catch.hpp, so it is for test files only).
//
//   std::shared_ptr<laminar::Transport> server = laminar::testing::make_transport(kToken);
#pragma once

#include <catch2/catch.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <utility>

#include "laminar/transport.h"

namespace laminar::testing {

// A Transport with cluster token `token` whose operations give up after 10 s rather than the
// default 30, so that a peer that never answers fails its test quickly. Fails the test if the
// transport cannot be made.
inline std::shared_ptr<Transport> make_transport(const std::string& token) {
  TransportOptions o;
  o.cluster_token = token;
  o.operation_timeout = std::chrono::seconds(10);
  auto t = Transport::create(o);
  INFO(t.status().to_string());
  REQUIRE(t.ok());
  return std::move(t).value();
}

}  // namespace laminar::testing
