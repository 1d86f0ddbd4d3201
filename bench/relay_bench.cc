// relay_bench: the relay tier against plain memory copies of the same bytes, in the same run.
//   relay_publish_stall: time publish() keeps the actor (copy out of its memory; hashing and commit
//     happen behind it) vs memcpy of the weight set into an already-touched buffer.
//   relay_pull_host: WeightPuller::pull from a same-process relay into host destinations vs memcpy.
// Usage: relay_bench [--mib N]   (weight set size, default 1024)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "harness.h"
#include "laminar/relay_store.h"
#include "laminar/weight_puller.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A weight set of `mib` MiB in 16 tensors, like the layers of a model.
struct Weights {
  laminar::WeightManifest manifest;
  std::vector<std::vector<float>> data;
  std::vector<laminar::TensorView> views;
  std::vector<laminar::NamedTensor> named;
  std::vector<std::string> names;

  explicit Weights(std::size_t mib) {
    const std::int64_t rows = std::int64_t(mib) * (1 << 20) / 16 / 4 / 1024;
    for (int i = 0; i < 16; ++i) {
      names.push_back("layer" + std::to_string(i) + ".w");
      if (!manifest.add(names.back(), laminar::DType::kF32, {rows, 1024}).ok()) std::abort();
    }
    for (const auto& e : manifest.entries()) {
      data.emplace_back(std::size_t(e.nbytes / 4));
      for (std::size_t k = 0; k < data.back().size(); k += 1024) data.back()[k] = float(k);
      views.push_back(laminar::TensorView::contiguous(data.back().data(), e.dtype, e.shape).value());
    }
    for (std::size_t i = 0; i < views.size(); ++i) named.push_back({manifest.entries()[i].name, views[i]});
  }

  // The same bytes packed back to back, as a memcpy baseline would see them.
  void copy_to(std::byte* dst) const {
    for (std::size_t i = 0; i < data.size(); ++i) {
      std::memcpy(dst + manifest.entries()[i].offset, data[i].data(), data[i].size() * 4);
    }
  }
};

void check(const laminar::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "relay_bench: %s: %s\n", what, s.to_string().c_str());
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t mib = 1024;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--mib") == 0 && i + 1 < argc) mib = std::strtoull(argv[++i], nullptr, 10);
  }
  if (mib < 16) mib = 16;
  constexpr int kRepeats = 7;
  Weights w(mib);
  const std::size_t bytes = w.manifest.total_bytes();
  std::vector<std::byte> scratch(bytes);
  std::memset(scratch.data(), 1, bytes);  // touched, so the baseline pays no page faults

  auto store = laminar::RelayStore::create({}).value();
  std::uint64_t version = 0;
  std::vector<double> publish_s, memcpy_s;
  for (int r = 0; r < kRepeats + 2; ++r) {
    const auto t0 = Clock::now();
    check(store->publish(laminar::Version(++version), w.manifest, w.named), "publish");
    const double ours = seconds_since(t0);
    // Not timed: the sealer finishes hashing before the next round, as it would while the actor trains.
    check(store->wait_for_version(laminar::Version(version), std::chrono::seconds(60)), "commit");
    const auto t1 = Clock::now();
    w.copy_to(scratch.data());
    const double base = seconds_since(t1);
    if (r >= 2) {
      publish_s.push_back(ours);
      memcpy_s.push_back(base);
    }
  }
  laminar::bench::report_time("relay_publish_stall_" + std::to_string(mib) + "MiB", "s", median(publish_s),
                              "memcpy", median(memcpy_s));

  // Pull into host destinations, the engine's weight buffers.
  Weights dst(mib);
  auto puller = laminar::WeightPuller::create(store).value();
  std::vector<double> pull_s, copy_s;
  for (int r = 0; r < kRepeats + 1; ++r) {
    const auto t0 = Clock::now();
    check(puller->pull(laminar::Version(version), dst.named, false), "pull");
    const double ours = seconds_since(t0);
    const auto t1 = Clock::now();
    w.copy_to(scratch.data());
    const double base = seconds_since(t1);
    if (r >= 1) {
      pull_s.push_back(ours);
      copy_s.push_back(base);
    }
  }
  if (std::memcmp(dst.data[3].data(), w.data[3].data(), dst.data[3].size() * 4) != 0) {
    std::fprintf(stderr, "relay_bench: pulled bytes differ\n");
    return 1;
  }
  laminar::bench::report_throughput("relay_pull_host_same_process_" + std::to_string(mib) + "MiB", "GB/s",
                                    double(bytes) / median(pull_s) / 1e9, "memcpy",
                                    double(bytes) / median(copy_s) / 1e9);
  return 0;
}
