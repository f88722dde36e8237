// Causal attention read in place from a block-paged KV cache, on the CPU.
//
// One call covers a whole step: each sequence has `n` new query tokens (rows
// query_start[b] .. query_start[b+1] of q) and `seq_lens[b]` visible tokens, the new ones
// last; its K/V live in the blocks its row of block_tables names. A work item is one
// (sequence, kv head, tile of queries): the query heads that share that kv head are
// processed together (GQA), so each K/V row is read once per tile. Online softmax over
// blocks: no gathered copy of the context, no mask tensor, one pass over the cache.
// Items are handed to torch's intra-op threads from a shared counter, longest first.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int kMaxRows = 32;  // query rows (group heads x queries) per item: q and acc stay in L1

struct Item {
  int32_t seq;
  int32_t kv_head;
  int32_t q_begin;  // first query of the tile, counted from the sequence's first new token
  int32_t q_count;
  int64_t cost;  // rows x keys, for longest-first scheduling
};

// e^x for x <= 0 (Cephes expf polynomial), written so loops over it vectorise; e^-inf = 0.
inline float exp_nonpos(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

inline float dot(const float* __restrict a, const float* __restrict b, int d) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

template <typename T>
inline void to_float(const T* __restrict src, float* __restrict dst, int d) {
#pragma omp simd
  for (int i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  float scale;
};

template <typename T>
void attend(const Item& it, const Shape& sh, const T* q, const T* k_cache, const T* v_cache,
            const int32_t* block_tables, const int32_t* seq_lens, const int32_t* query_start, T* out,
            std::vector<float>& work) {
  const int D = static_cast<int>(sh.head_dim), BS = static_cast<int>(sh.block_size);
  const int G = static_cast<int>(sh.num_heads / sh.num_kv_heads);
  const int64_t H = sh.num_heads, KVH = sh.num_kv_heads;
  const int R = it.q_count * G;  // row r: query r / G of the tile, head kv_head * G + r % G
  const int64_t row0 = query_start[it.seq] + it.q_begin;
  const int64_t n_new = query_start[it.seq + 1] - query_start[it.seq];
  const int64_t first_pos = seq_lens[it.seq] - n_new + it.q_begin;  // position of the tile's first query
  const int64_t n_keys = first_pos + it.q_count;  // the tile's last query sees keys [0, n_keys)
  const int32_t* table = block_tables + it.seq * sh.max_blocks;
  constexpr bool kFloat = std::is_same<T, float>::value;

  work.resize(static_cast<size_t>(R) * D * 2 + static_cast<size_t>(R) * BS + (kFloat ? 0 : 2 * BS * D));
  float* qs = work.data();  // [R, D] scaled queries
  float* acc = qs + R * D;  // [R, D]
  float* s = acc + R * D;  // [R, BS] scores, then probabilities
  float* kbuf = s + R * BS;  // [BS, D] this block's K (and V) as float when T is not float
  float* vbuf = kbuf + BS * D;
  float m[kMaxRows], l[kMaxRows];
  for (int r = 0; r < R; ++r) {
    const T* src = q + ((row0 + r / G) * H + it.kv_head * G + r % G) * D;
    float* dst = qs + r * D;
    for (int i = 0; i < D; ++i) dst[i] = static_cast<float>(src[i]) * sh.scale;
    std::fill(acc + r * D, acc + (r + 1) * D, 0.0f);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
  }
  const int64_t row_stride = KVH * D;  // between consecutive tokens of a block, in the cache
  for (int64_t k0 = 0; k0 < n_keys; k0 += BS) {
    const int nk = static_cast<int>(std::min<int64_t>(BS, n_keys - k0));
    const int64_t base = (static_cast<int64_t>(table[k0 / BS]) * BS * KVH + it.kv_head) * D;
    const float* kb;
    const float* vb;
    int64_t stride;
    if constexpr (kFloat) {
      kb = reinterpret_cast<const float*>(k_cache + base);
      vb = reinterpret_cast<const float*>(v_cache + base);
      stride = row_stride;
    } else {
      for (int j = 0; j < nk; ++j) {
        to_float(k_cache + base + j * row_stride, kbuf + j * D, D);
        to_float(v_cache + base + j * row_stride, vbuf + j * D, D);
      }
      kb = kbuf, vb = vbuf, stride = D;
    }
    const bool diagonal = k0 + nk - 1 > first_pos;  // some row of the tile must not see some key
    for (int r = 0; r < R; ++r) {
      float* sr = s + r * BS;
      for (int j = 0; j < nk; ++j) sr[j] = dot(qs + r * D, kb + j * stride, D);
      if (diagonal) {
        const int64_t pos = first_pos + r / G;
        for (int j = 0; j < nk; ++j)
          if (k0 + j > pos) sr[j] = -std::numeric_limits<float>::infinity();
      }
      float mx = m[r];
      for (int j = 0; j < nk; ++j) mx = std::max(mx, sr[j]);
      // Key 0 is in the first block and every query sees it, so mx is finite from there on.
      const float alpha = exp_nonpos(m[r] - mx);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < nk; ++j) {
        sr[j] = exp_nonpos(sr[j] - mx);
        sum += sr[j];
      }
      l[r] = l[r] * alpha + sum;
      m[r] = mx;
      if (alpha != 1.0f) {
        float* ar = acc + r * D;
#pragma omp simd
        for (int i = 0; i < D; ++i) ar[i] *= alpha;
      }
    }
    for (int j = 0; j < nk; ++j) {
      const float* vj = vb + j * stride;
      for (int r = 0; r < R; ++r) {
        const float p = s[r * BS + j];
        float* ar = acc + r * D;
#pragma omp simd
        for (int i = 0; i < D; ++i) ar[i] += p * vj[i];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    T* dst = out + ((row0 + r / G) * H + it.kv_head * G + r % G) * D;
    const float inv = 1.0f / l[r];
    for (int i = 0; i < D; ++i) dst[i] = static_cast<T>(acc[r * D + i] * inv);
  }
}

std::vector<Item> work_items(const int32_t* seq_lens, const int32_t* query_start, int64_t num_seqs,
                             int64_t num_kv_heads, int group) {
  const int tile = std::max(1, kMaxRows / group);
  std::vector<Item> items;
  for (int32_t b = 0; b < num_seqs; ++b) {
    const int32_t n = query_start[b + 1] - query_start[b];
    const int32_t first = seq_lens[b] - n;
    for (int32_t q0 = 0; q0 < n; q0 += tile) {
      const int32_t count = std::min(tile, n - q0);
      const int64_t cost = static_cast<int64_t>(count) * group * (first + q0 + count);
      for (int32_t h = 0; h < num_kv_heads; ++h) items.push_back({b, h, q0, count, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

template <typename T>
void run_items(const std::vector<Item>& items, const Shape& sh, const torch::Tensor& q,
               const torch::Tensor& k_cache, const torch::Tensor& v_cache, const int32_t* tables,
               const int32_t* seq_lens, const int32_t* query_start, torch::Tensor& out) {
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t n = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> work;
    for (int64_t i = next++; i < n; i = next++)
      attend<T>(items[i], sh, qp, kp, vp, tables, seq_lens, query_start, op, work);
  });
}

}  // namespace

// out, q: [T, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D] (one layer);
// block_tables: [B, max_blocks] int32; seq_lens: [B] int32; query_start: [B + 1] int32 (CPU).
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start,
                     double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: q, out and the caches must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt && query_start.scalar_type() == at::kInt,
              "paged_attention: block_tables, seq_lens, query_start must be contiguous int32");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.scalar_type() == k_cache.scalar_type() &&
                  out.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_attention: shapes or dtypes do not match");
  Shape sh{q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), block_tables.size(1), static_cast<float>(scale)};
  const int group = static_cast<int>(sh.num_heads / sh.num_kv_heads);
  TORCH_CHECK(sh.num_heads % sh.num_kv_heads == 0 && group <= kMaxRows, "paged_attention: bad head counts");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const auto items = work_items(lens, starts, seq_lens.size(0), sh.num_kv_heads, group);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  switch (q.scalar_type()) {
    case at::kFloat: run_items<float>(items, sh, q, k_cache, v_cache, tables, lens, starts, out); break;
    case at::kBFloat16: run_items<c10::BFloat16>(items, sh, q, k_cache, v_cache, tables, lens, starts, out); break;
    case at::kHalf: run_items<c10::Half>(items, sh, q, k_cache, v_cache, tables, lens, starts, out); break;
    default: TORCH_CHECK(false, "paged_attention: dtype must be float32, bfloat16 or float16");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL: a service's event loop keeps running while its engine thread attends.
  m.def("paged_attention", &paged_attention, "causal attention over a paged KV cache",
        py::call_guard<py::gil_scoped_release>());
}
