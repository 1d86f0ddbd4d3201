#include "byte_codec.h"

#include <catch2/catch.hpp>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

using laminar::Status;
using laminar::StatusCode;
using laminar::internal::ByteReader;
using laminar::internal::ByteWriter;

namespace {

struct Message {
  std::uint8_t a = 0;
  std::uint16_t b = 0;
  std::uint32_t c = 0;
  std::uint64_t d = 0;
  std::int32_t e = 0;
  std::int64_t f = 0;
  float g = 0;
  std::string name;
  std::vector<std::int32_t> tokens;
  std::string tail;
  friend bool operator==(const Message&, const Message&) = default;
};

Message sample() {
  return {0xab, 0xbeef, 0xdeadbeef, 0x0123456789abcdefull, -5, -(std::int64_t(1) << 40), 1.5f,
          "name", {1, -2, 3}, "xyz"};
}

template <class Out>
void write(const Message& m, Out& out) {
  ByteWriter w(out);
  w.u8(m.a);
  w.u16(m.b);
  w.u32(m.c);
  w.u64(m.d);
  w.i32(m.e);
  w.i64(m.f);
  w.f32(m.g);
  w.prefixed(m.name);
  w.u32(std::uint32_t(m.tokens.size()));
  w.array(std::span<const std::int32_t>(m.tokens));
  w.bytes(m.tail);
}

laminar::Result<Message> read(ByteReader r) {
  Message m;
  m.a = r.u8("a");
  m.b = r.u16("b");
  m.c = r.u32("c");
  m.d = r.u64("d");
  m.e = r.i32("e");
  m.f = r.i64("f");
  m.g = r.f32("g");
  m.name = r.prefixed("name", 64);
  r.array("tokens", r.u32("token count"), m.tokens);
  m.tail = r.bytes("tail", 3);
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return m;
}

void expect_data_loss(const Status& st, const char* needle) {
  INFO(st.to_string());
  CHECK(st.code() == StatusCode::kDataLoss);
  CHECK_THAT(st.message(), Catch::Contains(needle));
}

}  // namespace

TEST_CASE("byte codec: a message round-trips through a string and a byte vector", "[byte_codec]") {
  std::string s;
  write(sample(), s);
  CHECK(s.size() == 1 + 2 + 4 + 8 + 4 + 8 + 4 + (4 + 4) + 4 + 12 + 3);
  auto back = read(ByteReader(s, "sample"));
  REQUIRE(back.ok());
  CHECK(*back == sample());

  std::vector<std::byte> v;
  write(sample(), v);
  REQUIRE(v.size() == s.size());
  CHECK(std::memcmp(v.data(), s.data(), s.size()) == 0);
  auto from_vector = read(ByteReader(std::span<const std::byte>(v), "sample"));
  REQUIRE(from_vector.ok());
  CHECK(*from_vector == sample());
}

TEST_CASE("byte codec: values are little-endian", "[byte_codec]") {
  std::string s;
  ByteWriter w(s);
  w.u32(0x01020304);
  w.u16(0x0506);
  w.f32(1.0f);
  CHECK(s == std::string("\x04\x03\x02\x01\x06\x05\x00\x00\x80\x3f", 10));
}

TEST_CASE("byte codec: every truncation of a message is refused, naming a field and its offset",
          "[byte_codec][bad-input]") {
  std::string s;
  write(sample(), s);
  for (std::size_t n = 0; n < s.size(); ++n) {
    INFO("first " << n << " bytes");
    auto r = read(ByteReader(std::string_view(s).substr(0, n), "sample"));
    REQUIRE_FALSE(r.ok());
    expect_data_loss(r.status(), "cut short at offset");
  }
  expect_data_loss(read(ByteReader(std::string_view(s).substr(0, 10), "sample")).status(),
                   "sample: d cut short at offset 7 (3 of 8 bytes)");
  expect_data_loss(read(ByteReader(std::string_view(s).substr(0, 50), "sample")).status(),
                   "sample: tokens cut short at offset 43 (7 of 3 x 4 bytes)");
}

TEST_CASE("byte codec: huge lengths are refused before anything is allocated", "[byte_codec][bad-input]") {
  std::string s;
  ByteWriter w(s);
  w.u32(std::numeric_limits<std::uint32_t>::max());
  w.bytes(std::string(12, 'x'));

  ByteReader r(s, "trajectory");
  std::vector<std::int32_t> tokens;
  r.array("response_tokens", r.u32("num_response"), tokens);
  CHECK(tokens.capacity() == 0);
  expect_data_loss(r.status(), "trajectory: response_tokens cut short at offset 4 (12 of 4294967295 x 4 bytes)");

  // A count whose byte size overflows a size_t.
  ByteReader wide(s, "trajectory");
  std::vector<std::uint64_t> ids;
  wide.array("ids", std::numeric_limits<std::size_t>::max() / 4, ids);
  CHECK(ids.capacity() == 0);
  expect_data_loss(wide.status(), "ids cut short at offset 0");

  CHECK(ByteReader(s, "blob").prefixed("payload", 1 << 20).empty());
  ByteReader limited(s, "blob");
  limited.prefixed("payload", 1 << 20);
  expect_data_loss(limited.status(),
                   "blob: payload length 4294967295 exceeds the limit of 1048576 bytes at offset 0");
  std::string small;
  ByteWriter(small).prefixed("abcdef");
  ByteReader within(small, "blob");
  within.prefixed("payload", 5);
  expect_data_loss(within.status(), "payload length 6 exceeds the limit of 5 bytes");
}

TEST_CASE("byte codec: trailing bytes are refused by finish", "[byte_codec][bad-input]") {
  std::string s;
  write(sample(), s);
  s += "!!";
  expect_data_loss(read(ByteReader(s, "sample")).status(), "sample: 2 trailing bytes at offset 58");
}

TEST_CASE("byte codec: the first error sticks and later reads yield zero", "[byte_codec][bad-input]") {
  const std::string s("\x01\x02\x03", 3);
  ByteReader r(s, "m");
  CHECK(r.u16("a") == 0x0201);
  CHECK(r.u32("b") == 0);
  CHECK(r.u8("c") == 0);  // one byte is left, but the reader has failed
  r.fail(0, "ignored");
  CHECK(r.bytes("d", 0).empty());
  expect_data_loss(r.finish(), "m: b cut short at offset 2 (1 of 4 bytes)");

  ByteReader own(s, "m");
  own.fail(1, "kind 7 is unknown");
  expect_data_loss(own.status(), "m: kind 7 is unknown at offset 1");
}

TEST_CASE("byte codec: a sub-reader and a base offset name offsets in the enclosing bytes", "[byte_codec]") {
  std::string s;
  ByteWriter w(s);
  w.u32(1);
  w.u32(2);
  w.u32(3);
  ByteReader r(s, "file", 100);
  CHECK(r.u32("first") == 1);
  ByteReader header = r.sub("header", 6);
  CHECK(r.offset() == 110);
  CHECK(header.u32("kind") == 2);
  CHECK(header.u32("size") == 0);
  expect_data_loss(header.status(), "file: size cut short at offset 108 (2 of 4 bytes)");
  CHECK(r.ok());

  ByteReader past = r.sub("record header", 24);
  expect_data_loss(r.status(), "file: record header cut short at offset 110 (2 of 24 bytes)");
  CHECK(past.status() == r.status());
  CHECK(past.u8("x") == 0);
}
