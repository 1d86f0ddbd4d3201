// round_trip.h: the property the message fuzz targets check on each of their decoders.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>

#include "laminar/status.h"

namespace laminar::fuzz {

// Decoding `bytes` either fails with kDataLoss naming an offset (or kInvalidArgument, where the
// decoder's header says it refuses well-formed values out of range so), or gives a message that
// re-encodes to exactly `bytes` and decodes again to the same message. Aborts otherwise.
template <class M, class Encode>
void check_round_trip(std::span<const std::byte> bytes, Result<M> (*decode)(std::span<const std::byte>),
                      Encode encode, bool invalid_argument_allowed = false) {
  Result<M> m = decode(bytes);
  if (!m.ok()) {
    const Status& st = m.status();
    if (invalid_argument_allowed && st.code() == StatusCode::kInvalidArgument) return;
    LAMINAR_CHECK_MSG(st.code() == StatusCode::kDataLoss, st.to_string());
    LAMINAR_CHECK_MSG(st.message().find(" at offset ") != std::string::npos, st.message());
    return;
  }
  const auto again = encode(*m);
  LAMINAR_CHECK(std::ranges::equal(again, bytes));
  Result<M> twice = decode(again);
  LAMINAR_CHECK(twice.ok() && *twice == *m);
}

}  // namespace laminar::fuzz
