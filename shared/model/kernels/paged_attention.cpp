// Causal attention read in place from a block-paged KV cache, on the CPU.
//
// One call covers a whole step: each sequence has `n` new query tokens (rows
// query_start[b] .. query_start[b+1] of q) and `seq_lens[b]` visible tokens, the new ones
// last; its K/V live in the blocks its row of block_tables names. A work item is one
// (sequence, run of kv heads, tile of queries): the query heads that share a kv head are
// processed together (GQA), so each K/V row is read once per tile. A decode (one query)
// takes all its kv heads in one item when there are enough decodes to keep every thread
// busy: a block's token rows are then read whole and in order, not a head's slice of each.
// Online softmax over blocks: no gathered copy of the context, no mask tensor, one pass over
// the cache. Items are handed to torch's intra-op threads from a shared counter, longest first.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "helpers.h"

namespace {

constexpr int kMaxRows = 32;  // query rows (group heads x queries) per item: q and acc stay in L1

struct Item {
  int32_t seq;
  int32_t kv_head;  // the first of kv_count consecutive kv heads
  int32_t kv_count;
  int32_t q_begin;  // first query of the tile, counted from the sequence's first new token
  int32_t q_count;
  int64_t cost;  // rows x keys, for longest-first scheduling
};

// e^x for x <= 0 (Cephes expf polynomial); e^-inf = 0.
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_nonpos(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Portable versions of the three steps of one query row against one block of nk keys.
inline void scores_scalar(const float* q, const float* k, int64_t stride, int nk, int d, float* s) {
  for (int j = 0; j < nk; ++j) {
    float acc = 0.0f;
    for (int i = 0; i < d; ++i) acc += q[i] * k[j * stride + i];
    s[j] = acc;
  }
}

// s: scores -> probabilities (e^(s - new max)); returns the factor the row's old sums shrink by.
inline float softmax_scalar(float* s, int nk, float& m, float& l) {
  float mx = m;
  for (int j = 0; j < nk; ++j) mx = std::max(mx, s[j]);
  // Key 0 is in the first block and every query sees it, so mx is finite from there on.
  const float alpha = exp_nonpos(m - mx);
  float sum = 0.0f;
  for (int j = 0; j < nk; ++j) sum += (s[j] = exp_nonpos(s[j] - mx));
  l = l * alpha + sum;
  m = mx;
  return alpha;
}

inline void pv_scalar(const float* p, const float* v, int64_t stride, int nk, int d, float* acc) {
  for (int j = 0; j < nk; ++j)
    for (int i = 0; i < d; ++i) acc[i] += p[j] * v[j * stride + i];
}

#ifdef __AVX2__
inline __m256 exp_nonpos8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 xc = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
}

inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_shuffle_ps(x, x, 1)));
}

inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}

// Eight keys at a time, one accumulator each (no dependency chain), then one transposing
// reduction; lanes past nk read key nk - 1 again and are set to -inf. d % 8 == 0.
inline void scores_avx2(const float* q, const float* k, int64_t stride, int nk, int d, float* s) {
  for (int j0 = 0; j0 < nk; j0 += 8) {
    const float* rows[8];
    for (int j = 0; j < 8; ++j) rows[j] = k + std::min(j0 + j, nk - 1) * stride;
    __m256 a[8];
    for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[j] + i), a[j]);
    }
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
    _mm256_storeu_ps(s + j0, sums);
  }
  for (int j = nk; j < ((nk + 7) & ~7); ++j) s[j] = kNegInf;
}

// As softmax_scalar, over s padded to a multiple of 8 with -inf.
inline float softmax_avx2(float* s, int nk, float& m, float& l) {
  const int n8 = (nk + 7) & ~7;
  __m256 mv = _mm256_set1_ps(m);
  for (int j = 0; j < n8; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
  const float mx = hmax8(mv);
  const float alpha = exp_nonpos(m - mx);
  const __m256 mb = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (int j = 0; j < n8; j += 8) {
    const __m256 p = exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mb));
    _mm256_storeu_ps(s + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  l = l * alpha + hsum8(sum);
  m = mx;
  return alpha;
}

// acc[0, 8 NV) += sum_j p[j] v_j[0, 8 NV), the accumulators held in registers over the keys.
template <int NV>
inline void pv_chunk(const float* p, const float* v, int64_t stride, int nk, float* acc) {
  __m256 o[NV];
  for (int i = 0; i < NV; ++i) o[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int j = 0; j < nk; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* vj = v + j * stride;
    for (int i = 0; i < NV; ++i) o[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), o[i]);
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + 8 * i, o[i]);
}

inline void pv_avx2(const float* p, const float* v, int64_t stride, int nk, int d, float* acc) {
  for (int c = 0; c < d; c += 64) {
    switch (std::min(8, (d - c) / 8)) {
      case 8: pv_chunk<8>(p, v + c, stride, nk, acc + c); break;
      case 7: pv_chunk<7>(p, v + c, stride, nk, acc + c); break;
      case 6: pv_chunk<6>(p, v + c, stride, nk, acc + c); break;
      case 5: pv_chunk<5>(p, v + c, stride, nk, acc + c); break;
      case 4: pv_chunk<4>(p, v + c, stride, nk, acc + c); break;
      case 3: pv_chunk<3>(p, v + c, stride, nk, acc + c); break;
      case 2: pv_chunk<2>(p, v + c, stride, nk, acc + c); break;
      default: pv_chunk<1>(p, v + c, stride, nk, acc + c); break;
    }
  }
}
#endif

template <typename T>
inline void to_float(const T* __restrict src, float* __restrict dst, int d) {
#pragma omp simd
  for (int i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  float scale;
};

// Blocks per online-softmax group on the AVX-512 path (declared on every host: attend() sizes
// its scratch with it).
constexpr int kGroup = 4;

#ifdef __AVX512F__
inline __m512 exp_nonpos16(__m512 x) {  // exp_nonpos8, sixteen lanes
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __m512 xc = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), _mm512_setzero_ps());
}

// s[i] = q_i . k_j for the 16 keys of a transposed block (kt: [D][16]), RB rows at once.
template <int RB>
inline void scores16(const float* qs, int D, const float* kt, __m512* s) {
  for (int i = 0; i < RB; ++i) s[i] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m512 k = _mm512_loadu_ps(kt + d * 16);
    for (int i = 0; i < RB; ++i) s[i] = _mm512_fmadd_ps(_mm512_set1_ps(qs[i * D + d]), k, s[i]);
  }
}

// acc_i[c, c + 16 NV) += sum_j p_i[j] v_j[c, c + 16 NV), RB rows sharing each V load; row i's
// probabilities at p + i * ps.
template <int RB, int NV>
inline void pv16(const float* p, int ps, const float* v, int64_t stride, int nk, int D, float* acc) {
  __m512 a[RB][NV];
  for (int i = 0; i < RB; ++i)
    for (int c = 0; c < NV; ++c) a[i][c] = _mm512_loadu_ps(acc + i * D + 16 * c);
  for (int j = 0; j < nk; ++j) {
    __m512 vj[NV];
    for (int c = 0; c < NV; ++c) vj[c] = _mm512_loadu_ps(v + j * stride + 16 * c);
    for (int i = 0; i < RB; ++i) {
      const __m512 pij = _mm512_set1_ps(p[i * ps + j]);
      for (int c = 0; c < NV; ++c) a[i][c] = _mm512_fmadd_ps(pij, vj[c], a[i][c]);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + i * D + 16 * c, a[i][c]);
}

template <int RB>
inline void pv16_rows(const float* p, int ps, const float* v, int64_t stride, int nk, int D, float* acc) {
  for (int c = 0; c < D; c += 64) {  // 16 accumulators and 4 V vectors in registers
    switch (std::min(4, (D - c) / 16)) {
      case 4: pv16<RB, 4>(p, ps, v + c, stride, nk, D, acc + c); break;
      case 3: pv16<RB, 3>(p, ps, v + c, stride, nk, D, acc + c); break;
      case 2: pv16<RB, 2>(p, ps, v + c, stride, nk, D, acc + c); break;
      default: pv16<RB, 1>(p, ps, v + c, stride, nk, D, acc + c); break;
    }
  }
}

// attend()'s blocks for a float cache with head_dim % 16 == 0 and block_size <= 16, where a
// block's keys fit one 16-lane vector, and at least four query rows per kv head. Up to kGroup
// blocks at a time: their K is gathered once, transposed ([D][16] each), so a row's scores
// are D broadcast FMAs per block with no horizontal sums, up to four rows of one kv head
// sharing each K load; the online softmax then takes one max, one sum and one rescale of the
// row's accumulator per group rather than per block, and P.V shares each V row among the rows.
// scratch: 4 * kGroup * 16 + kv_count * kGroup * D * 16 floats.

void blocks16(const Item& it, const Shape& sh, const float* k_cache, const float* v_cache, const int32_t* table,
              int64_t first_pos, const float* qs, float* acc, float* m, float* l, float* scratch) {
  const int D = static_cast<int>(sh.head_dim), BS = static_cast<int>(sh.block_size);
  const int G = static_cast<int>(sh.num_heads / sh.num_kv_heads);
  const int NKV = it.kv_count, RQ = G * NKV, R = it.q_count * RQ;
  const int64_t n_keys = first_pos + it.q_count;
  float* p = scratch;  // [4, kGroup, 16] the row block's probabilities of the group's keys
  float* kt = p + 4 * kGroup * 16;  // [NKV, kGroup, D, 16] the group's K, transposed block by block
  const int64_t row_stride = sh.num_kv_heads * D;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i gather_at = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(row_stride)));
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  for (int64_t g0 = 0; g0 < n_keys; g0 += static_cast<int64_t>(kGroup) * BS) {
    const int nb = static_cast<int>(std::min<int64_t>(kGroup, (n_keys - g0 + BS - 1) / BS));
    int nk[kGroup];
    __mmask16 present[kGroup];
    const float* vb[kGroup];
    for (int b = 0; b < nb; ++b) {
      const int64_t k0 = g0 + static_cast<int64_t>(b) * BS;
      nk[b] = static_cast<int>(std::min<int64_t>(BS, n_keys - k0));
      present[b] = static_cast<__mmask16>((1u << nk[b]) - 1);
      const int64_t base = (static_cast<int64_t>(table[k0 / BS]) * BS * sh.num_kv_heads + it.kv_head) * D;
      vb[b] = v_cache + base;
      for (int h = 0; h < NKV; ++h)
        for (int d = 0; d < D; ++d)
          _mm512_storeu_ps(kt + ((h * kGroup + b) * D + d) * 16,
                           _mm512_mask_i32gather_ps(_mm512_setzero_ps(), present[b], gather_at,
                                                    k_cache + base + h * D + d, 4));
    }
    for (int r = 0; r < R;) {
      const int h = (r % RQ) / G;  // the row's kv head, within the item
      int rb = 1;
      while (rb < 4 && r + rb < R && ((r + rb) % RQ) / G == h) ++rb;
      __m512 s[kGroup][4];
      for (int b = 0; b < nb; ++b) {
        const float* kth = kt + (h * kGroup + b) * D * 16;
        switch (rb) {
          case 4: scores16<4>(qs + r * D, D, kth, s[b]); break;
          case 3: scores16<3>(qs + r * D, D, kth, s[b]); break;
          case 2: scores16<2>(qs + r * D, D, kth, s[b]); break;
          default: scores16<1>(qs + r * D, D, kth, s[b]); break;
        }
      }
      for (int i = 0; i < rb; ++i) {
        const int row = r + i;
        const int64_t pos = first_pos + row / RQ;  // keys after it are not seen
        __m512 top = neg_inf;
        for (int b = 0; b < nb; ++b) {
          const __mmask16 seen = present[b] & _mm512_cmple_epi32_mask(
                                                  _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(g0 + b * BS))),
                                                  _mm512_set1_epi32(static_cast<int32_t>(pos)));
          s[b][i] = _mm512_mask_mov_ps(neg_inf, seen, s[b][i]);
          top = _mm512_max_ps(top, s[b][i]);
        }
        // Key 0 is in the first group and every query sees it, so mx is finite from there on.
        const float mx = std::max(m[row], _mm512_reduce_max_ps(top));
        const float alpha = exp_nonpos(m[row] - mx);
        const __m512 mxv = _mm512_set1_ps(mx);
        __m512 sum = _mm512_setzero_ps();
        for (int b = 0; b < nb; ++b) {
          const __m512 pi = exp_nonpos16(_mm512_sub_ps(s[b][i], mxv));
          sum = _mm512_add_ps(sum, pi);
          _mm512_storeu_ps(p + (i * kGroup + b) * 16, pi);
        }
        l[row] = l[row] * alpha + _mm512_reduce_add_ps(sum);
        m[row] = mx;
        if (alpha != 1.0f)
          for (int c = 0; c < D; ++c) acc[row * D + c] *= alpha;
      }
      for (int b = 0; b < nb; ++b) {
        const float* vh = vb[b] + h * D;
        const float* pb = p + b * 16;
        switch (rb) {
          case 4: pv16_rows<4>(pb, kGroup * 16, vh, row_stride, nk[b], D, acc + r * D); break;
          case 3: pv16_rows<3>(pb, kGroup * 16, vh, row_stride, nk[b], D, acc + r * D); break;
          case 2: pv16_rows<2>(pb, kGroup * 16, vh, row_stride, nk[b], D, acc + r * D); break;
          default: pv16_rows<1>(pb, kGroup * 16, vh, row_stride, nk[b], D, acc + r * D); break;
        }
      }
      r += rb;
    }
  }
}
#endif

template <typename T>
void attend(const Item& it, const Shape& sh, const T* q, const T* k_cache, const T* v_cache,
            const int32_t* block_tables, const int32_t* seq_lens, const int32_t* query_start, T* out,
            std::vector<float>& work) {
  const int D = static_cast<int>(sh.head_dim), BS = static_cast<int>(sh.block_size);
  const int G = static_cast<int>(sh.num_heads / sh.num_kv_heads);
  const int64_t H = sh.num_heads, KVH = sh.num_kv_heads;
  const int RQ = G * it.kv_count;  // rows per query: the item's heads, kv head by kv head
  const int R = it.q_count * RQ;  // row r: query r / RQ of the tile, head kv_head * G + r % RQ
  const int64_t row0 = query_start[it.seq] + it.q_begin;
  const int64_t n_new = query_start[it.seq + 1] - query_start[it.seq];
  const int64_t first_pos = seq_lens[it.seq] - n_new + it.q_begin;  // position of the tile's first query
  const int64_t n_keys = first_pos + it.q_count;  // the tile's last query sees keys [0, n_keys)
  const int32_t* table = block_tables + it.seq * sh.max_blocks;
  constexpr bool kFloat = std::is_same<T, float>::value;
  // The 16-lane blocks where they can run (a decode's one or two rows per kv head would not
  // pay for the transpose).
  bool wide16 = false;

#ifdef __AVX512F__
  wide16 = kFloat && D % 16 == 0 && BS <= 16 && it.q_count * G >= 4;
#endif

  const int BSP = (BS + 7) & ~7;  // a row's scores, padded for 8-wide steps
  const bool wide = D % 8 == 0;  // the AVX2 steps, where compiled in
  const int NKV = it.kv_count;
  work.resize(static_cast<size_t>(R) * D * 2 +
              (wide16 ? 4 * kGroup * 16 + static_cast<size_t>(NKV) * kGroup * D * 16
                      : static_cast<size_t>(R) * BSP + (kFloat ? 0 : 2 * static_cast<size_t>(NKV) * BS * D)));
  float* qs = work.data();  // [R, D] scaled queries
  float* acc = qs + R * D;  // [R, D]
  float* s = acc + R * D;  // [R, BSP] scores, then probabilities
  float* kbuf = s + R * BSP;  // [NKV, BS, D] this block's K (and V) as float when T is not float
  float* vbuf = kbuf + NKV * BS * D;
  float m[kMaxRows], l[kMaxRows];
  for (int r = 0; r < R; ++r) {
    const T* src = q + ((row0 + r / RQ) * H + it.kv_head * G + r % RQ) * D;
    float* dst = qs + r * D;
    for (int i = 0; i < D; ++i) dst[i] = static_cast<float>(src[i]) * sh.scale;
    std::fill(acc + r * D, acc + (r + 1) * D, 0.0f);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
  }
#ifdef __AVX512F__
  if constexpr (kFloat) {
    if (wide16) blocks16(it, sh, k_cache, v_cache, table, first_pos, qs, acc, m, l, acc + R * D);
  }
#endif
  const int64_t row_stride = KVH * D;  // between consecutive tokens of a block, in the cache
  for (int64_t k0 = 0; !wide16 && k0 < n_keys; k0 += BS) {  // (the 8-key steps)
    const int nk = static_cast<int>(std::min<int64_t>(BS, n_keys - k0));
    const int64_t base = (static_cast<int64_t>(table[k0 / BS]) * BS * KVH + it.kv_head) * D;
    const float* kb;  // kv head h of the item (0 <= h < NKV), token j: kb + h * head_step + j * stride
    const float* vb;
    int64_t stride, head_step;
    if constexpr (kFloat) {
      kb = reinterpret_cast<const float*>(k_cache + base);
      vb = reinterpret_cast<const float*>(v_cache + base);
      stride = row_stride, head_step = D;
    } else {
      for (int h = 0; h < NKV; ++h)
        for (int j = 0; j < nk; ++j) {
          to_float(k_cache + base + h * D + j * row_stride, kbuf + (h * BS + j) * D, D);
          to_float(v_cache + base + h * D + j * row_stride, vbuf + (h * BS + j) * D, D);
        }
      kb = kbuf, vb = vbuf, stride = D, head_step = static_cast<int64_t>(BS) * D;
    }
    if (k0 + BS < n_keys) {  // the cache is read once, in table order: fetch the next block early
      const int64_t next = (static_cast<int64_t>(table[k0 / BS + 1]) * BS * KVH + it.kv_head) * D;
      const int64_t span = static_cast<int64_t>(NKV) * D * static_cast<int64_t>(sizeof(T));
      for (int j = 0; j < BS; ++j)
        for (int64_t b = 0; b < span; b += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(k_cache + next + j * row_stride) + b);
          __builtin_prefetch(reinterpret_cast<const char*>(v_cache + next + j * row_stride) + b);
        }
    }
    const bool diagonal = k0 + nk - 1 > first_pos;  // some row of the tile must not see some key
    for (int r = 0; r < R; ++r) {
      float* sr = s + r * BSP;
      float* ar = acc + r * D;
      const int64_t h = (r % RQ) / G;  // the row's kv head, within the item
      const float* kr = kb + h * head_step;
      const float* vr = vb + h * head_step;
#ifdef __AVX2__
      if (wide) {
        scores_avx2(qs + r * D, kr, stride, nk, D, sr);
      } else
#endif
        scores_scalar(qs + r * D, kr, stride, nk, D, sr);
      if (diagonal) {
        const int64_t pos = first_pos + r / RQ;
        for (int j = 0; j < nk; ++j)
          if (k0 + j > pos) sr[j] = kNegInf;
      }
      float alpha;
#ifdef __AVX2__
      if (wide) {
        alpha = softmax_avx2(sr, nk, m[r], l[r]);
      } else
#endif
        alpha = softmax_scalar(sr, nk, m[r], l[r]);
      if (alpha != 1.0f)
        for (int i = 0; i < D; ++i) ar[i] *= alpha;
#ifdef __AVX2__
      if (wide) {
        pv_avx2(sr, vr, stride, nk, D, ar);
        continue;
      }
#endif
      pv_scalar(sr, vr, stride, nk, D, ar);
    }
  }
  for (int r = 0; r < R; ++r) {
    T* dst = out + ((row0 + r / RQ) * H + it.kv_head * G + r % RQ) * D;
    const float inv = 1.0f / l[r];
    for (int i = 0; i < D; ++i) dst[i] = static_cast<T>(acc[r * D + i] * inv);
  }
}

std::vector<Item> work_items(const int32_t* seq_lens, const int32_t* query_start, int64_t num_seqs,
                             int64_t num_kv_heads, int group, int64_t threads) {
  const int tile = std::max(1, kMaxRows / group);
  int64_t decodes = 0;
  for (int32_t b = 0; b < num_seqs; ++b) decodes += query_start[b + 1] - query_start[b] == 1;
  // Whole decodes keep every thread busy with a few items each: take their heads together.
  const bool whole = decodes >= 2 * threads && group * num_kv_heads <= kMaxRows;
  const int32_t kvh = static_cast<int32_t>(num_kv_heads);
  std::vector<Item> items;
  for (int32_t b = 0; b < num_seqs; ++b) {
    const int32_t n = query_start[b + 1] - query_start[b];
    const int32_t first = seq_lens[b] - n;
    if (n == 1 && whole) {
      items.push_back({b, 0, kvh, 0, 1, static_cast<int64_t>(group) * kvh * seq_lens[b]});
      continue;
    }
    for (int32_t q0 = 0; q0 < n; q0 += tile) {
      const int32_t count = std::min(tile, n - q0);
      const int64_t cost = static_cast<int64_t>(count) * group * (first + q0 + count);
      for (int32_t h = 0; h < kvh; ++h) items.push_back({b, h, 1, q0, count, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

template <typename T>
void run_items(const std::vector<Item>& items, const Shape& sh, const at::Tensor& q,
               const at::Tensor& k_cache, const at::Tensor& v_cache, const int32_t* tables,
               const int32_t* seq_lens, const int32_t* query_start, at::Tensor& out) {
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t n = static_cast<int64_t>(items.size());
  if (pdd::helpers().count() > 0 && at::get_num_threads() == 1 && n > 1) {  // one item a chunk
    pdd::helpers().run(n, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> work;
      for (int64_t i = begin; i < end; ++i)
        attend<T>(items[i], sh, qp, kp, vp, tables, seq_lens, query_start, op, work);
    });
    return;
  }
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
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                     at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_start,
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
  const auto items = work_items(lens, starts, seq_lens.size(0), sh.num_kv_heads, group, at::get_num_threads());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  switch (q.scalar_type()) {
    case at::kFloat: run_items<float>(items, sh, q, k_cache, v_cache, tables, lens, starts, out); break;
    case at::kBFloat16: run_items<c10::BFloat16>(items, sh, q, k_cache, v_cache, tables, lens, starts, out); break;
    case at::kHalf: run_items<c10::Half>(items, sh, q, k_cache, v_cache, tables, lens, starts, out); break;
    default: TORCH_CHECK(false, "paged_attention: dtype must be float32, bfloat16 or float16");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pdd::def_helpers(m);
  // Without the GIL: a service's event loop keeps running while its engine thread attends.
  m.def("paged_attention", &paged_attention, "causal attention over a paged KV cache",
        py::call_guard<py::gil_scoped_release>());
}
