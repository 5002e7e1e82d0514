// pipeoffload/backend/cpu/blas.hpp: single-precision GEMM on the CPU, from OpenBLAS.
//
// Debian's OpenBLAS 0.3.21 picks its kernel at load time from the CPU id and falls back to a
// slow generic kernel on CPUs it does not know (about 31 against 145-170 GFLOP/s on one core
// of this project's Xeons). It reads OPENBLAS_CORETYPE in a load-time constructor, so setting
// the variable in main() is too late for a linked library: this header loads the library with
// dlopen on first use, after choosing the core type from the CPU's features (unless the user
// set one), and with one thread per call (pipeline ranks are the threads). BLIS 0.9.0 (Debian)
// reached about 112 GFLOP/s here against OpenBLAS's 170 (bench/gpt_block), hence OpenBLAS.
/// @file
#pragma once

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include "../../error.hpp"

namespace pipeoffload::blas {

/// Whether sgemm transposes an operand (the values are CBLAS_TRANSPOSE's).
enum class Trans : int { no = 111, yes = 112 };  // CBLAS_TRANSPOSE values

namespace detail {

using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                          int);

struct Library {
  sgemm_fn sgemm = nullptr;
  std::string core;  // the kernel OpenBLAS chose
};

inline const Library& library() {
  static const Library lib = [] {
    Library l;
    // Choose before the library's constructor runs: the AVX-512 kernel on any CPU that has
    // the AVX-512 subsets it uses, whatever model name OpenBLAS's table knows.
    if (std::getenv("OPENBLAS_CORETYPE") == nullptr && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
      setenv("OPENBLAS_CORETYPE", "SkylakeX", 0);
    if (std::getenv("OPENBLAS_NUM_THREADS") == nullptr) setenv("OPENBLAS_NUM_THREADS", "1", 0);
    void* h = nullptr;
    for (const char* name : {"libopenblas.so.0", "libopenblas.so"})
      if ((h = dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
    if (h == nullptr)
      throw error(
          "pipeoffload::blas: cannot load OpenBLAS (libopenblas.so.0): install Debian's libopenblas0-pthread (scripts/dev.sh does)");
    l.sgemm = reinterpret_cast<sgemm_fn>(dlsym(h, "cblas_sgemm"));
    if (l.sgemm == nullptr) throw error("pipeoffload::blas: OpenBLAS has no cblas_sgemm");
    if (auto threads = reinterpret_cast<void (*)(int)>(dlsym(h, "openblas_set_num_threads"))) threads(1);
    if (auto name = reinterpret_cast<char* (*)()>(dlsym(h, "openblas_get_corename"))) l.core = name();
    return l;
  }();
  return lib;
}

}  // namespace detail

/// The kernel family OpenBLAS runs (e.g. "SkylakeX"), for benchmark reports.
inline const std::string& core_name() { return detail::library().core; }

/// Row-major C[M x N] = alpha * op(A)[M x K] * op(B)[K x N] + beta * C.
inline void sgemm(Trans ta, Trans tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
                  int ldb, float beta, float* C, int ldc) {
  if (M == 0 || N == 0) return;
  detail::library().sgemm(101 /* CblasRowMajor */, static_cast<int>(ta), static_cast<int>(tb), M, N, K, alpha, A, lda,
                          B, ldb, beta, C, ldc);
}

}  // namespace pipeoffload::blas
