// y = x W^T (+ bias) over a weight packed once into panels of 32 output columns, on the CPU.
//
// A decode step multiplies a few rows by every weight: the product is bound by reading the
// weights, and general matrix kernels tuned for large batches read them at half the memory's
// speed here. Panel p holds W[32p .. 32p+31, :] transposed, [K][32] contiguous, so one pass
// streams it once, in order, while up to 8 rows of x are multiplied against it with 16
// vector accumulators held in registers (AVX-512; a portable loop elsewhere). Threads take
// whole panels, so every weight byte is read from memory by one thread, once per call, and
// a panel's outputs do not depend on which thread computed them.
// With one torch thread, helpers.h's low-priority helpers take chunks of panels instead.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <optional>

#include "helpers.h"

namespace {

constexpr int64_t kPanel = 32;  // output columns per panel
constexpr int64_t kRows = 8;    // rows of x per register tile
constexpr int64_t kAhead = 64;  // panel rows fetched ahead of use (4 KiB): memory keeps streaming while the FMAs run
// Rows of x per pass over a thread's panels: a long prefill's x (MBs) would otherwise be
// read again from L3 for every panel; 256 rows of it stay in L2 while the panels go by.
constexpr int64_t kBlockRows = 256;

#ifdef __AVX512F__
template <int R>
void tile(const float* x, int64_t ldx, const float* panel, int64_t k_size, const float* bias, float* y, int64_t ldy) {
  __m512 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r][0] = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    acc[r][1] = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < k_size; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kAhead) * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kAhead) * kPanel + 16), _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(panel + k * kPanel);
    const __m512 w1 = _mm512_loadu_ps(panel + k * kPanel + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * ldy, acc[r][0]);
    _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
  }
}
#else
template <int R>
void tile(const float* x, int64_t ldx, const float* panel, int64_t k_size, const float* bias, float* y, int64_t ldy) {
  float acc[R][kPanel];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kPanel; ++j) acc[r][j] = bias ? bias[j] : 0.0f;
  for (int64_t k = 0; k < k_size; ++k) {
    const float* w = panel + k * kPanel;
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
#pragma omp simd
      for (int j = 0; j < kPanel; ++j) acc[r][j] += xv * w[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kPanel; ++j) y[r * ldy + j] = acc[r][j];
}
#endif

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t);
constexpr TileFn kTiles[kRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, tile<8>};

}  // namespace

// weight: [N, K] float32, N a multiple of 32 -> panels [N / 32, K, 32].
at::Tensor pack_panels(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "pack_panels: weight must be a 2-D float32 CPU tensor");
  TORCH_CHECK(weight.size(0) % kPanel == 0, "pack_panels: out_features must be a multiple of 32");
  return weight.contiguous().view({weight.size(0) / kPanel, kPanel, weight.size(1)}).transpose(1, 2).contiguous();
}

// x: [M, K] float32 (rows contiguous); panels from pack_panels; bias: [N] or None -> y [M, N].
at::Tensor panel_linear(at::Tensor x, at::Tensor panels, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.device().is_cpu(),
              "panel_linear: x must be a 2-D float32 CPU tensor with contiguous rows");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
                  panels.scalar_type() == at::kFloat && panels.size(1) == x.size(1),
              "panel_linear: panels do not match x");
  const int64_t m_size = x.size(0), k_size = x.size(1), num_panels = panels.size(0);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == num_panels * kPanel && bias->scalar_type() == at::kFloat,
                "panel_linear: bias does not match");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({m_size, num_panels * kPanel}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldy = num_panels * kPanel;
  // Whole panels per thread: each weight byte is read from memory once, by one thread.
  const auto panels_in = [&](int64_t begin, int64_t end) {
    for (int64_t block = 0; block < m_size; block += kBlockRows) {
      const int64_t block_end = std::min(m_size, block + kBlockRows);
      for (int64_t p = begin; p < end; ++p) {
        const float* panel = pp + p * k_size * kPanel;
        const float* bp = b ? b + p * kPanel : nullptr;
        for (int64_t m = block; m < block_end; m += kRows) {
          const int64_t rows = std::min(kRows, block_end - m);
          kTiles[rows](xp + m * ldx, ldx, panel, k_size, bp, yp + m * ldy + p * kPanel, ldy);
        }
      }
    }
  };
  pdd::parallel(num_panels, 1, panels_in);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_panels", &pack_panels, "a [N, K] weight as [N / 32, K, 32] panels");
  pdd::def_helpers(m);
  m.def("panel_linear", &panel_linear, "x W^T (+ bias) over panel-packed weights",
        py::call_guard<py::gil_scoped_release>());
}
