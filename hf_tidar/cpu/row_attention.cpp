// Attention whose result for a query row depends only on that row's query and the keys it sees, in
// order: not on how many other rows share the call, nor on keys it does not see. Built with the
// few-row matmul kernel (hf_tidar/cpu/kernel.py) into the same operator library.
//
// torch's CPU attention sums a row's softmax and its weighted values in an order that depends on the
// call's key length and blocking, so a token verified in a many-row TiDAR pass (its draft keys
// appended, masked out for it) can get other bits than the same token in a one-row AR step. In float32
// that changes a greedy choice almost never; in bfloat16, where logits often tie, it does. Here every
// (batch, head, row) is one independent computation over its visible keys in increasing key order:
// scores q·k_j in float32 (the same vectorised dot for every key), the max, exp and their sum in an order
// fixed by the number of keys the row sees, then the value sum in key order. With the row-invariant linears this makes greedy TiDAR equal
// AR bit for bit, in bfloat16 too.

#include <immintrin.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "lanes16.h"
#include "vector_math.h"

#ifndef HF_TIDAR_KERNEL_LIBRARY
#define HF_TIDAR_KERNEL_LIBRARY hf_tidar_cpu
#endif

namespace {

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) {  // exact: a bfloat16 is the top half of a float32
  uint32_t bits = uint32_t(reinterpret_cast<const uint16_t&>(v)) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// 16 floats, lowered by the compiler to whatever the build has (one AVX-512 register, two AVX2 ones).
typedef float Floats16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t Halves16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t Words16 __attribute__((vector_size(64), aligned(4)));

inline Floats16 load16(const float* p) {
  Floats16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline Floats16 load16(const c10::BFloat16* p) {
  Halves16 h;
  std::memcpy(&h, p, sizeof(h));
  const Words16 w = __builtin_convertvector(h, Words16) << 16;
  Floats16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}
// 16 keys' or values' elements on lanes16.h's registers (bfloat16 widened exactly).
inline hf_tidar_cpu::Lanes16 lanes_of(const float* p) { return hf_tidar_cpu::lanes_load(p); }
inline hf_tidar_cpu::Lanes16 lanes_of(const c10::BFloat16* p) { return hf_tidar_cpu::lanes_load_bfloat16(p); }

// a * b + c, rounded once, spelled out: left to the compiler, whether `c + a * b` becomes one fused
// instruction (and which product of `x * y + z * w` it fuses) depends on the surrounding code, and a score
// must get the same bits wherever it is computed.
inline Floats16 fma16(Floats16 a, Floats16 b, Floats16 c) {
#ifdef __AVX512F__
  return (Floats16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  typedef float Floats8 __attribute__((vector_size(32)));
  const Floats8 lo = (Floats8)_mm256_fmadd_ps((__m256)__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7),
                                              (__m256)__builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
                                              (__m256)__builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
  const Floats8 hi = (Floats8)_mm256_fmadd_ps((__m256)__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
                                              (__m256)__builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
                                              (__m256)__builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}

// The sum of 16 lanes, by halves (the same tree for every call).
inline float sum16(Floats16 v) {
  typedef float Floats8 __attribute__((vector_size(32)));
  typedef float Floats4 __attribute__((vector_size(16)));
  const Floats8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Floats4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// q · k over dim elements (a multiple of 16 on the fast path), in an order that depends only on dim.
template <class T>
inline float dot(const float* q, const T* k, int64_t dim) {
  if (dim % 16 == 0) {
    Floats16 acc = load16(q) * load16(k);
    for (int64_t d = 16; d < dim; d += 16) acc = fma16(load16(q + d), load16(k + d), acc);
    return sum16(acc);
  }
  float total = 0.0f;
  for (int64_t d = 0; d < dim; ++d) total = std::fma(q[d], widen(k[d]), total);
  return total;
}

// acc += w · v over dim elements.
template <class T>
inline void add_scaled(float* acc, float w, const T* v, int64_t dim) {
  if (dim % 16 == 0) {
    for (int64_t d = 0; d < dim; d += 16) {
      const Floats16 sum = fma16(Floats16{} + w, load16(v + d), load16(acc + d));
      std::memcpy(acc + d, &sum, sizeof(sum));
    }
    return;
  }
  for (int64_t d = 0; d < dim; ++d) acc[d] = std::fma(w, widen(v[d]), acc[d]);
}

// The 16 sums of 16 vectors, lane j the sum16 of v[j] with sum16's very additions (a_i = v_i + v_(i+8), then
// b_i = a_i + a_(i+4), then (b_0 + b_2) + (b_1 + b_3)), done for all 16 at once by pairing lanes across vectors.
inline Floats16 sum16_each(const Floats16 (&v)[16]) {
  Floats16 x[8], y[4], z[2];
  for (int p = 0; p < 8; ++p)  // x[p]: the a's of v[2p] (lanes 0-7) and v[2p+1] (lanes 8-15)
    x[p] = __builtin_shufflevector(v[2 * p], v[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * p], v[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int p = 0; p < 4; ++p)  // y[p]: the b's of v[4p .. 4p+3], four lanes each
    y[p] = __builtin_shufflevector(x[2 * p], x[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(x[2 * p], x[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int p = 0; p < 2; ++p)  // z[p]: b_0 + b_2 and b_1 + b_3 of v[8p .. 8p+7], two lanes each
    z[p] = __builtin_shufflevector(y[2 * p], y[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(y[2 * p], y[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// The scores of 16 keys (rows[j], a key per lane) against q (V = dim / 16 vectors, qv), their 16-lane partial sums in
// registers, reduced together (sum16_each). Every score takes the same instructions, so its bits depend only on q
// and its key.
template <int V, class T>
inline Floats16 score_chunk(const Floats16 (&qv)[V], const T* const (&rows)[16], float scale) {
#ifdef __AVX512F__
  Floats16 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = qv[0] * load16(rows[j]);
  for (int c = 1; c < V; ++c)
    for (int j = 0; j < 16; ++j) acc[j] = fma16(qv[c], load16(rows[j] + 16 * c), acc[j]);
  return sum16_each(acc) * scale;
#else
  // AVX2 has 16 registers, two a Floats16, and GCC lowers this type's operations there through memory: one key at a
  // time on lanes16.h's registers, each summed as sum16 sums (sum16_each's very additions).
  using namespace hf_tidar_cpu;
  Lanes16 q[V];
  for (int c = 0; c < V; ++c) q[c] = lanes_load(reinterpret_cast<const float*>(&qv[c]));
  alignas(64) float sums[16];
  for (int j = 0; j < 16; ++j) {
    Lanes16 acc = lanes_mul(q[0], lanes_of(rows[j]));
    for (int c = 1; c < V; ++c) acc = lanes_fmadd(q[c], lanes_of(rows[j] + 16 * c), acc);
    sums[j] = lanes_sum(acc);
  }
  return load16(sums) * scale;
#endif
}

// out[i] = q · (key seen[i]) * scale for i < n, 16 keys at a time (score_chunk; the last few keys' batch padded with
// the last key).
template <int V, class T>
void scores_fixed(const float* q, const T* keys, int64_t stride, const int64_t* seen, int64_t n, float scale,
                  float* out) {
  Floats16 qv[V];
  for (int c = 0; c < V; ++c) qv[c] = load16(q + 16 * c);
  for (int64_t i = 0; i < n; i += 16) {
    const T* rows[16];
    for (int j = 0; j < 16; ++j) rows[j] = keys + seen[i + j < n ? i + j : n - 1] * stride;
    const Floats16 sums = score_chunk<V>(qv, rows, scale);
    std::memcpy(out + i, &sums, sizeof(float) * (n - i < 16 ? n - i : 16));
  }
}

// scores_fixed for `queries` queries (rows of q, q_stride apart; scores to rows of out, out_stride apart) over the
// first n keys of seen, n a multiple of 16, which all of them see: each chunk of 16 keys is read once for all the
// queries (it stays in L1 while they take it in turn), not once per query.
template <int V, class T>
void shared_scores_fixed(const float* q, int64_t q_stride, int64_t queries, const T* keys, int64_t stride,
                         const int64_t* seen, int64_t n, float scale, float* out, int64_t out_stride) {
  for (int64_t i = 0; i < n; i += 16) {
    const T* rows[16];
    for (int j = 0; j < 16; ++j) rows[j] = keys + seen[i + j] * stride;
    for (int64_t r = 0; r < queries; ++r) {
      Floats16 qv[V];
      for (int c = 0; c < V; ++c) qv[c] = load16(q + r * q_stride + 16 * c);
      const Floats16 sums = score_chunk<V>(qv, rows, scale);
      std::memcpy(out + r * out_stride + i, &sums, sizeof(sums));
    }
  }
}

template <class T>
void scores(const float* q, const T* keys, int64_t stride, const int64_t* seen, int64_t n, int64_t dim, float scale,
            float* out) {
  switch (dim) {
    case 32: return scores_fixed<2>(q, keys, stride, seen, n, scale, out);
    case 64: return scores_fixed<4>(q, keys, stride, seen, n, scale, out);
    case 128: return scores_fixed<8>(q, keys, stride, seen, n, scale, out);
    default:
      for (int64_t i = 0; i < n; ++i) out[i] = dot(q, keys + seen[i] * stride, dim) * scale;
  }
}

// shared_scores_fixed for the dims with a fixed-size path; false (nothing computed) for the others.
template <class T>
bool shared_scores(const float* q, int64_t q_stride, int64_t queries, const T* keys, int64_t stride,
                   const int64_t* seen, int64_t n, int64_t dim, float scale, float* out, int64_t out_stride) {
  switch (dim) {
    case 32: return shared_scores_fixed<2>(q, q_stride, queries, keys, stride, seen, n, scale, out, out_stride), true;
    case 64: return shared_scores_fixed<4>(q, q_stride, queries, keys, stride, seen, n, scale, out, out_stride), true;
    case 128: return shared_scores_fixed<8>(q, q_stride, queries, keys, stride, seen, n, scale, out, out_stride), true;
    default: return false;
  }
}

// acc[r] += sum over from <= i < n, in order, of w[r][i] * value seen[i], for the R weight rows r < R of w (stride
// w_stride; a head of a query row each) whose sums are at acc + r * 16V (from zero where `fresh`): each value row is
// loaded once for all R, and every sum takes the same instructions as alone, so a range of keys can be continued
// later with the same bits. V = dim / 16; R * V accumulators kept in registers.
// On lanes16.h's registers (one AVX-512 register, two AVX2 ones): GCC lowered Floats16's operations through memory on
// AVX2 (a 12-row pass's attention 6x sdpa's time on a Zen 3 CPU).
template <int V, int R, class T>
void weighted_values_fixed(const float* w, int64_t w_stride, const T* values, int64_t stride, const int64_t* seen,
                           int64_t from, int64_t n, bool fresh, float* acc) {
  using namespace hf_tidar_cpu;
  Lanes16 sum[R][V];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) sum[r][c] = fresh ? lanes_zero() : lanes_load(acc + r * 16 * V + 16 * c);
  for (int64_t i = from; i < n; ++i) {
    const T* row = values + seen[i] * stride;
    Lanes16 value[V];
    for (int c = 0; c < V; ++c) value[c] = lanes_of(row + 16 * c);
    for (int r = 0; r < R; ++r) {
      const Lanes16 weight = lanes_set1(0.0f + w[r * w_stride + i]);  // as Floats16{} + w: -0 becomes +0
      for (int c = 0; c < V; ++c) sum[r][c] = lanes_fmadd(weight, value[c], sum[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) lanes_store(acc + r * 16 * V + 16 * c, sum[r][c]);
}

// Weight rows a few at a time, their sums, the value row and a weight within the registers: on AVX-512 (32) 6 for
// dims 32 and 64 (at dim 64: 24 sums, 4 value vectors, a weight), 2 for dim 128 (16 sums, 8 value vectors).
template <int V, class T>
void weighted_values_rows(const float* w, int64_t w_stride, const T* values, int64_t stride, const int64_t* seen,
                          int64_t from, int64_t n, bool fresh, int64_t rows, float* acc) {
#ifdef __AVX512F__
  constexpr int most = V >= 8 ? 2 : 24 / V < 6 ? 24 / V : 6;
#else
  constexpr int most = V <= 2 ? 2 : 1;  // AVX2: 16 registers, two a Floats16 (dim 64: 8 for the sums, 8 for a value)
#endif
  for (int64_t r = 0; r < rows; r += most) {
    const float* wr = w + r * w_stride;
    float* ar = acc + r * 16 * V;
    switch (rows - r < most ? rows - r : most) {
      case 1: weighted_values_fixed<V, 1>(wr, w_stride, values, stride, seen, from, n, fresh, ar); break;
      case 2: weighted_values_fixed<V, (most >= 2 ? 2 : 1)>(wr, w_stride, values, stride, seen, from, n, fresh, ar); break;
      case 3: weighted_values_fixed<V, (most >= 3 ? 3 : 1)>(wr, w_stride, values, stride, seen, from, n, fresh, ar); break;
      case 4: weighted_values_fixed<V, (most >= 4 ? 4 : 1)>(wr, w_stride, values, stride, seen, from, n, fresh, ar); break;
      case 5: weighted_values_fixed<V, (most >= 5 ? 5 : 1)>(wr, w_stride, values, stride, seen, from, n, fresh, ar); break;
      default: weighted_values_fixed<V, most>(wr, w_stride, values, stride, seen, from, n, fresh, ar);
    }
  }
}

// The weighted value sums of `rows` weight rows (rows of w, stride w_stride; sums: rows of acc, dim apart) over keys
// seen[from, n), continuing the sums in acc unless `fresh`.
template <class T>
void weighted_values(const float* w, int64_t w_stride, const T* values, int64_t stride, const int64_t* seen,
                     int64_t from, int64_t n, bool fresh, int64_t dim, int64_t rows, float* acc) {
  switch (dim) {
    case 32: return weighted_values_rows<2>(w, w_stride, values, stride, seen, from, n, fresh, rows, acc);
    case 64: return weighted_values_rows<4>(w, w_stride, values, stride, seen, from, n, fresh, rows, acc);
    case 128: return weighted_values_rows<8>(w, w_stride, values, stride, seen, from, n, fresh, rows, acc);
    default:
      for (int64_t r = 0; r < rows; ++r) {
        float* out = acc + r * dim;
        if (fresh)
          for (int64_t e = 0; e < dim; ++e) out[e] = 0.0f;
        for (int64_t i = from; i < n; ++i) add_scaled(out, w[r * w_stride + i], values + seen[i] * stride, dim);
      }
  }
}

struct Shape {
  int64_t batch, heads, kv_heads, queries, keys, dim;
};

// Strides of a [batch, heads, rows, dim] tensor whose last dimension is contiguous.
struct Strides {
  int64_t b, h, r;
  explicit Strides(const at::Tensor& t) : b(t.stride(0)), h(t.stride(1)), r(t.stride(2)) {}
};

using hf_tidar_cpu::exp_nonpositive;

// The keys or values of one (batch, key/value head) as float32 rows of dim: the tensor's own rows for float32, a
// widened copy in scratch for bfloat16 (exact), made once for every query row and head that reads them.
inline const float* as_floats(const float* rows, int64_t /*stride*/, int64_t /*n*/, int64_t /*dim*/,
                              std::vector<float>& /*scratch*/, int64_t& row_stride) {
  return rows;  // row_stride stays the tensor's
}
inline const float* as_floats(const c10::BFloat16* rows, int64_t stride, int64_t n, int64_t dim,
                              std::vector<float>& scratch, int64_t& row_stride) {
  // Rows start on 64-byte lines, as torch's own float32 tensors do: a 16-float load that straddles two lines costs
  // two (unaligned, SmolLM2's bfloat16 calls ran 10-25% slower than float32's).
  scratch.resize(n * dim + 16);
  const uintptr_t address = reinterpret_cast<uintptr_t>(scratch.data());
  float* out = scratch.data() + ((64 - address % 64) % 64) / sizeof(float);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < dim; ++d) out[i * dim + d] = widen(rows[i * stride + d]);
  row_stride = dim;
  return out;
}

// w[0, n) = softmax(w[0, n)): the max (exact in any order), e^(w - max), their sum in 16 lanes over the keys
// (lane i mod 16, then sum16's tree, then the last n mod 16 in order) and the division. The order depends on n
// only: a row gets the same bits wherever it is computed.
inline void softmax(float* w, int64_t n) {
  float top = w[0];
#pragma omp simd reduction(max : top)
  for (int64_t i = 1; i < n; ++i) top = w[i] > top ? w[i] : top;
#ifdef __AVX512F__
  const __m512 shift = _mm512_set1_ps(top);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 keep = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 e = hf_tidar_cpu::exp16_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, w + i), shift));
    _mm512_mask_storeu_ps(w + i, keep, e);
  }
#else
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) w[i] = exp_nonpositive(w[i] - top);
#endif
  Floats16 lanes{};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) lanes += load16(w + i);
  float total = sum16(lanes);
  for (; i < n; ++i) total += w[i];
  const float inverse = 1.0f / total;
  for (int64_t j = 0; j < n; ++j) w[j] *= inverse;
}

constexpr int64_t kMostChunkRows = 6;  // query rows of one work item (one batch row and key/value head)

// Query rows per (batch, key/value head) are split into this many near-equal chunks, each one work item: at most
// kMostChunkRows rows an item, and at least two items a thread where the rows allow it. The chunks only decide
// which rows share key and value loads, never a row's bits.
int64_t row_chunks(const Shape& s) {
  const int64_t items = s.batch * s.kv_heads, threads = at::get_num_threads();
  const int64_t wanted = std::min<int64_t>(s.queries, (2 * threads + items - 1) / items);
  return std::max<int64_t>((s.queries + kMostChunkRows - 1) / kMostChunkRows, wanted);
}

// How many leading entries the seen lists of `rows` rows (stride `stride`, counts n) have in common, over the rows
// that see something; `first` is set to the first of those (its list holds the common keys).
int64_t common_prefix(const int64_t* seen, const int64_t* n, int64_t rows, int64_t stride, int64_t& first) {
  int64_t common = 0;
  first = -1;
  for (int64_t l = 0; l < rows; ++l) {
    if (n[l] == 0) continue;
    if (first < 0) {
      first = l, common = n[l];
      continue;
    }
    const int64_t* a = seen + first * stride;
    const int64_t* b = seen + l * stride;
    int64_t i = 0;
    while (i < common && i < n[l] && a[i] == b[i]) ++i;
    common = i;
  }
  return common;
}

// Each work item is a chunk of query rows of one (batch, key/value head): the keys all its rows see first (a TiDAR
// pass's cache) are scored chunk by chunk for every row and head of the item at once, and their values summed for
// all of them in one sweep; then each row goes on alone over the keys only it sees. Every row's scores, softmax
// and sums take the instructions they would take alone, in the same order.
template <class T>
void attend(const T* q, Strides qs, const T* k, Strides ks, const T* v, Strides vs, const bool* mask,
            const int64_t (&mask_strides)[3], Shape s, float scale, T* out) {
  const int64_t group = s.heads / s.kv_heads;  // query heads per key/value head: they share every key load
  const int64_t causal_offset = s.keys - s.queries;  // without a mask, row t sees keys j <= t + offset
  const int64_t chunks = row_chunks(s);
  at::parallel_for(0, s.batch * s.kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    constexpr int64_t R = kMostChunkRows;
    std::vector<int64_t> seen(R * s.keys), n(R);
    std::vector<float> weight(R * group * s.keys), query(R * group * s.dim), acc(R * group * s.dim), key_scratch,
        value_scratch;
    int64_t widened = -1, key_stride = ks.r, value_stride = vs.r;  // the (batch, kv head) widened last
    const float *keys = nullptr, *values = nullptr;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item % chunks, g = (item / chunks) % s.kv_heads, b = item / (chunks * s.kv_heads);
      const int64_t t0 = c * s.queries / chunks, rows = (c + 1) * s.queries / chunks - t0;
      for (int64_t l = 0; l < rows; ++l) {
        const int64_t t = t0 + l;
        int64_t* row_seen = seen.data() + l * s.keys;
        n[l] = 0;
        if (mask) {
          const bool* row = mask + b * mask_strides[0] + t * mask_strides[1];
          for (int64_t j = 0; j < s.keys; ++j)
            if (row[j * mask_strides[2]]) row_seen[n[l]++] = j;
        } else {
          for (int64_t j = 0; j <= t + causal_offset && j < s.keys; ++j) row_seen[n[l]++] = j;
        }
        for (int64_t r = 0; r < group; ++r) {
          const T* qrow = q + b * qs.b + (g * group + r) * qs.h + t * qs.r;
          for (int64_t d = 0; d < s.dim; ++d) query[(l * group + r) * s.dim + d] = widen(qrow[d]);
        }
      }
      if (widened != item / chunks) {  // the chunks of one (batch, kv head) are consecutive items
        widened = item / chunks;
        key_stride = ks.r, value_stride = vs.r;
        keys = as_floats(k + b * ks.b + g * ks.h, ks.r, s.keys, s.dim, key_scratch, key_stride);
        values = as_floats(v + b * vs.b + g * vs.h, vs.r, s.keys, s.dim, value_scratch, value_stride);
      }
      // The keys every row of the item sees first: scored 16 at a time for all rows, summed for all in one sweep.
      int64_t first = 0;
      const int64_t common = rows > 1 ? common_prefix(seen.data(), n.data(), rows, s.keys, first) : 0;
      const int64_t* common_keys = seen.data() + first * s.keys;
      const int64_t scored = common >= 16 && shared_scores(query.data(), s.dim, rows * group, keys, key_stride,
                                                           common_keys, common / 16 * 16, s.dim, scale, weight.data(),
                                                           s.keys)
                                 ? common / 16 * 16 : 0;
      for (int64_t l = 0; l < rows; ++l) {
        if (n[l] == 0) continue;
        for (int64_t r = 0; r < group; ++r) {
          float* w = weight.data() + (l * group + r) * s.keys;
          scores(query.data() + (l * group + r) * s.dim, keys, key_stride, seen.data() + l * s.keys + scored,
                 n[l] - scored, s.dim, scale, w + scored);
          softmax(w, n[l]);
        }
      }
      if (common > 0)
        weighted_values(weight.data(), s.keys, values, value_stride, common_keys, 0, common, true, s.dim,
                        rows * group, acc.data());
      for (int64_t l = 0; l < rows; ++l) {
        T* dst = out + ((b * s.queries + t0 + l) * s.heads + g * group) * s.dim;  // [batch, queries, heads, dim]
        if (n[l] == 0) {  // a padding row that sees nothing: zeros (its output is never used)
          for (int64_t e = 0; e < group * s.dim; ++e) dst[e] = T(0.0f);
          continue;
        }
        float* row_acc = acc.data() + l * group * s.dim;
        weighted_values(weight.data() + l * group * s.keys, s.keys, values, value_stride, seen.data() + l * s.keys,
                        common, n[l], common == 0, s.dim, group, row_acc);
        for (int64_t e = 0; e < group * s.dim; ++e) dst[e] = T(row_acc[e]);
      }
    }
  });
}

// query [B, H, T, D], key/value [B, Hkv, S, D] (last dimension contiguous), mask None (causal, aligned to
// the last key) or bool [B or 1, 1, T, S]; returns [B, T, H, D] contiguous, transformers' attention layout.
at::Tensor row_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.sizes() == key.sizes(),
              "row_attention: query must be [B, H, T, D] and key, value [B, Hkv, S, D]");
  TORCH_CHECK(query.size(0) == key.size(0) && query.size(3) == key.size(3) && query.size(1) % key.size(1) == 0,
              "row_attention: batch and head size must match, and H must be a multiple of Hkv");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(),
              "row_attention: query, key and value must have one dtype");
  for (const at::Tensor* t : {&query, &key, &value})
    TORCH_CHECK(t->is_cpu() && t->stride(3) == 1, "row_attention: inputs must be CPU tensors with a contiguous last dim");
  const Shape s{query.size(0), query.size(1), key.size(1), query.size(2), key.size(2), query.size(3)};
  const bool* mask_data = nullptr;
  int64_t mask_strides[3] = {0, 0, 0};
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4 && mask->size(1) == 1 &&
                    mask->size(2) == s.queries && mask->size(3) == s.keys &&
                    (mask->size(0) == s.batch || mask->size(0) == 1),
                "row_attention: the mask must be bool [B or 1, 1, T, S]");
    mask_data = mask->data_ptr<bool>();
    mask_strides[0] = mask->size(0) == 1 ? 0 : mask->stride(0);
    mask_strides[1] = mask->stride(2);
    mask_strides[2] = mask->stride(3);
  }
  at::Tensor out = at::empty({s.batch, s.queries, s.heads, s.dim}, query.options());
  const float sc = static_cast<float>(scale);
  if (query.scalar_type() == at::kFloat) {
    attend<float>(query.data_ptr<float>(), Strides(query), key.data_ptr<float>(), Strides(key),
                  value.data_ptr<float>(), Strides(value), mask_data, mask_strides, s, sc, out.data_ptr<float>());
  } else {
    TORCH_CHECK(query.scalar_type() == at::kBFloat16, "row_attention: float32 or bfloat16 inputs only");
    using bf = c10::BFloat16;
    attend<bf>(query.data_ptr<bf>(), Strides(query), key.data_ptr<bf>(), Strides(key), value.data_ptr<bf>(),
               Strides(value), mask_data, mask_strides, s, sc, out.data_ptr<bf>());
  }
  return out;
}

}  // namespace

#define HF_TIDAR_LIBRARY_FRAGMENT(name, m) TORCH_LIBRARY_FRAGMENT(name, m)
HF_TIDAR_LIBRARY_FRAGMENT(HF_TIDAR_KERNEL_LIBRARY, m) {
  m.def("row_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor", &row_attention);
}
