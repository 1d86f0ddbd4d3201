#include "prompt_dispatch_wire.h"

#include <fmt/format.h>

#include <cstring>
#include <string_view>

namespace async_grpo {
namespace {

constexpr std::uint32_t kRequestMagic = 0x31515047u;  // "GPQ1"
constexpr std::uint32_t kGrantMagic = 0x31475047u;    // "GPG1"

class Writer {
 public:
  template <class T>
  void put(T v) {
    // resize and copy: GCC 12 misreads vector::insert of a few bytes as an overflow at -O3.
    const std::size_t at = out_.size();
    out_.resize(at + sizeof(v));
    std::memcpy(out_.data() + at, &v, sizeof(v));
  }
  std::vector<std::byte> take() { return std::move(out_); }

 private:
  std::vector<std::byte> out_;
};

// Reads fields in order; the first short read sticks as kDataLoss naming the field.
class Reader {
 public:
  Reader(std::span<const std::byte> bytes, std::string_view what) : bytes_(bytes), what_(what) {}

  template <class T>
  T get(std::string_view field) {
    T v{};
    if (!status_.ok()) return v;
    if (bytes_.size() - pos_ < sizeof(T)) {
      status_ = laminar::data_loss(fmt::format("{}: {} truncated at offset {}", what_, field, pos_));
      return v;
    }
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  // A count of `each`-byte items, checked against `limit` and then against the bytes left.
  std::uint32_t count(std::string_view field, std::size_t limit, std::size_t each) {
    const auto n = get<std::uint32_t>(field);
    if (!status_.ok()) return 0;
    if (n > limit) {
      status_ = laminar::invalid_argument(fmt::format("{}: {} is {}, above {}", what_, field, n, limit));
      return 0;
    }
    if (std::size_t(n) * each > bytes_.size() - pos_) {
      status_ = laminar::data_loss(fmt::format("{}: {} {} runs past the end", what_, field, n));
      return 0;
    }
    return n;
  }
  void fail(laminar::Status s) {
    if (status_.ok()) status_ = std::move(s);
  }
  bool ok() const { return status_.ok(); }
  laminar::Status finish() {
    if (status_.ok() && pos_ != bytes_.size()) {
      status_ = laminar::data_loss(fmt::format("{}: {} bytes left over", what_, bytes_.size() - pos_));
    }
    return status_;
  }

 private:
  std::span<const std::byte> bytes_;
  std::size_t pos_ = 0;
  std::string_view what_;
  laminar::Status status_;
};

void check_magic(Reader& r, std::uint32_t want) {
  const auto magic = r.get<std::uint32_t>("magic");
  if (r.ok() && magic != want) r.fail(laminar::data_loss(fmt::format("{:#x} is not the expected magic", magic)));
}

}  // namespace

std::vector<std::byte> encode_prompt_request(const PromptRequest& request) {
  Writer w;
  w.put(kRequestMagic);
  w.put(request.worker.value());
  w.put(request.version.value());
  w.put(request.free_slots);
  w.put(std::uint32_t(request.held.size()));
  for (laminar::TrajectoryId id : request.held) w.put(id.value());
  return w.take();
}

laminar::Result<PromptRequest> decode_prompt_request(std::span<const std::byte> body, std::size_t max_held) {
  Reader r(body, "prompt request");
  check_magic(r, kRequestMagic);
  PromptRequest q;
  q.worker = laminar::WorkerId(r.get<std::uint32_t>("worker"));
  q.version = laminar::Version(r.get<std::uint64_t>("version"));
  q.free_slots = r.get<std::uint32_t>("free_slots");
  const std::uint32_t n = r.count("held count", max_held, sizeof(std::uint64_t));
  q.held.reserve(n);
  for (std::uint32_t i = 0; i < n; ++i) q.held.emplace_back(r.get<std::uint64_t>("held id"));
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return q;
}

std::vector<std::byte> encode_grant(const Grant& grant) {
  Writer w;
  w.put(kGrantMagic);
  w.put(std::uint8_t(grant.kind));
  w.put(grant.pull_version.value());
  w.put(std::uint32_t(grant.samples.size()));
  for (const Sample& s : grant.samples) {
    w.put(s.id.value());
    w.put(s.prompt_index);
    w.put(s.sample_index);
    w.put(s.seed);
  }
  w.put(std::uint32_t(grant.drop.size()));
  for (laminar::TrajectoryId id : grant.drop) w.put(id.value());
  return w.take();
}

laminar::Result<Grant> decode_grant(std::span<const std::byte> body, std::size_t max_samples, std::size_t max_drop) {
  Reader r(body, "prompt grant");
  check_magic(r, kGrantMagic);
  Grant g;
  const auto kind = r.get<std::uint8_t>("kind");
  if (r.ok() && kind > std::uint8_t(GrantKind::kNothing)) {
    r.fail(laminar::invalid_argument(fmt::format("prompt grant: kind {} is unknown", kind)));
  }
  g.kind = GrantKind(kind);
  g.pull_version = laminar::Version(r.get<std::uint64_t>("pull_version"));
  const std::uint32_t n = r.count("sample count", max_samples, kGrantSampleBytes);
  g.samples.reserve(n);
  for (std::uint32_t i = 0; i < n; ++i) {
    Sample s;
    s.id = laminar::TrajectoryId(r.get<std::uint64_t>("sample id"));
    s.prompt_index = r.get<std::uint64_t>("prompt_index");
    s.sample_index = r.get<std::uint32_t>("sample_index");
    s.seed = r.get<std::uint64_t>("seed");
    g.samples.push_back(s);
  }
  const std::uint32_t d = r.count("drop count", max_drop, sizeof(std::uint64_t));
  g.drop.reserve(d);
  for (std::uint32_t i = 0; i < d; ++i) g.drop.emplace_back(r.get<std::uint64_t>("drop id"));
  LAMINAR_RETURN_IF_ERROR(r.finish());
  if ((g.kind == GrantKind::kWork) != !g.samples.empty()) {
    return laminar::invalid_argument(
        fmt::format("prompt grant: kind {} with {} samples", int(kind), g.samples.size()));
  }
  return g;
}

}  // namespace async_grpo
