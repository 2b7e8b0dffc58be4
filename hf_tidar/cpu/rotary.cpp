// Rotary position embedding of a step's query and key rows, in the few-row kernel's operator library.
//
// transformers applies it as fourteen small operators a layer (unsqueeze, mul, two slices, neg, cat, mul, add, for
// the query and again for the key): about 25-30 µs a layer on a 2-core Zen 4 EPYC whatever the row count, 0.8-1 ms
// of every SmolLM2 decode step. One operator does both tensors in a few µs.
//
// Each value: out[i] = x[i] * cos[i] + rotate_half(x)[i] * sin[i], rotate_half(x) = (-x[h:], x[:h]) for h = D / 2,
// with transformers' operations and roundings: each product rounded to the input's dtype, then their sum rounded.
// In float32 the compiler must not fuse a product and the sum into one multiply-add (another rounding), so the
// function that computes them is built without contraction. The result has transformers' bits in both dtypes.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#ifndef HF_TIDAR_KERNEL_LIBRARY
#define HF_TIDAR_KERNEL_LIBRARY hf_tidar_cpu
#endif

#if defined(__clang__)
#define HF_TIDAR_NO_CONTRACT
#define HF_TIDAR_NO_CONTRACT_BODY _Pragma("clang fp contract(off)")
#elif defined(__GNUC__)
#define HF_TIDAR_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#define HF_TIDAR_NO_CONTRACT_BODY
#else
#define HF_TIDAR_NO_CONTRACT
#define HF_TIDAR_NO_CONTRACT_BODY
#endif

namespace {

inline float as_float(float v) { return v; }
inline float as_float(c10::BFloat16 v) { return static_cast<float>(v); }

// x[0, d) rotated into out[0, d) with one position's cos and sin (each d values).
template <class T>
HF_TIDAR_NO_CONTRACT void rotate_row(const T* x, const T* cos, const T* sin, T* out, int64_t d) {
  HF_TIDAR_NO_CONTRACT_BODY
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float turned = i < half ? -as_float(x[i + half]) : as_float(x[i - half]);
    const T straight = static_cast<T>(as_float(x[i]) * as_float(cos[i]));
    const T crossed = static_cast<T>(turned * as_float(sin[i]));
    out[i] = static_cast<T>(as_float(straight) + as_float(crossed));
  }
}

// Every [batch, head, position] row of x ([B, H, S, D], any strides with the last dimension dense) rotated by
// cos/sin ([B or 1, S, D], the same); the result has x's layout.
template <class T>
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor out = at::empty_like(x);
  const int64_t batches = x.size(0), heads = x.size(1), positions = x.size(2), d = x.size(3);
  const T* xs = x.data_ptr<T>();
  const T* cs = cos.data_ptr<T>();
  const T* ss = sin.data_ptr<T>();
  T* os = out.data_ptr<T>();
  for (int64_t b = 0; b < batches; ++b) {
    const int64_t angle_batch = cos.size(0) == 1 ? 0 : b;
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t p = 0; p < positions; ++p) {
        const int64_t at = b * x.stride(0) + h * x.stride(1) + p * x.stride(2);
        const int64_t to = b * out.stride(0) + h * out.stride(1) + p * out.stride(2);
        rotate_row(xs + at, cs + angle_batch * cos.stride(0) + p * cos.stride(1),
                   ss + angle_batch * sin.stride(0) + p * sin.stride(1), os + to, d);
      }
  }
  return out;
}

void check_angles(const at::Tensor& x, const at::Tensor& angles, const char* name) {
  TORCH_CHECK(angles.dim() == 3 && (angles.size(0) == 1 || angles.size(0) == x.size(0)) &&
                  angles.size(1) == x.size(2) && angles.size(2) == x.size(3) && angles.stride(2) == 1,
              "rotary_embedding: ", name, " must be [batch or 1, positions, head_dim] with a dense last dimension");
  TORCH_CHECK(angles.scalar_type() == x.scalar_type() && angles.device().is_cpu(), "rotary_embedding: ", name,
              " must be a CPU tensor of the query's dtype");
}

at::Tensor rotate_any(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return x.scalar_type() == at::kFloat ? rotate<float>(x, cos, sin) : rotate<c10::BFloat16>(x, cos, sin);
}

// transformers' apply_rotary_pos_emb(q, k, cos, sin) for q [B, H, S, D], k [B, Hkv, S, D], cos and sin [B | 1, S, D].
std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                    const at::Tensor& sin) {
  for (const at::Tensor* x : {&q, &k})
    TORCH_CHECK(x->device().is_cpu() && x->dim() == 4 && x->size(3) % 2 == 0 && x->stride(3) == 1 &&
                    x->scalar_type() == q.scalar_type() &&
                    (x->scalar_type() == at::kFloat || x->scalar_type() == at::kBFloat16),
                "rotary_embedding: q and k must be float32 or bfloat16 CPU tensors [batch, heads, positions, "
                "head_dim] of one dtype, head_dim even and dense");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.size(3) == q.size(3),
              "rotary_embedding: q and k must have the same batch, positions and head_dim");
  check_angles(q, cos, "cos");
  check_angles(q, sin, "sin");
  return {rotate_any(q, cos, sin), rotate_any(k, cos, sin)};
}

}  // namespace

#define HF_TIDAR_ROTARY_FRAGMENT(name, m) TORCH_LIBRARY_FRAGMENT(name, m)
HF_TIDAR_ROTARY_FRAGMENT(HF_TIDAR_KERNEL_LIBRARY, m) {
  m.def("rotary_embedding(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)", &rotary_embedding);
}
