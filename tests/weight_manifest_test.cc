#include "laminar/weight_manifest.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <vector>

using laminar::DType;
using laminar::StatusCode;
using laminar::WeightManifest;

namespace {

WeightManifest small_model() {
  WeightManifest m;
  REQUIRE(m.add("embed", DType::kBF16, {100, 64}).ok());  // 12800 bytes
  REQUIRE(m.add("norm", DType::kF32, {64}).ok());         // 256 bytes
  REQUIRE(m.add("head", DType::kF16, {3, 5}).ok());       // 30 bytes
  return m;
}

void expect_invalid(const laminar::Status& st, const char* needle) {
  REQUIRE_FALSE(st.ok());
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(st.message(), Catch::Contains(needle));
}

}  // namespace

TEST_CASE("tensors are laid out back to back on 256-byte boundaries", "[manifest]") {
  WeightManifest m = small_model();
  auto e = m.entries();
  REQUIRE(e.size() == 3);
  CHECK(e[0].offset == 0);
  CHECK(e[0].nbytes == 12800);
  CHECK(e[1].offset == 12800);
  CHECK(e[2].offset == 13056);
  CHECK(e[2].nbytes == 30);
  CHECK(m.total_bytes() == 13312);
  for (const auto& entry : e) CHECK(entry.offset % WeightManifest::kAlignment == 0);
  auto head = m.find("head");
  REQUIRE(head.ok());
  CHECK((*head)->dtype == DType::kF16);
  CHECK(m.find("missing").status().code() == StatusCode::kNotFound);
}

TEST_CASE("JSON round trip gives the same manifest", "[manifest]") {
  WeightManifest m = small_model();
  auto back = WeightManifest::from_json(m.to_json());
  REQUIRE(back.ok());
  CHECK(*back == m);
  CHECK(back->to_json() == m.to_json());
  auto empty = WeightManifest::from_json(WeightManifest().to_json());
  REQUIRE(empty.ok());
  CHECK(empty->empty());
}

TEST_CASE("add() rejects bad tensors and leaves the manifest unchanged", "[manifest]") {
  WeightManifest m = small_model();
  const std::string before = m.to_json();
  expect_invalid(m.add("embed", DType::kF32, {1}), "'embed' is already in the manifest");
  expect_invalid(m.add("z", DType::kF32, {4, 0}), "tensor 'z': dim 1 is 0");
  expect_invalid(m.add("neg", DType::kF32, {-2}), "tensor 'neg': dim 0 is -2");
  expect_invalid(m.add("", DType::kF32, {1}), "empty name");
  expect_invalid(m.add("big", DType::kI64, {std::int64_t(1) << 40, std::int64_t(1) << 30}),
                 "tensor 'big': shape [1099511627776, 1073741824] of i64 overflows");
  expect_invalid(m.add("deep", DType::kU8, {1, 1, 1, 1, 1, 1, 1, 1, 1}), "tensor 'deep': 9 dims");
  CHECK(m.to_json() == before);
}

TEST_CASE("from_json rejects corrupt manifests naming the tensor", "[manifest]") {
  using nlohmann::json;
  const json good = json::parse(small_model().to_json());
  auto with = [&](auto edit) {
    json j = good;
    edit(j);
    return WeightManifest::from_json(j.dump()).status();
  };
  expect_invalid(WeightManifest::from_json("{not json").status(), "not valid JSON");
  expect_invalid(WeightManifest::from_json("[1,2]").status(), "must be an object");
  expect_invalid(with([](json& j) { j["tensors"][1]["name"] = "embed"; }), "'embed' appears twice");
  expect_invalid(with([](json& j) { j["tensors"][2]["offset"] = 13057; }),
                 "tensor 'head': offset 13057 is not a multiple of 256");
  expect_invalid(with([](json& j) { j["tensors"][1]["offset"] = 256; }),
                 "tensor 'norm': offset 256 overlaps the previous tensor");
  expect_invalid(with([](json& j) { j["tensors"][0]["shape"] = {100, 0}; }), "tensor 'embed': dim 1 is 0");
  expect_invalid(with([](json& j) { j["tensors"][0]["shape"] = {-100, 64}; }),
                 "tensor 'embed': dim 0 is -100");
  expect_invalid(with([](json& j) { j["tensors"][0]["nbytes"] = 12801; }),
                 "tensor 'embed': nbytes is 12801 but shape [100, 64] of bf16 needs 12800");
  expect_invalid(with([](json& j) { j["tensors"][2]["dtype"] = "f64"; }), "tensor 'head': unknown dtype 'f64'");
  expect_invalid(with([](json& j) { j["tensors"][2].erase("offset"); }), "tensor 'head': missing field 'offset'");
  expect_invalid(with([](json& j) { j["tensors"][2]["nbytes"] = -30; }),
                 "tensor 'head': field 'nbytes' must be a non-negative integer");
  expect_invalid(with([](json& j) { j["total_bytes"] = 1; }), "total_bytes is 1 but the tensors end at 13312");
  expect_invalid(with([](json& j) { j["alignment"] = 64; }), "alignment 64");
  expect_invalid(with([](json& j) { j["version"] = 2; }), "format version 2");
  expect_invalid(with([](json& j) {
                   j["tensors"][2]["offset"] = 18446744073709551360ull;  // 2^64 - 256
                   j["tensors"][2]["shape"] = {1024};
                   j["tensors"][2]["nbytes"] = 2048;
                 }),
                 "tensor 'head': offset 18446744073709551360 + nbytes 2048 overflows");
  expect_invalid(with([](json& j) { j["tensors"][0]["shape"] = {4294967296ll, 4294967296ll}; }),
                 "tensor 'embed': shape [4294967296, 4294967296] of bf16 overflows");
}

TEST_CASE("check_view compares dtype and shape with the manifest", "[manifest]") {
  WeightManifest m = small_model();
  std::vector<std::uint16_t> buf(15);
  std::int64_t shape[] = {3, 5};
  std::int64_t wrong_shape[] = {5, 3};
  auto ok_view = laminar::TensorView::contiguous(buf.data(), DType::kF16, shape);
  REQUIRE(ok_view.ok());
  CHECK(m.check_view("head", *ok_view).ok());
  auto bf = laminar::TensorView::contiguous(buf.data(), DType::kBF16, shape);
  expect_invalid(m.check_view("head", *bf), "view has dtype bf16 but the manifest says f16");
  auto transposed = laminar::TensorView::contiguous(buf.data(), DType::kF16, wrong_shape);
  expect_invalid(m.check_view("head", *transposed), "view has shape [5, 3] but the manifest says [3, 5]");
  CHECK(m.check_view("tail", *ok_view).code() == StatusCode::kNotFound);
}
