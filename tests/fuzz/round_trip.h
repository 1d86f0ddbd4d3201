// round_trip.h: the property the message fuzz targets check on each of their decoders.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>

#include "laminar/status.h"

namespace laminar::fuzz {

// Decoding `bytes` either fails with kDataLoss naming an offset, or gives a message that re-encodes
// to exactly `bytes` and decodes again to the same message. Aborts otherwise.
template <class M, class Encode>
void check_round_trip(std::span<const std::byte> bytes, Result<M> (*decode)(std::span<const std::byte>),
                      Encode encode) {
  Result<M> m = decode(bytes);
  if (!m.ok()) {
    LAMINAR_CHECK_MSG(m.status().code() == StatusCode::kDataLoss, m.status().to_string());
    LAMINAR_CHECK_MSG(m.status().message().find(" at offset ") != std::string::npos, m.status().message());
    return;
  }
  const auto again = encode(*m);
  LAMINAR_CHECK(std::ranges::equal(again, bytes));
  Result<M> twice = decode(again);
  LAMINAR_CHECK(twice.ok() && *twice == *m);
}

}  // namespace laminar::fuzz
