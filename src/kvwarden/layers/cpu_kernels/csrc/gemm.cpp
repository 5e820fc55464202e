// Row-invariant float32 GEMM for the CPU: y[M, N] = x[M, K] @ W^T (+ bias), W read in place ([N, K] rows).
//
// NOTE(invariance), by construction: every output element y[m, n] is one fused multiply-add chain over
// k = 0, 1, ..., K-1 in ascending order, started from +0.0f (microkernel.h says why no blocking changes
// it), then (with a bias) one rounded add. Neither the number of rows M, the row block, the column panel,
// the thread that takes a work item nor the instruction set changes that chain. So a row's bits depend on
// its own input row and the weight only: no padding to a row tile, no per-machine calibration, no
// one-thread fallback, and the same bits on every x86-64 CPU.
//
// Layout: a panel holds 16 output columns' weight rows as K rows of 16 floats (pack_panel: a transpose, no
// arithmetic). The caller may hand in every panel packed once (kvw_pack_weight, kept for the engine's
// life: the fastest decode); otherwise each work item packs its panel into a per-thread buffer, kept while
// the thread's next items use the same panel. The panel's values are the weight's either way, so the two
// give the same bits: keeping packed copies is a speed and memory choice (library.py's budget), never a
// numerical one.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "microkernel.h"

namespace {

using kvw::MR;
using kvw::NR;

constexpr int64_t MC = 8 * MR;  // rows of x per work item

// Panel p of W ([n, k] rows, leading dimension ldw): its up to 16 columns' weight rows, transposed.
void pack_columns(const float* w, int64_t n, int64_t k, int64_t ldw, int64_t p, float* panel) {
  const float* src[NR];
  const int rows = static_cast<int>(std::min<int64_t>(NR, n - p * NR));
  for (int j = 0; j < rows; ++j) src[j] = w + (p * NR + j) * ldw;
  kvw::pack_panel(src, rows, k, panel);
}

// Rows [m0, m1) against panel p: register blocks of MR rows (the last one shorter), written through a
// 16-column staging tile so that a partial last panel and the bias take the same path.
void panel_rows(const float* x, int64_t ldx, int64_t m0, int64_t m1, const float* panel, int64_t k, int64_t n,
                int64_t p, float* y, int64_t ldy, const float* bias) {
  float tile[MR * NR];
  const int64_t c0 = p * NR;
  const int64_t cols = std::min<int64_t>(NR, n - c0);
  for (int64_t m = m0; m < m1; m += MR) {
    const int rows = static_cast<int>(std::min<int64_t>(MR, m1 - m));
    kvw::block_rows<MR>(rows, x + m * ldx, ldx, panel, k, tile, NR);
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
#pragma omp parallel for schedule(static) num_threads(threads) if (panels > 1)
  for (int64_t p = 0; p < panels; ++p) pack_columns(w, n, k, ldw, p, out + p * k * NR);
}

// y[m, n] (leading dimension ldy) = x[m, k] (ldx) @ W^T (+ bias[n]), W: [n, k] rows (leading dimension ldw);
// packed: W's panels from kvw_pack_weight, or null to pack them per work item. Work items are (panel, tile
// of MC rows), panel-major; which thread takes one changes no bit.
void kvw_gemm(const float* x, int64_t m, int64_t k, int64_t ldx, const float* w, int64_t n, int64_t ldw,
              const float* packed, float* y, int64_t ldy, const float* bias, int threads) {
  const int64_t panels = (n + NR - 1) / NR, row_tiles = (m + MC - 1) / MC;
  const int64_t items = panels * row_tiles;
#pragma omp parallel num_threads(threads) if (items > 1)
  {
    std::unique_ptr<float[]> buffer(packed == nullptr ? new float[k * NR] : nullptr);
    int64_t held = -1;  // the panel the thread's buffer holds
#pragma omp for schedule(static)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t p = it / row_tiles, rt = it % row_tiles;
      const float* panel = packed != nullptr ? packed + p * k * NR : buffer.get();
      if (packed == nullptr && p != held) {
        pack_columns(w, n, k, ldw, p, buffer.get());
        held = p;
      }
      panel_rows(x, ldx, rt * MC, std::min(m, rt * MC + MC), panel, k, n, p, y, ldy, bias);
    }
  }
}

}  // extern "C"
