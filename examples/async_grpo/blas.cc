#include "blas.h"

#include <dlfcn.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string_view>

namespace async_grpo {
namespace {

template <class F>
F* symbol(const char* name) {
  return reinterpret_cast<F*>(dlsym(RTLD_DEFAULT, name));
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return s;
}

// The first BLAS file among the process's mappings.
std::string mapped_blas() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const std::size_t slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    const std::string file = std::filesystem::path(path).filename().string();
    if (file.starts_with("libblas.so") || file.starts_with("libopenblas") || file.starts_with("libblis")) {
      std::error_code ec;
      const std::filesystem::path real = std::filesystem::canonical(path, ec);
      return ec ? path : real.string();
    }
  }
  return "";
}

// The best kernels this CPU's features allow, as OPENBLAS_CORETYPE names them, and the OpenBLAS
// cores that are at least that good.
struct Best {
  std::string_view coretype;
  std::array<std::string_view, 3> at_least;
};
const Best* best_for_cpu() {
  static const Best kAvx512{"SkylakeX", {"skylakex", "cooperlake", "sapphirerapids"}};
  static const Best kAvx2{"Haswell", {"haswell", "zen", "skylakex"}};
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512cd")) {
    return &kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return &kAvx2;
  return nullptr;
}

}  // namespace

BlasInfo loaded_blas() {
  BlasInfo b;
  b.library = mapped_blas();
  if (auto* config = symbol<char*()>("openblas_get_config")) {
    // "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Prescott MAX_THREADS=64"
    const std::string c = config();
    const std::size_t second = c.find(' ', c.find(' ') + 1);
    b.name = c.substr(0, second);
    if (auto* core = symbol<char*()>("openblas_get_corename")) b.kernels = core();
    if (auto* threads = symbol<int()>("openblas_get_num_threads")) b.threads = threads();
    if (const Best* best = best_for_cpu()) {
      const std::string k = lower(b.kernels);
      b.fallback = std::find(best->at_least.begin(), best->at_least.end(), k) == best->at_least.end();
      if (b.fallback) b.better_kernels = std::string(best->coretype);
    }
  } else if (auto* version = symbol<const char*()>("bli_info_get_version_str")) {
    b.name = fmt::format("BLIS {}", version());
    auto* arch = symbol<int()>("bli_arch_query_id");
    auto* arch_name = symbol<const char*(int)>("bli_arch_string");
    if (arch && arch_name) b.kernels = arch_name(arch());
    if (auto* threads = symbol<long()>("bli_thread_get_num_threads")) b.threads = int(threads());
  } else if (b.library.find("/blas/") != std::string::npos) {
    b.name = "reference BLAS (netlib)";
    b.reference = true;
  } else {
    b.name = "unknown";
  }
  return b;
}

std::string BlasInfo::describe() const {
  std::string s = name;
  if (!kernels.empty()) s += fmt::format(", {} kernels", kernels);
  if (threads > 0) s += fmt::format(", {} thread{}", threads, threads == 1 ? "" : "s");
  return s + fmt::format(" ({})", library.empty() ? "no BLAS file mapped" : library);
}

std::string BlasInfo::warning() const {
  if (reference) {
    return "WARNING: the trainer runs on netlib's reference BLAS (about 20x slower than an optimised one): "
           "run scripts/install_deps.sh, which installs OpenBLAS as libblas.so.3";
  }
  if (fallback) {
    return fmt::format("WARNING: {} runs its {} kernels on a CPU that takes {}: set OPENBLAS_CORETYPE={}", name,
                       kernels, better_kernels, better_kernels);
  }
  return "";
}

void use_right_blas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  const BlasInfo b = loaded_blas();
  if (!b.fallback) return;
  if (setenv("OPENBLAS_CORETYPE", b.better_kernels.c_str(), 1) != 0) return;
  execv("/proc/self/exe", argv);
  std::perror("async_grpo: re-executing with OPENBLAS_CORETYPE set");
}

void set_blas_threads(int threads) {
  if (auto* set = symbol<void(int)>("openblas_set_num_threads")) set(threads);
  if (auto* set = symbol<void(long)>("bli_thread_set_num_threads")) set(long(threads));
}

}  // namespace async_grpo
