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

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

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

// out[i] = q · (key seen[i]) * scale for i < n, V = dim / 16 known at compile time: 16 keys at a time, their
// 16-lane partial sums in registers, reduced together (sum16_each). Every score, the last few keys' too (the
// batch padded with the last key), takes the same instructions, so a score's bits depend only on q and its key.
template <int V, class T>
void scores_fixed(const float* q, const T* keys, int64_t stride, const int64_t* seen, int64_t n, float scale,
                  float* out) {
  Floats16 qv[V];
  for (int c = 0; c < V; ++c) qv[c] = load16(q + 16 * c);
  for (int64_t i = 0; i < n; i += 16) {
    const T* rows[16];
    for (int j = 0; j < 16; ++j) rows[j] = keys + seen[i + j < n ? i + j : n - 1] * stride;
    Floats16 acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = qv[0] * load16(rows[j]);
    for (int c = 1; c < V; ++c)
      for (int j = 0; j < 16; ++j) acc[j] = fma16(qv[c], load16(rows[j] + 16 * c), acc[j]);
    const Floats16 sums = sum16_each(acc) * scale;
    std::memcpy(out + i, &sums, sizeof(float) * (n - i < 16 ? n - i : 16));
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

// acc[r] = sum over i < n, in order, of w[r][i] * value seen[i], for the R heads r < R whose weights are rows of w
// (stride w_stride) and whose sums go to acc + r * 16V: each value row is loaded once for all R heads, and every
// head's sum takes the same instructions as alone. V = dim / 16; R * V accumulators kept in registers.
template <int V, int R, class T>
void weighted_values_fixed(const float* w, int64_t w_stride, const T* values, int64_t stride, const int64_t* seen,
                           int64_t n, float* acc) {
  Floats16 sum[R][V];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) sum[r][c] = Floats16{};
  for (int64_t i = 0; i < n; ++i) {
    const T* row = values + seen[i] * stride;
    Floats16 value[V];
    for (int c = 0; c < V; ++c) value[c] = load16(row + 16 * c);
    for (int r = 0; r < R; ++r) {
      const Floats16 weight = Floats16{} + w[r * w_stride + i];
      for (int c = 0; c < V; ++c) sum[r][c] = fma16(weight, value[c], sum[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(acc + r * 16 * V, sum[r], sizeof(sum[r]));
}

// Up to 16 / V heads at a time (at most 4): their accumulators fit the registers.
template <int V, class T>
void weighted_values_heads(const float* w, int64_t w_stride, const T* values, int64_t stride, const int64_t* seen,
                           int64_t n, int64_t heads, float* acc) {
  constexpr int most = 16 / V < 4 ? 16 / V : 4;
  for (int64_t r = 0; r < heads; r += most) {
    const float* wr = w + r * w_stride;
    float* ar = acc + r * 16 * V;
    switch (heads - r < most ? heads - r : most) {
      case 1: weighted_values_fixed<V, 1>(wr, w_stride, values, stride, seen, n, ar); break;
      case 2: weighted_values_fixed<V, (most >= 2 ? 2 : 1)>(wr, w_stride, values, stride, seen, n, ar); break;
      case 3: weighted_values_fixed<V, (most >= 3 ? 3 : 1)>(wr, w_stride, values, stride, seen, n, ar); break;
      default: weighted_values_fixed<V, most>(wr, w_stride, values, stride, seen, n, ar);
    }
  }
}

// The weighted value sums of `heads` heads (weights: rows of w, stride w_stride; sums: rows of acc, dim apart).
template <class T>
void weighted_values(const float* w, int64_t w_stride, const T* values, int64_t stride, const int64_t* seen,
                     int64_t n, int64_t dim, int64_t heads, float* acc) {
  switch (dim) {
    case 32: return weighted_values_heads<2>(w, w_stride, values, stride, seen, n, heads, acc);
    case 64: return weighted_values_heads<4>(w, w_stride, values, stride, seen, n, heads, acc);
    case 128: return weighted_values_heads<8>(w, w_stride, values, stride, seen, n, heads, acc);
    default:
      for (int64_t r = 0; r < heads; ++r) {
        float* out = acc + r * dim;
        for (int64_t e = 0; e < dim; ++e) out[e] = 0.0f;
        for (int64_t i = 0; i < n; ++i) add_scaled(out, w[r * w_stride + i], values + seen[i] * stride, dim);
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
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) w[i] = exp_nonpositive(w[i] - top);
  Floats16 lanes{};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) lanes += load16(w + i);
  float total = sum16(lanes);
  for (; i < n; ++i) total += w[i];
  const float inverse = 1.0f / total;
  for (int64_t j = 0; j < n; ++j) w[j] *= inverse;
}

template <class T>
void attend(const T* q, Strides qs, const T* k, Strides ks, const T* v, Strides vs, const bool* mask,
            const int64_t (&mask_strides)[3], Shape s, float scale, T* out) {
  const int64_t group = s.heads / s.kv_heads;  // query heads per key/value head: they share every key load
  const int64_t causal_offset = s.keys - s.queries;  // without a mask, row t sees keys j <= t + offset
  at::parallel_for(0, s.batch * s.kv_heads * s.queries, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> seen(s.keys);
    std::vector<float> weight(group * s.keys), query(group * s.dim), acc(group * s.dim), key_scratch, value_scratch;
    int64_t widened = -1, key_stride = ks.r, value_stride = vs.r;  // the (batch, kv head) widened last
    const float *keys = nullptr, *values = nullptr;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item % s.queries, g = (item / s.queries) % s.kv_heads, b = item / (s.queries * s.kv_heads);
      T* dst = out + ((b * s.queries + t) * s.heads + g * group) * s.dim;  // [batch, queries, heads, dim]
      int64_t n = 0;
      if (mask) {
        const bool* row = mask + b * mask_strides[0] + t * mask_strides[1];
        for (int64_t j = 0; j < s.keys; ++j)
          if (row[j * mask_strides[2]]) seen[n++] = j;
      } else {
        for (int64_t j = 0; j <= t + causal_offset && j < s.keys; ++j) seen[n++] = j;
      }
      if (n == 0) {  // a padding row that sees nothing: zeros (its output is never used)
        for (int64_t e = 0; e < group * s.dim; ++e) dst[e] = T(0.0f);
        continue;
      }
      if (widened != item / s.queries) {  // the rows of one (batch, kv head) are consecutive items
        widened = item / s.queries;
        key_stride = ks.r, value_stride = vs.r;
        keys = as_floats(k + b * ks.b + g * ks.h, ks.r, s.keys, s.dim, key_scratch, key_stride);
        values = as_floats(v + b * vs.b + g * vs.h, vs.r, s.keys, s.dim, value_scratch, value_stride);
      }
      for (int64_t r = 0; r < group; ++r) {
        const T* qrow = q + b * qs.b + (g * group + r) * qs.h + t * qs.r;
        for (int64_t d = 0; d < s.dim; ++d) query[r * s.dim + d] = widen(qrow[d]);
      }
      for (int64_t r = 0; r < group; ++r)
        scores(query.data() + r * s.dim, keys, key_stride, seen.data(), n, s.dim, scale, weight.data() + r * s.keys);
      for (int64_t r = 0; r < group; ++r) softmax(weight.data() + r * s.keys, n);
      weighted_values(weight.data(), s.keys, values, value_stride, seen.data(), n, s.dim, group, acc.data());
      for (int64_t e = 0; e < group * s.dim; ++e) dst[e] = T(acc[e]);
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
