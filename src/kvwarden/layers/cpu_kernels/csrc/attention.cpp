// Causal attention over the paged KV cache, read in place: prefill chunks and decode steps alike.
//
// NOTE(invariance), by construction: the output of query head h at absolute position p is computed from
// its own query row and the keys 0..p of its request, with one fixed sequence of operations:
//   s_j = (fma chain over c = 0..d-1 of q[c] * K_j[c]) * scale   (microkernel.h, as the GEMM)
//   m   = max_j s_j                                  (exact, order-free)
//   e_j = expf_det(s_j - m); l = sum8_j e_j          (the sum in a fixed 8-lane order by key position j)
//   o   = (fma chain over j = 0..p of e_j * V_j) / l (ascending key position, per output element)
// Keys are addressed by absolute position through the request's block table, starting at 0, so a row's
// arithmetic does not depend on the chunk it arrived in, its batch partners, how query rows are blocked
// (a block of rows only shares loads), the thread that runs it, or the instruction set.
// Decode equals prefill bit for bit. A block's rows are scored against the keys of its last row (padded to
// a panel of 16 with zeros); each row then reads only its own keys 0..p, so no mask is needed.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "microkernel.h"

namespace {

// Query rows per work item: a block's rows share one transposed copy of the keys (pack_keys), so more rows
// spread its cost; fewer keep the score rows in cache and give threads more items. Blocking changes no bit.
constexpr int64_t BLOCK_ROWS = 32;

struct Args {
  const float* q;
  int64_t hq, d;
  const float* k;
  int64_t k_stride;  // floats between slots; head h's key at + h * d
  const float* v;
  int64_t v_stride, v_head;  // floats between slots and between heads
  int64_t hkv;
  float scale;
  float* out;
};

// P @ V for a register block of R rows over columns [c0, c0 + 8 NV) of the values: out[r][c] = the fma
// chain over keys j = 0 .. len - 1, ascending, from +0.0f, of e[r][j] * V_j[c] (V_j = v + slots[j] *
// stride), the chain each row's own loop would run; the rows only share each value row's load.
#ifdef KVW_AVX2
template <int R, int NV>
inline void pv_block(const float* e, int64_t lde, const float* v, const int64_t* slots, int64_t stride, int64_t len,
                     float* out) {
  __m256 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < NV; ++q) acc[r][q] = _mm256_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    const float* vj = v + slots[j] * stride;
    __m256 w[NV];
    for (int q = 0; q < NV; ++q) w[q] = _mm256_loadu_ps(vj + 8 * q);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(e + r * lde + j);
      for (int q = 0; q < NV; ++q) acc[r][q] = _mm256_fmadd_ps(a, w[q], acc[r][q]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < NV; ++q) _mm256_storeu_ps(out + r * NV * 8 + 8 * q, acc[r][q]);
}

template <int R, int NV>
inline void pv_block_rows(int rows, const float* e, int64_t lde, const float* v, const int64_t* slots, int64_t stride,
                          int64_t len, float* out) {
  if constexpr (R > 1) {
    if (rows < R) return pv_block_rows<R - 1, NV>(rows, e, lde, v, slots, stride, len, out);
  }
  pv_block<R, NV>(e, lde, v, slots, stride, len, out);
}

// Columns [c0, c0 + 8 NV) of every row's P @ V: blocks of MR rows share value loads over the keys they all
// see (lens ascend with the row), then each row continues its own chain over the keys only it sees.
template <int MR, int NV>
void pv_columns(int64_t nrows, const float* e, int64_t lde, const int64_t* lens, const float* v, const int64_t* slots,
                int64_t stride, int64_t c0, float* o, int64_t ldo) {
  float tile[MR * NV * 8];
  for (int64_t m = 0; m < nrows; m += MR) {
    const int rows = static_cast<int>(std::min<int64_t>(MR, nrows - m));
    const int64_t common = lens[m];
    pv_block_rows<MR, NV>(rows, e + m * lde, lde, v + c0, slots, stride, common, tile);
    for (int r = 0; r < rows; ++r) {
      __m256 acc[NV];
      for (int q = 0; q < NV; ++q) acc[q] = _mm256_loadu_ps(tile + r * NV * 8 + 8 * q);
      const float* er = e + (m + r) * lde;
      for (int64_t j = common; j < lens[m + r]; ++j) {
        const __m256 a = _mm256_broadcast_ss(er + j);
        const float* vj = v + slots[j] * stride + c0;
        for (int q = 0; q < NV; ++q) acc[q] = _mm256_fmadd_ps(a, _mm256_loadu_ps(vj + 8 * q), acc[q]);
      }
      for (int q = 0; q < NV; ++q) _mm256_storeu_ps(o + (m + r) * ldo + c0 + 8 * q, acc[q]);
    }
  }
}
#endif

// o[row][c] = P @ V for every row (lens[row] keys each, ascending with the row), in the order above.
void pv(int64_t nrows, const float* e, int64_t lde, const int64_t* lens, const float* v, const int64_t* slots,
        int64_t stride, int64_t d, float* o) {
  int64_t c0 = 0;
#ifdef KVW_AVX2
  // (rows x vectors of 8 columns: 12 accumulators each; 32 columns per pass over the values where they fit)
  if (nrows <= 3)  // (a decode step's few rows: 32 columns per pass, fewer passes over the values)
    for (; c0 + 32 <= d; c0 += 32) pv_columns<3, 4>(nrows, e, lde, lens, v, slots, stride, c0, o, d);
  for (; c0 + 16 <= d; c0 += 16) pv_columns<6, 2>(nrows, e, lde, lens, v, slots, stride, c0, o, d);
  for (; c0 + 8 <= d; c0 += 8) pv_columns<6, 1>(nrows, e, lde, lens, v, slots, stride, c0, o, d);
#endif
  for (int64_t row = 0; row < nrows; ++row)  // the same chain, one element at a time
    for (int64_t c = c0; c < d; ++c) {
      float acc = 0.0f;
      for (int64_t j = 0; j < lens[row]; ++j) acc = std::fma(e[row * lde + j], v[slots[j] * stride + c], acc);
      o[row * d + c] = acc;
    }
}

struct Scratch {  // one thread's buffers, grown as needed and kept between work items
  std::vector<float> qrows, kt, scores, o;
  std::vector<int64_t> lens, slots;
  std::vector<float> sums;
};

// K^T of keys [0, n) for kv head g in panels of 16 keys, as microkernel.h reads them: panel p holds
// kt[p][c][j] = K_{16p + j}[c], zeros past n (read by no row: each row stops at its own keys).
void pack_keys(const Args& a, const int64_t* slots, int64_t n, int64_t g, float* kt) {
  for (int64_t p = 0; p * kvw::NR < n; ++p) {
    const float* src[kvw::NR];
    const int rows = static_cast<int>(std::min<int64_t>(kvw::NR, n - p * kvw::NR));
    for (int j = 0; j < rows; ++j) src[j] = a.k + slots[p * kvw::NR + j] * a.k_stride + g * a.d;
    kvw::pack_panel(src, rows, a.d, kt + p * a.d * kvw::NR);
  }
}

// Query rows [i0, i1) of one request (absolute positions start + i) for kv head g. The block's rows share
// loads - of a K panel across a register block of rows (scores), of value rows across a block of rows (P @ V) -
// nothing else: each (row, query head) has its own scores, softmax and accumulation, so only the row
// decides its bits.
void item(const Args& a, const int64_t* slots, int64_t row0, int64_t start, int64_t i0, int64_t i1, int64_t g,
          Scratch& buf) {
  const int64_t rep = a.hq / a.hkv, d = a.d;
  const int64_t n = start + i1;  // keys of the block's last row
  const int64_t width = (n + kvw::NR - 1) / kvw::NR * kvw::NR;
  const int64_t nrows = (i1 - i0) * rep;
  buf.qrows.resize(nrows * d);
  buf.kt.resize(width * d);
  buf.scores.resize(nrows * width);
  buf.o.resize(nrows * d);
  buf.lens.resize(nrows);
  buf.sums.resize(nrows);
  float* q = buf.qrows.data();  // row = (i - i0) * rep + r
  for (int64_t i = i0; i < i1; ++i)
    std::memcpy(q + (i - i0) * rep * d, a.q + ((row0 + i) * a.hq + g * rep) * d, rep * d * sizeof(float));
  pack_keys(a, slots, n, g, buf.kt.data());
  float* scores = buf.scores.data();  // [row][j]
  for (int64_t p = 0; p < width / kvw::NR; ++p)  // s_j = the fma chain over c of q[c] * K_j[c] (microkernel.h)
    kvw::panel_product(nrows, q, d, buf.kt.data() + p * d * kvw::NR, d, scores + p * kvw::NR, width);
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t r = 0; r < rep; ++r) {
      const int64_t row = (i - i0) * rep + r;
      const int64_t len = buf.lens[row] = start + i + 1;  // keys 0 .. p
      float* s = scores + row * width;
      buf.sums[row] = kvw::softmax_numerator(s, len, a.scale);
    }
  }
  float* o = buf.o.data();
  pv(nrows, scores, width, buf.lens.data(), a.v + g * a.v_head, slots, a.v_stride, d, o);
  for (int64_t row = 0; row < nrows; ++row) {
    const int64_t i = i0 + row / rep, r = row % rep;
    float* dst = a.out + ((row0 + i) * a.hq + g * rep + r) * d;
    for (int64_t c = 0; c < d; ++c) dst[c] = o[row * d + c] / buf.sums[row];
  }
}

}  // namespace

extern "C" {

// q: [rows, hq, d] contiguous; out: the same shape. Request s has nq[s] query rows from row row0[s], at
// positions start[s] ..; blocks + block_off[s] is its block table (position p in slot
// blocks[p / block_size] * block_size + p % block_size), long enough for start[s] + nq[s] positions.
void kvw_attention(const float* q, int64_t hq, int64_t d, const float* k, int64_t k_stride, const float* v,
                   int64_t v_stride, int64_t v_head, int64_t hkv, int64_t nseq, const int64_t* row0,
                   const int64_t* nq, const int64_t* start, const int64_t* blocks, const int64_t* block_off,
                   int64_t block_size, float scale, float* out, int threads) {
  const Args a{q, hq, d, k, k_stride, v, v_stride, v_head, hkv, scale, out};
  std::vector<int64_t> first(nseq + 1, 0);  // work items: (request, query block, kv head)
  const int64_t qb = std::max<int64_t>(1, BLOCK_ROWS / (hq / hkv));  // query positions per item
  for (int64_t s = 0; s < nseq; ++s) first[s + 1] = first[s] + (nq[s] + qb - 1) / qb * hkv;
  const int64_t items = first[nseq];
#pragma omp parallel num_threads(threads) if (items > 1)
  {
    Scratch buf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t s = std::upper_bound(first.begin(), first.end(), it) - first.begin() - 1;
      const int64_t local = it - first[s];
      const int64_t blk = local / hkv, g = local % hkv;
      const int64_t i0 = blk * qb, i1 = std::min(nq[s], i0 + qb);
      const int64_t n = start[s] + i1;  // the slot of every key the item reads, from the block table
      buf.slots.resize(n);
      const int64_t* table = blocks + block_off[s];
      for (int64_t b = 0, p = 0; p < n; ++b)
        for (int64_t o = 0; o < block_size && p < n; ++o, ++p) buf.slots[p] = table[b] * block_size + o;
      item(a, buf.slots.data(), row0[s], start[s], i0, i1, g, buf);
    }
  }
}

}  // extern "C"
