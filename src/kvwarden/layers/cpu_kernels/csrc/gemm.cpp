// Row-invariant float32 GEMM for the CPU: y[M, N] = x[M, K] @ W^T (+ bias), W packed in 16-column panels.
//
// NOTE(invariance), by construction: every output element y[m, n] is one fused multiply-add chain over
// k = 0, 1, ..., K-1 in ascending order, started from +0.0f (microkernel.h says why no blocking changes
// it), then (with a bias) one rounded add. Neither the number of rows M, the row block, the column panel,
// the thread that takes a work item nor the instruction set changes that chain. So a row's bits depend on
// its own input row and the weight only: no padding to a row tile, no per-machine calibration, no
// one-thread fallback, and the same bits on every x86-64 CPU.
//
// Layout: panel p holds columns [16p, 16p + 16) as K rows of 16 floats (zeros past N), so the inner
// loop reads 64 contiguous bytes of weights per k and broadcasts one input element per row.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "microkernel.h"

namespace {

using kvw::MR;
using kvw::NR;

// Rows [m0, m1) of panel p: register blocks of MR rows (the last one shorter), written through a
// 16-column staging tile so that a partial last panel and the bias take the same path.
void panel_rows(const float* x, int64_t ldx, int64_t m0, int64_t m1, const float* bp, int64_t k, int64_t n, int64_t p,
                float* y, int64_t ldy, const float* bias) {
  float tile[MR * NR];
  const int64_t c0 = p * NR;
  const int64_t cols = std::min<int64_t>(NR, n - c0);
  for (int64_t m = m0; m < m1; m += MR) {
    const int rows = static_cast<int>(std::min<int64_t>(MR, m1 - m));
    kvw::block_rows<MR>(rows, x + m * ldx, ldx, bp + p * k * NR, k, tile, NR);
    for (int r = 0; r < rows; ++r) {
      float* dst = y + (m + r) * ldy + c0;
      const float* src = tile + r * NR;
      if (bias != nullptr) {
        for (int64_t j = 0; j < cols; ++j) dst[j] = src[j] + bias[c0 + j];  // one rounded add, as out + bias
      } else {
        std::memcpy(dst, src, cols * sizeof(float));
      }
    }
  }
}

}  // namespace

extern "C" {

int kvw_gemm_rows_per_block() { return MR; }

// w: [n, k] row-major (leading dimension ldw) -> out: [ceil(n / 16), k, 16], zeros past n.
void kvw_pack_weight(const float* w, int64_t n, int64_t k, int64_t ldw, float* out, int threads) {
  const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < panels; ++p) {
    float* dst = out + p * k * NR;
    for (int64_t kk = 0; kk < k; ++kk)
      for (int64_t j = 0; j < NR; ++j) {
        const int64_t col = p * NR + j;
        dst[kk * NR + j] = col < n ? w[col * ldw + kk] : 0.0f;
      }
  }
}

// y[m, n] (leading dimension ldy) = x[m, k] (ldx) @ W^T (+ bias[n]), W packed by kvw_pack_weight.
// Work items are (row block of `mc` rows, panel) pairs; which thread takes one changes no bit.
void kvw_gemm(const float* x, int64_t m, int64_t k, int64_t ldx, const float* packed, int64_t n, float* y, int64_t ldy,
              const float* bias, int threads) {
  const int64_t panels = (n + NR - 1) / NR;
  // rows per work item: a multiple of MR, small enough to share a panel's work between threads at decode
  const int64_t mc = std::max<int64_t>(MR, std::min<int64_t>(8 * MR, (m + MR - 1) / MR * MR));
  const int64_t row_blocks = (m + mc - 1) / mc;
  const int64_t items = row_blocks * panels;
#pragma omp parallel for schedule(static) num_threads(threads) if (items > 1)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t p = it / row_blocks, rb = it % row_blocks;
    const int64_t m0 = rb * mc, m1 = std::min(m, m0 + mc);
    panel_rows(x, ldx, m0, m1, packed, k, n, p, y, ldy, bias);
  }
}

}  // extern "C"
