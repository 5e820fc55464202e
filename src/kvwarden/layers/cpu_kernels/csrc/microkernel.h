// The register-blocked product every compiled kernel that multiplies matrices goes through: R rows of x
// against one panel of 16 columns, out[r][j] = sum over kk of x[r][kk] * panel[kk][j].
//
// NOTE(invariance), by construction: every output element is one fused multiply-add chain over
// kk = 0, 1, ..., k-1 in ascending order, started from +0.0f. SIMD lanes run over the panel's 16 columns,
// never over kk, so neither R (how many rows share a panel load), which column of the panel an element
// sits in, nor the instruction set (AVX-512, AVX2 + FMA, or scalar std::fma: each an IEEE fused
// multiply-add with one rounding) changes the chain. An element's bits depend on its own row of x and its
// own column of the panel only. The GEMM (gemm.cpp: panels of a packed weight) and the attention scores
// (attention.cpp: panels of 16 keys' transposed K) both rely on this.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvw {

constexpr int64_t NR = 16;  // columns per panel

#if defined(__AVX512F__)
constexpr int MR = 12;  // rows per register block: 12 accumulators of 16 lanes
template <int R>
inline void block(const float* x, int64_t ldx, const float* panel, int64_t k, float* out, int64_t ldo) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const __m512 w = _mm512_loadu_ps(panel + kk * NR);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + kk]), w, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int MR = 6;  // rows per register block: 6 x 2 accumulators of 8 lanes (12 of 16 ymm registers)
template <int R>
inline void block(const float* x, int64_t ldx, const float* panel, int64_t k, float* out, int64_t ldo) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const __m256 w0 = _mm256_loadu_ps(panel + kk * NR);
    const __m256 w1 = _mm256_loadu_ps(panel + kk * NR + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * ldx + kk);
      lo[r] = _mm256_fmadd_ps(a, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, w1, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * ldo, lo[r]);
    _mm256_storeu_ps(out + r * ldo + 8, hi[r]);
  }
}
#else
constexpr int MR = 4;
template <int R>
inline void block(const float* x, int64_t ldx, const float* panel, int64_t k, float* out, int64_t ldo) {
  float acc[R][NR] = {};
  for (int64_t kk = 0; kk < k; ++kk)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < NR; ++j) acc[r][j] = std::fma(x[r * ldx + kk], panel[kk * NR + j], acc[r][j]);
  for (int r = 0; r < R; ++r) std::memcpy(out + r * ldo, acc[r], sizeof(acc[r]));
}
#endif

// block<R> for any rows <= R (a template per row count, so the accumulators stay in registers).
template <int R>
inline void block_rows(int rows, const float* x, int64_t ldx, const float* panel, int64_t k, float* out, int64_t ldo) {
  if constexpr (R > 1) {
    if (rows < R) return block_rows<R - 1>(rows, x, ldx, panel, k, out, ldo);
  }
  block<R>(x, ldx, panel, k, out, ldo);
}

// All rows of x against one panel, MR at a time: out[r][0..16) for r < rows.
inline void panel_product(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t k, float* out,
                          int64_t ldo) {
  for (int64_t m = 0; m < rows; m += MR) {
    const int r = static_cast<int>(rows - m < MR ? rows - m : MR);
    block_rows<MR>(r, x + m * ldx, ldx, panel, k, out + m * ldo, ldo);
  }
}

}  // namespace kvw
