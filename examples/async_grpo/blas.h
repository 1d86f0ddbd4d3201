// blas.h: which BLAS the trainer's libtorch really runs on. Debian's libtorch calls whatever
// libblas.so.3 the alternatives system points at: netlib's reference BLAS (about 4 GFLOP/s), or an
// optimised one (OpenBLAS, BLIS) that install_deps.sh installs. OpenBLAS picks its kernels by CPU
// model and falls back to old ones on a model it does not know, though the CPU has the features; it
// reads OPENBLAS_CORETYPE only when it loads, so the fix is an environment variable set before the
// process starts (use_right_blas_kernels re-executes the program with it).
//
//   async_grpo::use_right_blas_kernels(argv);          // first thing in main()
//   const async_grpo::BlasInfo blas = async_grpo::loaded_blas();
//   if (!blas.warning().empty()) std::fprintf(stderr, "%s\n", blas.warning().c_str());
#pragma once

#include <string>

namespace async_grpo {

struct BlasInfo {
  std::string library;  // the BLAS file mapped into this process, resolved ("" when none is)
  std::string name;     // "OpenBLAS 0.3.21", "BLIS 0.9.0", "reference BLAS (netlib)", or "unknown"
  std::string kernels;  // the kernels it runs (OpenBLAS's core, BLIS's architecture); "" when it does not say
  int threads = 0;      // the BLAS's own threads (0: it does not say)
  bool reference = false;  // netlib's reference BLAS: no kernels tuned for any CPU
  // Kernels older than this CPU's features allow: OpenBLAS on a model it does not know.
  bool fallback = false;
  // The OPENBLAS_CORETYPE this CPU's features allow ("SkylakeX", "Haswell"), when fallback.
  std::string better_kernels;

  // One line: name, kernels, threads, file.
  std::string describe() const;
  // A loud line when training would run on the reference BLAS or fallback kernels; "" otherwise.
  std::string warning() const;
};

// Reads /proc/self/maps and asks the library itself.
BlasInfo loaded_blas();

// When the loaded OpenBLAS runs fallback kernels and OPENBLAS_CORETYPE is not set, sets it to the
// kernels this CPU can take and re-executes the program (/proc/self/exe, the same argv), so that
// OpenBLAS reads it when it loads; the children the program starts inherit it. Returns when there
// is nothing to do, when OPENBLAS_CORETYPE was set already (by the user, or by the first exec), or
// when exec fails.
void use_right_blas_kernels(char** argv);

// The BLAS's own thread count, where the library lets a program set it (OpenBLAS, BLIS):
// torch::set_num_threads does not reach a BLAS that libtorch only links as libblas.so.3.
void set_blas_threads(int threads);

}  // namespace async_grpo
