// Attention whose result for a query row depends only on that row's query and the keys it sees, in
// order: not on how many other rows share the call, nor on keys it does not see. Built with the
// few-row matmul kernel (hf_tidar/cpu/kernel.py) into the same operator library.
//
// torch's CPU attention sums a row's softmax and its weighted values in an order that depends on the
// call's key length and blocking, so a token verified in a many-row TiDAR pass (its draft keys
// appended, masked out for it) can get other bits than the same token in a one-row AR step. In float32
// that changes a greedy choice almost never; in bfloat16, where logits often tie, it does. Here every
// (batch, head, row) is one independent computation over its visible keys in increasing key order:
// scores q·k_j in float32 (the same vectorised dot for every key), the max, exp and their sum in key
// order, then the value sum in key order. With the row-invariant linears this makes greedy TiDAR equal
// AR bit for bit, in bfloat16 too.

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
    for (int64_t d = 16; d < dim; d += 16) acc += load16(q + d) * load16(k + d);
    return sum16(acc);
  }
  float total = 0.0f;
  for (int64_t d = 0; d < dim; ++d) total += q[d] * widen(k[d]);
  return total;
}

// acc += w · v over dim elements.
template <class T>
inline void add_scaled(float* acc, float w, const T* v, int64_t dim) {
  if (dim % 16 == 0) {
    for (int64_t d = 0; d < dim; d += 16) {
      const Floats16 sum = load16(acc + d) + w * load16(v + d);
      std::memcpy(acc + d, &sum, sizeof(sum));
    }
    return;
  }
  for (int64_t d = 0; d < dim; ++d) acc[d] += w * widen(v[d]);
}

struct Shape {
  int64_t batch, heads, kv_heads, queries, keys, dim;
};

// Strides of a [batch, heads, rows, dim] tensor whose last dimension is contiguous.
struct Strides {
  int64_t b, h, r;
  explicit Strides(const at::Tensor& t) : b(t.stride(0)), h(t.stride(1)), r(t.stride(2)) {}
};

// e^x for x <= 0 (a softmax's shifted scores), float32, about 2 ulp: the exponent's integer part goes into the
// float's exponent bits, the rest through a degree-6 polynomial. Plain arithmetic, so a loop over it
// vectorises, and every element gets the same operations; below -87 it returns 0.
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.0f ? -87.0f : x;
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  const float r = (clamped - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return x < -87.0f ? 0.0f : out;
}

template <class T>
void attend(const T* q, Strides qs, const T* k, Strides ks, const T* v, Strides vs, const bool* mask,
            const int64_t (&mask_strides)[3], Shape s, float scale, T* out) {
  const int64_t group = s.heads / s.kv_heads;  // query heads per key/value head: they share every key load
  const int64_t causal_offset = s.keys - s.queries;  // without a mask, row t sees keys j <= t + offset
  at::parallel_for(0, s.batch * s.kv_heads * s.queries, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> seen(s.keys);
    std::vector<float> weight(group * s.keys), query(group * s.dim), acc(group * s.dim);
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
      for (int64_t r = 0; r < group; ++r) {
        const T* qrow = q + b * qs.b + (g * group + r) * qs.h + t * qs.r;
        for (int64_t d = 0; d < s.dim; ++d) query[r * s.dim + d] = widen(qrow[d]);
      }
      const T* kbase = k + b * ks.b + g * ks.h;
      for (int64_t i = 0; i < n; ++i) {
        const T* krow = kbase + seen[i] * ks.r;
        for (int64_t r = 0; r < group; ++r) weight[r * s.keys + i] = dot(query.data() + r * s.dim, krow, s.dim) * scale;
      }
      for (int64_t r = 0; r < group; ++r) {
        float* w = weight.data() + r * s.keys;
        float top = w[0];
        for (int64_t i = 1; i < n; ++i) top = w[i] > top ? w[i] : top;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) w[i] = exp_nonpositive(w[i] - top);
        float total = 0.0f;
        for (int64_t i = 0; i < n; ++i) total += w[i];
        const float inverse = 1.0f / total;
        for (int64_t i = 0; i < n; ++i) w[i] *= inverse;
      }
      for (int64_t e = 0; e < group * s.dim; ++e) acc[e] = 0.0f;
      const T* vbase = v + b * vs.b + g * vs.h;
      for (int64_t i = 0; i < n; ++i) {
        const T* vrow = vbase + seen[i] * vs.r;
        for (int64_t r = 0; r < group; ++r) add_scaled(acc.data() + r * s.dim, weight[r * s.keys + i], vrow, s.dim);
      }
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
