#include "byte_codec.h"

#include <fmt/format.h>

namespace laminar::internal {

const std::byte* ByteReader::take(std::string_view field, std::size_t count, std::size_t size) {
  if (!ok()) return nullptr;
  // Divided, not multiplied: a count read from the bytes may be anything.
  if (count > left() / size) {
    const std::string wanted = count == 1 || size == 1 ? fmt::format("{}", count * size)
                                                       : fmt::format("{} x {}", count, size);
    status_ = data_loss(fmt::format("{}: {} cut short at offset {} ({} of {} bytes)", what_, field,
                                    offset(), left(), wanted));
    return nullptr;
  }
  const std::byte* p = p_ + pos_;
  pos_ += count * size;
  return p;
}

std::string_view ByteReader::prefixed(std::string_view field, std::size_t limit) {
  const std::size_t at = offset();
  const std::uint32_t n = u32(field);
  if (ok() && n > limit) {
    fail(at, fmt::format("{} length {} exceeds the limit of {} bytes", field, n, limit));
  }
  return bytes(field, n);
}

ByteReader ByteReader::sub(std::string_view field, std::size_t n) {
  const std::size_t at = offset();
  if (const std::byte* p = take(field, n, 1)) return ByteReader(std::span(p, n), what_, at);
  ByteReader failed(std::span<const std::byte>(), what_, at);
  failed.status_ = status_;
  return failed;
}

Status read_count(ByteReader& r, std::string_view field, std::uint64_t limit, std::string_view what,
                  std::uint32_t& n) {
  n = r.u32(field);
  LAMINAR_RETURN_IF_ERROR(r.status());
  if (n > limit) return invalid_argument(fmt::format("{}: {} is {}, above {}", what, field, n, limit));
  return ok_status();
}

void ByteReader::fail(std::size_t offset, std::string_view problem) {
  if (ok()) status_ = data_loss(fmt::format("{}: {} at offset {}", what_, problem, offset));
}

Status ByteReader::finish() {
  if (ok() && !at_end()) {
    status_ = data_loss(fmt::format("{}: {} trailing bytes at offset {}", what_, left(), offset()));
  }
  return status_;
}

}  // namespace laminar::internal
