// Row-wise and element-wise kernels that replace clusters of small torch calls: RMSNorm (with the residual
// add), SwiGLU, q/k norm + rotary + the K/V cache write in one pass, and the sampler's log-softmax.
//
// NOTE(invariance), by construction: each output row is computed from its own input row (and the weights)
// with one fixed sequence of operations - the RMSNorm's sum of squares in dot8's fixed order, every other
// step element by element with IEEE basic operations (compiled with -ffp-contract=off, see common.h) and
// expf_det - so neither the number of rows, an element's place in a row, the thread that takes a row nor
// the instruction set changes a bit. Rows are split between threads, never a row.
#include <cmath>
#include <cstdint>

#include "common.h"

namespace {

// out = w * (x * (1 / sqrt(mean(x * x) + eps))), as transformers computes RMSNorm in float32.
inline void norm_row(const float* x, const float* w, int64_t n, float eps, float* out) {
  const float var = kvw::sumsq8(x, n) / static_cast<float>(n);
  const float inv = 1.0f / std::sqrt(var + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

}  // namespace

extern "C" {

// x: [rows, n] (row stride ldx); out: [rows, n] contiguous. With `residual` (row stride ldr), the row is
// h = residual + x first, written to h_out (contiguous), and normalised.
void kvw_rms_norm(const float* x, int64_t ldx, const float* residual, int64_t ldr, const float* w, int64_t rows,
                  int64_t n, float eps, float* out, float* h_out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = x + r * ldx;
    if (residual != nullptr) {
      float* h = h_out + r * n;
      const float* res = residual + r * ldr;
      for (int64_t i = 0; i < n; ++i) h[i] = res[i] + src[i];
      src = h;
    }
    norm_row(src, w, n, eps, out + r * n);
  }
}

// out[r, i] = silu(gate[r, i]) * up[r, i] with silu(g) = g / (1 + e^-g); gate, up of row strides lg, lu.
void kvw_silu_mul(const float* gate, int64_t lg, const float* up, int64_t lu, int64_t rows, int64_t n, float* out,
                  int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate + r * lg;
    const float* u = up + r * lu;
    float* o = out + r * n;
    int64_t i = 0;
#ifdef KVW_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {  // the scalar line below, on 8 lanes
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 e = kvw::exp8(_mm256_xor_ps(gv, sign));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; ++i) o[i] = g[i] / (1.0f + kvw::expf_det(-g[i])) * u[i];
  }
}

// One attention layer's rows: per head, the optional RMSNorm of q and k (Qwen3), the rotation of the first
// `rdim` dimensions at the row's absolute position (rotate-half convention: x * cos + rotate_half(x) * sin,
// each product rounded, as the torch path computes it), then K and V written at the row's cache slot and
// the rotated q into q_out ([rows, hq, d] contiguous). Strides are in floats: (row, head) for q, k, v.
void kvw_rope_write_kv(const float* q, int64_t q_row, int64_t q_head, const float* k, int64_t k_row,
                       int64_t k_head, const float* v, int64_t v_row, int64_t v_head, int64_t rows, int64_t hq,
                       int64_t hkv, int64_t d, const int64_t* positions, const int64_t* slots, const float* cos,
                       const float* sin, int64_t rdim, const float* q_w, const float* k_w, float eps,
                       float* k_cache, int64_t kc_slot, float* v_cache, int64_t vc_slot, int64_t vc_head,
                       float* q_out, int threads) {
  const int64_t heads = hq + hkv;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * heads > 1)
  for (int64_t it = 0; it < rows * heads; ++it) {
    const int64_t r = it / heads, h = it % heads;
    const bool is_q = h < hq;
    const float* src = is_q ? q + r * q_row + h * q_head : k + r * k_row + (h - hq) * k_head;
    float* dst = is_q ? q_out + (r * hq + h) * d : k_cache + slots[r] * kc_slot + (h - hq) * d;
    float normed[1024];  // d <= 1024 is checked by the caller
    const float* w = is_q ? q_w : k_w;
    if (w != nullptr) {
      norm_row(src, w, d, eps, normed);
      src = normed;
    }
    if (rdim > 0) {  // (no rope: Granite's NoPE layers pass rdim 0 and no tables)
      const float* c = cos + positions[r] * rdim;
      const float* s = sin + positions[r] * rdim;
      const int64_t half = rdim / 2;
      float rotated[1024];
      for (int64_t i = 0; i < rdim; ++i) {
        const float other = i < half ? -src[i + half] : src[i - half];
        rotated[i] = src[i] * c[i] + other * s[i];
      }
      for (int64_t i = 0; i < rdim; ++i) dst[i] = rotated[i];
    }
    for (int64_t i = rdim; i < d; ++i) dst[i] = src[i];
    if (!is_q) {
      const float* vs = v + r * v_row + (h - hq) * v_head;
      float* vd = v_cache + slots[r] * vc_slot + (h - hq) * vc_head;
      for (int64_t i = 0; i < d; ++i) vd[i] = vs[i];
    }
  }
}

// out[r] = log_softmax(x[r]) for rows of n logits (row stride ldx; out contiguous): m = the exact maximum,
// s = the sum of expf_det(x - m) in softmax_numerator's fixed order, out = (x - m) - logf_det(s), each a
// rounded operation. A non-finite row gives non-finite values (the sampler refuses such rows by name).
void kvw_log_softmax(const float* x, int64_t ldx, int64_t rows, int64_t n, float* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = x + r * ldx;
    float* dst = out + r * n;
    std::memcpy(dst, src, n * sizeof(float));
    float m = -INFINITY;
    for (int64_t j = 0; j < n; ++j) m = std::max(m, src[j]);
    const float lse = kvw::logf_det(kvw::softmax_numerator(dst, n, 1.0f));  // s[j] * 1 is exact
    for (int64_t j = 0; j < n; ++j) dst[j] = (src[j] - m) - lse;
  }
}

// Seeded temperature-only draws, one per row (the sampler's counter-based exponential race; engine/sampler.py
// has the same draw in PyTorch). Row r: p = softmax(x / temps[r]) (a rounded division, then the log-softmax's
// max, expf_det and fixed-order sum, and a rounded division by the sum); for every id j, 53 bits of
// SplitMix64(j * golden + keys[r]) give u in (0, 1) and E_j = -log(u) in double; the token is the lowest id
// with the largest p_j / E_j. Integer hashing is exact and each row is computed alone, so a row's token
// depends on its logits, temperature and key only. scratch: rows * n floats.
void kvw_draw(const float* x, int64_t ldx, int64_t rows, int64_t n, const float* temps, const uint64_t* keys,
              float* scratch, int64_t* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = x + r * ldx;
    float* p = scratch + r * n;
    const float t = temps[r];
    for (int64_t j = 0; j < n; ++j) p[j] = src[j] / t;
    const float sum = kvw::softmax_numerator(p, n, 1.0f);  // p[j] * 1 is exact
    int64_t best = 0;
    double best_ratio = -1.0;
    for (int64_t j = 0; j < n; ++j) {
      uint64_t z = static_cast<uint64_t>(j) * 0x9E3779B97F4A7C15ULL + keys[r];
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
      z ^= z >> 31;
      const double u = (static_cast<double>(z >> 11) + 0.5) * 0x1p-53;
      const double ratio = static_cast<double>(p[j] / sum) / -std::log(u);
      if (ratio > best_ratio) {  // strictly larger: among equal ratios the lowest id stays
        best_ratio = ratio;
        best = j;
      }
    }
    out[r] = best;
  }
}

}  // extern "C"
