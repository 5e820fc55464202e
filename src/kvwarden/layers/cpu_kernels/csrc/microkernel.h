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
#include "common.h"
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

#ifdef KVW_AVX2
// The 8 x 8 block r[t][c] -> r[c][t] (pure data movement: no arithmetic, so no bit can change).
inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 4h .. 4h + 3
    u[4 * h + 0] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
#endif

// One panel as block() reads it (the GEMM's weight panels, attention's transposed keys):
// panel[kk * 16 + j] = src[j][kk] for kk < k, zeros for rows j >= rows (src[j] is row j's first element).
// Data movement only: a panel's values are its rows' values.
inline void pack_panel(const float* const* src, int rows, int64_t k, float* panel) {
  int64_t kk = 0;
#ifdef KVW_AVX2
  const __m256 zero = _mm256_setzero_ps();
  for (; kk + 8 <= k; kk += 8)
    for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 7, elements kk .. kk + 7
      __m256 r[8];
      for (int t = 0; t < 8; ++t) r[t] = 8 * h + t < rows ? _mm256_loadu_ps(src[8 * h + t] + kk) : zero;
      transpose8(r);
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(panel + (kk + c) * NR + 8 * h, r[c]);
    }
#endif
  for (; kk < k; ++kk)
    for (int j = 0; j < NR; ++j) panel[kk * NR + j] = j < rows ? src[j][kk] : 0.0f;
}

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
