// byte_codec.h (private to src/): ByteWriter and ByteReader, the one little-endian codec under
// every binary format laminar reads from a peer or a file: the transport's frames, bootstrap frames
// and remote-region descriptors, the relay chain's and the local relay's messages, the remote
// queue's messages, the trajectory encoding, the write-ahead log, and the KV migration and repack
// protocols. Each decoder has a libFuzzer target in tests/fuzz/.
//
// A ByteReader never reads past the end of its bytes. Each read either returns the value or
// returns zero (an empty view) and records an error; the first error sticks and every later read
// is a no-op, so a decoder reads a whole message and checks once. Errors are kDataLoss naming the
// message, the field and its offset; a length is checked against the bytes left (and a caller's
// limit) before anything is allocated for it.
//
//   std::string out;
//   ByteWriter w(out);
//   w.u32(7);
//   w.prefixed("hello");
//   ByteReader r(out, "greeting");
//   std::uint32_t n = r.u32("count");                // 7
//   std::string_view s = r.prefixed("text", 1024);   // "hello"
//   Status st = r.finish();                           // OK: nothing left over
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "laminar/status.h"

namespace laminar::internal {

static_assert(std::endian::native == std::endian::little,
              "laminar's binary formats are little-endian and copied as is");

// Appends to a std::string or a std::vector<std::byte> it does not own.
template <class Out>
class ByteWriter {
  static_assert(std::is_same_v<Out, std::string> || std::is_same_v<Out, std::vector<std::byte>>);

 public:
  explicit ByteWriter(Out& out) : out_(&out) {}

  void reserve(std::size_t more) { out_->reserve(out_->size() + more); }
  void u8(std::uint8_t v) { put(v); }
  void u16(std::uint16_t v) { put(v); }
  void u32(std::uint32_t v) { put(v); }
  void u64(std::uint64_t v) { put(v); }
  void i32(std::int32_t v) { put(v); }
  void i64(std::int64_t v) { put(v); }
  void f32(float v) { put(v); }
  void bytes(std::string_view b) { append(b.data(), b.size()); }
  void bytes(std::span<const std::byte> b) { append(b.data(), b.size()); }
  // The elements as they lie in memory (little-endian, no padding for the types used here).
  template <class T>
  void array(std::span<const T> v) {
    static_assert(std::is_trivially_copyable_v<T>);
    append(v.data(), v.size_bytes());
  }
  // A u32 length, then the bytes.
  // Precondition: b.size() fits in a u32 (callers bound their blobs far below).
  void prefixed(std::string_view b) {
    LAMINAR_CHECK(b.size() <= std::numeric_limits<std::uint32_t>::max());
    u32(std::uint32_t(b.size()));
    bytes(b);
  }

 private:
  template <class T>
  void put(T v) {
    append(&v, sizeof(v));
  }
  void append(const void* p, std::size_t n) {
    const auto* b = static_cast<const typename Out::value_type*>(p);
    if constexpr (std::is_same_v<Out, std::string>) {
      out_->append(b, n);
    } else {
      // Grown first, so that insert never reallocates: GCC 12 misreads its reallocation path into a
      // fresh vector as an overflow (-Wstringop-overflow at -O2 and above).
      if (out_->capacity() - out_->size() < n) out_->reserve(std::max(out_->size() + n, 2 * out_->capacity()));
      out_->insert(out_->end(), b, b + n);
    }
  }

  Out* out_;
};

template <class Out>
ByteWriter(Out&) -> ByteWriter<Out>;

class ByteReader {
 public:
  // `what` names the message in every error and must outlive the reader; `base` is the offset of
  // the first byte in whatever holds them (a record inside a file), so errors name offsets there.
  ByteReader(std::span<const std::byte> bytes, std::string_view what, std::size_t base = 0)
      : p_(bytes.data()), size_(bytes.size()), base_(base), what_(what) {}
  ByteReader(std::string_view bytes, std::string_view what, std::size_t base = 0)
      : ByteReader(std::as_bytes(std::span(bytes.data(), bytes.size())), what, base) {}

  std::uint8_t u8(std::string_view field) { return get<std::uint8_t>(field); }
  std::uint16_t u16(std::string_view field) { return get<std::uint16_t>(field); }
  std::uint32_t u32(std::string_view field) { return get<std::uint32_t>(field); }
  std::uint64_t u64(std::string_view field) { return get<std::uint64_t>(field); }
  std::int32_t i32(std::string_view field) { return get<std::int32_t>(field); }
  std::int64_t i64(std::string_view field) { return get<std::int64_t>(field); }
  float f32(std::string_view field) { return get<float>(field); }
  // The next n bytes, viewed in place.
  std::string_view bytes(std::string_view field, std::size_t n) {
    const std::byte* p = take(field, n, 1);
    return p == nullptr ? std::string_view() : std::string_view(reinterpret_cast<const char*>(p), n);
  }
  // A u32 length, then that many bytes; a length above `limit` is refused.
  std::string_view prefixed(std::string_view field, std::size_t limit);
  // n elements of T; `out` is resized only once they are known to be there.
  template <class T>
  void array(std::string_view field, std::size_t n, std::vector<T>& out) {
    static_assert(std::is_trivially_copyable_v<T>);
    const std::byte* p = take(field, n, sizeof(T));
    // take() already refused any n whose bytes are not there; the second test lets the compiler
    // see that the copy below is bounded (GCC's -Wstringop-overflow, with a constant huge n).
    if (p == nullptr || n > std::size_t(std::numeric_limits<std::ptrdiff_t>::max()) / sizeof(T)) return;
    out.resize(n);
    if (n != 0) std::memcpy(out.data(), p, n * sizeof(T));
  }
  // The next n bytes as a reader of their own, naming the same offsets; on failure one that holds
  // this reader's error.
  ByteReader sub(std::string_view field, std::size_t n);

  // Records a finding of the decoder's own about what starts at `offset` (a bad magic, an unknown
  // type) unless an error is recorded already: "<what>: <problem> at offset <offset>".
  void fail(std::size_t offset, std::string_view problem);

  bool ok() const noexcept { return status_.ok(); }
  const Status& status() const noexcept { return status_; }
  // Offset of the next byte to read, counted from `base`'s origin.
  std::size_t offset() const noexcept { return base_ + pos_; }
  std::size_t left() const noexcept { return size_ - pos_; }
  bool at_end() const noexcept { return pos_ == size_; }
  // The first error, or kDataLoss when bytes are left unread.
  Status finish();

 private:
  // The next count * size bytes, or nullptr (recording the error) when fewer are left.
  const std::byte* take(std::string_view field, std::size_t count, std::size_t size);
  template <class T>
  T get(std::string_view field) {
    T v{};
    if (const std::byte* p = take(field, 1, sizeof(T))) std::memcpy(&v, p, sizeof(T));
    return v;
  }

  const std::byte* p_;
  std::size_t size_;
  std::size_t pos_ = 0;
  std::size_t base_;
  std::string_view what_;
  Status status_;
};

// A count or a length as a u32. Precondition: it fits.
template <class Out>
void write_count(ByteWriter<Out>& w, std::size_t n) {
  LAMINAR_CHECK(n <= std::numeric_limits<std::uint32_t>::max());
  w.u32(std::uint32_t(n));
}

// A u32 count or length, checked at once rather than at finish(), since it decides what follows:
// a truncated body is kDataLoss (the reader's error), a value above `limit` kInvalidArgument
// "<what>: <field> is <n>, above <limit>".
Status read_count(ByteReader& r, std::string_view field, std::uint64_t limit, std::string_view what,
                  std::uint32_t& n);

}  // namespace laminar::internal
