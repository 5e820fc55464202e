// Shared arithmetic of the CPU kernels, written so that a result never depends on where an element sits.
//
// NOTE(invariance): the kernels are compiled with -ffp-contract=off, so every +, -, *, / and sqrt is one
// IEEE operation wherever the compiler vectorizes a loop or leaves a remainder scalar, and every fused
// multiply-add is explicit (std::fma or _mm256_fmadd_ps: one rounding either way). The few functions beyond
// IEEE basics (exp) are defined here from those operations, and each helper has an AVX2 body and a scalar
// body that perform the same operations in the same order: the same bits in every lane, in the scalar tail,
// and on every x86-64 CPU (an AVX-512 machine runs the AVX2 bodies).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVW_AVX2 1
#endif

namespace kvw {

constexpr float EXP_LO = -87.33654f;    // below: exact 0 (2^n would leave the normal range)
constexpr float EXP_HI = 88.3762626f;   // above: +inf (2^n <= 2^127)

// e^x from basic operations (Cephes' expf: x = n ln2 + r, a degree-5 polynomial in r, scaled by 2^n;
// relative error about 1e-7). Exact 0 below EXP_LO, +inf above EXP_HI, NaN kept.
inline float expf_det(float x) {
  if (x != x) return x;
  if (x < EXP_LO) return 0.0f;
  if (x > EXP_HI) return INFINITY;
  const float n = std::floor(std::fma(x, 1.44269504088896341f, 0.5f));
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float y = std::fma(p, r * r, r) + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// ln x for a finite x >= 1 from basic operations (Cephes' logf: x = 2^e m with m in [sqrt(1/2), sqrt(2)),
// a degree-9 polynomial in m - 1; relative error about 1e-7). Only the log-softmax's one log per row calls it.
inline float logf_det(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  int32_t e = ((bits >> 23) & 0xff) - 126;  // x = 2^e * f, f in [0.5, 1)
  bits = (bits & 0x807fffff) | (126 << 23);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  if (f < 0.707106781186547524f) {
    e -= 1;
    f = f + f - 1.0f;
  } else {
    f = f - 1.0f;
  }
  const float z = f * f;
  float y = 7.0376836292e-2f;
  y = std::fma(y, f, -1.1514610310e-1f);
  y = std::fma(y, f, 1.1676998740e-1f);
  y = std::fma(y, f, -1.2420140846e-1f);
  y = std::fma(y, f, 1.4249322787e-1f);
  y = std::fma(y, f, -1.6668057665e-1f);
  y = std::fma(y, f, 2.0000714765e-1f);
  y = std::fma(y, f, -2.4999993993e-1f);
  y = std::fma(y, f, 3.3333331174e-1f);
  y = y * f * z;
  const float fe = static_cast<float>(e);
  y = std::fma(fe, -2.12194440e-4f, y);
  y = std::fma(z, -0.5f, y);
  return std::fma(fe, 0.693359375f, f + y);
}

#ifdef KVW_AVX2
// expf_det on 8 lanes: the same operations on the in-range value, then the same special cases.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(EXP_LO), hi = _mm256_set1_ps(EXP_HI);
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), xc);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 out = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
  out = _mm256_blendv_ps(out, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
  out = _mm256_blendv_ps(out, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
  return _mm256_blendv_ps(out, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)): the fixed tree of dot8 and the softmax sum.
inline float tree8(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l0+l4 .. l3+l7
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));  // (l0+l4)+(l2+l6), (l1+l5)+(l3+l7)
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
#endif

inline float tree8(const float* l) {
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

// A dot product of length d in a fixed order: 32 lanes - element c in lane c % 32, i.e. 8-element chunk
// c / 8 in accumulator (c / 8) % 4 - each a fused multiply-add chain in ascending c from 0; then the four
// accumulators lane by lane as (a0 + a1) + (a2 + a3), then tree8. The order is a function of d alone.
// (Four chains instead of one keep the multiply-adds in flight.)
inline float dot8_lanes(const float* a, const float* b, int64_t d) {  // the definition, any d
  float lane[32] = {};
  for (int64_t c = 0; c < d; ++c) lane[c % 32] = std::fma(a[c], b[c], lane[c % 32]);
  float eight[8];
  for (int l = 0; l < 8; ++l) eight[l] = (lane[l] + lane[l + 8]) + (lane[l + 16] + lane[l + 24]);
  return tree8(eight);
}

#ifdef KVW_AVX2
inline float combine4(const __m256* acc) {
  return tree8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}
#endif

inline float dot8(const float* a, const float* b, int64_t d) {
#ifdef KVW_AVX2
  if (d % 8 == 0) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t ci = 0; ci < d / 8; ++ci)
      acc[ci % 4] = _mm256_fmadd_ps(_mm256_loadu_ps(a + 8 * ci), _mm256_loadu_ps(b + 8 * ci), acc[ci % 4]);
    return combine4(acc);
  }
#endif
  return dot8_lanes(a, b, d);
}

inline float sumsq8(const float* a, int64_t d) { return dot8(a, a, d); }

// The softmax numerator of a score row, in place, and its sum: s[j] = expf_det(s[j] * scale - m) with m the
// largest scaled score, returning their sum: lane j % 8 in ascending j, then tree8. The same operations as a pass of each (a rounded
// multiply, the exact max, a rounded subtract, expf_det, the sum), fused into two passes over the row.
inline float softmax_numerator(float* s, int64_t n, float scale) {
  int64_t j = 0;
  float m = -INFINITY;
#ifdef KVW_AVX2
  const __m256 sc = _mm256_set1_ps(scale);
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + j), sc);
    _mm256_storeu_ps(s + j, x);
    mv = _mm256_max_ps(mv, x);
  }
  alignas(32) float l[8];
  _mm256_store_ps(l, mv);
  for (int k = 0; k < 8; ++k) m = std::max(m, l[k]);
#endif
  for (; j < n; ++j) {
    s[j] = s[j] * scale;
    m = std::max(m, s[j]);
  }
  alignas(32) float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  j = 0;
#ifdef KVW_AVX2
  const __m256 mb = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mb));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (j == n) return tree8(acc);
  _mm256_store_ps(lane, acc);
#else
  for (; j + 8 <= n; j += 8)
    for (int k = 0; k < 8; ++k) {
      s[j + k] = expf_det(s[j + k] - m);
      lane[k] += s[j + k];
    }
#endif
  for (; j < n; ++j) {
    s[j] = expf_det(s[j] - m);
    lane[j % 8] += s[j];
  }
  return tree8(lane);
}

}  // namespace kvw
