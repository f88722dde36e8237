// A decoder layer's small ops, one call each instead of a dozen tensor ops: the residual add
// with RMSNorm, rotary embedding of q and k straight out of the packed qkv product, SwiGLU's
// silu(gate) * up, and the step's new K and V written into the paged cache.
//
// A step of a few sequences spends more time dispatching those little ops than computing
// them. Each row here is one loop over the hidden size, rows split over torch's threads (or,
// with one, its helpers: a prefill step's hundreds of rows).
// The rounding follows the tensor code they replace (shared/model/layers.py): RMSNorm normalises in
// fp32 and scales in the model dtype; RoPE rounds each product and the sum to the dtype as the
// separate multiplies and add do (built without FMA contraction, so fp32 RoPE is bit-exact).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/ParallelGuard.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "helpers.h"

namespace {

// Rows per task: at least ~256 KiB of work, so a decode step's few rows stay on one thread.
constexpr int64_t kGrainBytes = 1 << 18;

int64_t grain(int64_t row_bytes) { return std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, row_bytes)); }

// residual += x (when add); x = weight * dtype(residual * rsqrt(mean(residual^2) + eps)).
template <typename T>
void add_rms_norm_rows(T* x, T* residual, const T* weight, int64_t rows, int64_t dim, float eps, bool add) {
  pdd::parallel(rows, grain(dim * sizeof(T) * 2), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * dim;
      T* res = add ? residual + r * dim : nullptr;
      float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < dim; ++i) {
        const float v = add ? static_cast<float>(static_cast<T>(static_cast<float>(res[i]) + static_cast<float>(xr[i])))
                            : static_cast<float>(xr[i]);
        if (add) res[i] = static_cast<T>(v);
        sq += v * v;
      }
      const float inv = 1.0f / std::sqrt(sq / static_cast<float>(dim) + eps);
      const T* src = add ? res : xr;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        const float normed = static_cast<float>(static_cast<T>(static_cast<float>(src[i]) * inv));
        xr[i] = static_cast<T>(static_cast<float>(weight[i]) * normed);
      }
    }
  });
}

// One head's rotate-half RoPE: out = x * cos + [-x2, x1] * sin, each product and the sum
// rounded to T as the tensor ops round them.
template <typename T>
inline void rope_head(const T* x, const T* cos, const T* sin, T* out, int64_t d) {
  const int64_t half = d / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = static_cast<float>(static_cast<T>(static_cast<float>(x[i]) * static_cast<float>(cos[i])));
    const float b = static_cast<float>(static_cast<T>(-static_cast<float>(x[i + half]) * static_cast<float>(sin[i])));
    out[i] = static_cast<T>(a + b);
  }
#pragma omp simd
  for (int64_t i = half; i < d; ++i) {
    const float a = static_cast<float>(static_cast<T>(static_cast<float>(x[i]) * static_cast<float>(cos[i])));
    const float b = static_cast<float>(static_cast<T>(static_cast<float>(x[i - half]) * static_cast<float>(sin[i])));
    out[i] = static_cast<T>(a + b);
  }
}

template <typename T>
void rope_qk_rows(const T* qkv, const T* cos, const T* sin, T* q, T* k, int64_t rows, int64_t heads,
                  int64_t kv_heads, int64_t d) {
  const int64_t width = (heads + 2 * kv_heads) * d;
  pdd::parallel(rows, grain(width * sizeof(T)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = qkv + r * width;
      const T* c = cos + r * d;
      const T* s = sin + r * d;
      for (int64_t h = 0; h < heads; ++h) rope_head(row + h * d, c, s, q + (r * heads + h) * d, d);
      for (int64_t h = 0; h < kv_heads; ++h)
        rope_head(row + (heads + h) * d, c, s, k + (r * kv_heads + h) * d, d);
    }
  });
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, " must be a contiguous CPU tensor");
}

#define PDD_DISPATCH(dtype, NAME, ...)                                                \
  switch (dtype) {                                                                    \
    case at::kFloat: { using scalar = float; __VA_ARGS__; break; }                    \
    case at::kBFloat16: { using scalar = c10::BFloat16; __VA_ARGS__; break; }         \
    case at::kHalf: { using scalar = c10::Half; __VA_ARGS__; break; }                 \
    default: TORCH_CHECK(false, NAME ": dtype must be float32, bfloat16 or float16"); \
  }

}  // namespace

// x, residual: [T, dim]; weight: [dim]. In place: residual += x, then x = RMSNorm(residual).
void add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_rows(x, "add_rms_norm_: x");
  check_rows(residual, "add_rms_norm_: residual");
  check_rows(weight, "add_rms_norm_: weight");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.size(-1) == weight.numel() &&
                  residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm_: shapes or dtypes do not match");
  const int64_t dim = x.size(-1);
  PDD_DISPATCH(x.scalar_type(), "add_rms_norm_",
               add_rms_norm_rows<scalar>(x.data_ptr<scalar>(), residual.data_ptr<scalar>(),
                                         weight.data_ptr<scalar>(), x.numel() / dim, dim,
                                         static_cast<float>(eps), true))
}

// x: [T, dim] -> a new tensor RMSNorm(x) (x untouched).
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "rms_norm: x");
  check_rows(weight, "rms_norm: weight");
  TORCH_CHECK(x.size(-1) == weight.numel() && weight.scalar_type() == x.scalar_type(),
              "rms_norm: shapes or dtypes do not match");
  at::Tensor out = x.clone();
  const int64_t dim = x.size(-1);
  PDD_DISPATCH(x.scalar_type(), "rms_norm",
               add_rms_norm_rows<scalar>(out.data_ptr<scalar>(), nullptr, weight.data_ptr<scalar>(),
                                         x.numel() / dim, dim, static_cast<float>(eps), false))
  return out;
}

// qkv: [T, (H + 2 KVH) D] (one row per token, q heads then k then v); cos, sin: [T, D].
// Returns q [T, H, D] and k [T, KVH, D], rotated, contiguous; v stays a view of qkv.
std::vector<at::Tensor> rope_qk(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t heads, int64_t kv_heads) {
  check_rows(qkv, "rope_qk: qkv");
  check_rows(cos, "rope_qk: cos");
  check_rows(sin, "rope_qk: sin");
  const int64_t rows = qkv.size(0), d = cos.size(-1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * d && d % 2 == 0 &&
                  cos.sizes() == sin.sizes() && cos.size(0) == rows && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(),
              "rope_qk: shapes or dtypes do not match");
  at::Tensor q = at::empty({rows, heads, d}, qkv.options());
  at::Tensor k = at::empty({rows, kv_heads, d}, qkv.options());
  PDD_DISPATCH(qkv.scalar_type(), "rope_qk",
               rope_qk_rows<scalar>(qkv.data_ptr<scalar>(), cos.data_ptr<scalar>(), sin.data_ptr<scalar>(),
                                    q.data_ptr<scalar>(), k.data_ptr<scalar>(), rows, heads, kv_heads, d))
  return {q, k};
}

// gate_up: [..., 2I] (gate then up) -> silu(gate) * up, [..., I]. ATen's own kernels, called
// from here rather than from Python: the same bits as F.silu(gate) * up, without three dispatches.
// Rows go in chunks (to the helpers too), each chunk's product while its silu is in cache; each
// row is one run of ATen's vector loop either way, so the chunks do not change the bits.
at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_mul: gate_up's last dimension must be 2 I");
  const int64_t inter = gate_up.size(-1) / 2;
  const at::Tensor rows = gate_up.reshape({-1, 2 * inter});
  at::Tensor out = at::empty({rows.size(0), inter}, gate_up.options());
  const bool inference = c10::InferenceMode::is_enabled();
  pdd::parallel(rows.size(0), grain(inter * gate_up.element_size() * 3), [&](int64_t begin, int64_t end) {
    c10::InferenceMode mode(inference);  // a helper thread has its own (default) modes
    c10::ParallelGuard serial(true);     // and must not start a thread team of its own
    at::Tensor o = out.narrow(0, begin, end - begin);
    const at::Tensor part = rows.narrow(0, begin, end - begin);
    at::silu_out(o, part.narrow(1, 0, inter));
    o.mul_(part.narrow(1, inter, inter));
  });
  std::vector<int64_t> shape = gate_up.sizes().vec();
  shape.back() = inter;
  return out.view(shape);
}

// kv_cache: [L, 2, blocks, block_size, KVH, D] contiguous; slots: [T] int64 (block * block_size
// + offset); k, v: [T, KVH, D], each token's KVH x D values contiguous (v may be a view of the
// qkv product). Writes token t's K and V of layer `layer` at slot slots[t].
void store_kv(at::Tensor kv_cache, int64_t layer, at::Tensor slots, at::Tensor k, at::Tensor v) {
  check_rows(kv_cache, "store_kv: kv_cache");
  check_rows(slots, "store_kv: slots");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2 && layer >= 0 && layer < kv_cache.size(0),
              "store_kv: kv_cache must be [layers, 2, blocks, block_size, kv_heads, head_dim] and hold the layer");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, "store_kv: slots must be a 1-D int64 tensor");
  const int64_t tokens = slots.size(0), kvh = kv_cache.size(4), d = kv_cache.size(5);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == kv_cache.scalar_type() && t->dim() == 3 &&
                    t->size(0) == tokens && t->size(1) == kvh && t->size(2) == d && t->stride(2) == 1 &&
                    t->stride(1) == d,
                "store_kv: k and v must be [T, kv_heads, head_dim] in the cache's dtype, each token's row contiguous");
  }
  const int64_t slot_count = kv_cache.size(2) * kv_cache.size(3);
  const int64_t row = kvh * d * kv_cache.element_size();
  auto* layer_base = static_cast<char*>(kv_cache.data_ptr()) + layer * 2 * slot_count * row;
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(s[t] >= 0 && s[t] < slot_count, "store_kv: slot ", s[t], " is outside the cache");
  }
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size(), v_stride = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(layer_base + s[t] * row, kp + t * k_stride, row);
    std::memcpy(layer_base + (slot_count + s[t]) * row, vp + t * v_stride, row);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pdd::def_helpers(m);
  // Without the GIL, as the attention kernel: the service's event loop runs on meanwhile.
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = RMSNorm(residual), in place",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm(x) into a new tensor", py::call_guard<py::gil_scoped_release>());
  m.def("rope_qk", &rope_qk, "rotary embedding of q and k out of a packed qkv row",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "SwiGLU's silu(gate) * up of a packed gate_up product",
        py::call_guard<py::gil_scoped_release>());
  m.def("store_kv", &store_kv, "a layer's new K and V into the paged cache at their slots",
        py::call_guard<py::gil_scoped_release>());
}
