// wire_checks.h: the checks every test of a protocol's message bodies makes (Catch2): a message
// survives its encoder and decoder unchanged, and its decoder refuses every truncation and a
// trailing byte.
//
//   check_round_trip(offer, encode_migration_offer, decode_migration_offer);
//   check_truncations(encode_migration_offer(offer), decode_migration_offer);
#pragma once

#include <catch2/catch.hpp>

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "laminar/status.h"

namespace laminar::testing {

template <class M>
void check_round_trip(const M& m, std::vector<std::byte> (*encode)(const M&),
                      Result<M> (*decode)(std::span<const std::byte>)) {
  const std::vector<std::byte> body = encode(m);
  Result<M> back = decode(body);
  REQUIRE(back.ok());
  CHECK(*back == m);
}

// Every proper prefix is kDataLoss naming an offset; one byte more is refused as trailing.
template <class M>
void check_truncations(const std::vector<std::byte>& body, Result<M> (*decode)(std::span<const std::byte>)) {
  for (std::size_t n = 0; n < body.size(); ++n) {
    Result<M> m = decode(std::span(body).first(n));
    INFO("prefix of " << n << " of " << body.size() << " bytes");
    REQUIRE_FALSE(m.ok());
    CHECK(m.status().code() == StatusCode::kDataLoss);
    CHECK_THAT(m.status().message(), Catch::Contains(" at offset "));
  }
  std::vector<std::byte> longer = body;
  longer.push_back(std::byte{0});
  Result<M> m = decode(longer);
  REQUIRE_FALSE(m.ok());
  CHECK(m.status().code() == StatusCode::kDataLoss);
  CHECK_THAT(m.status().message(), Catch::Contains("1 trailing bytes at offset " + std::to_string(body.size())));
}

}  // namespace laminar::testing
