// Llama's RMSNorm over the few rows of a decode step, in the few-row kernel's operator library.
//
// transformers computes it as seven small operators (to float32, pow, mean, add, rsqrt, mul, then the weight's mul
// after a cast back): 14-18 µs a call on a 2-core Zen 4 EPYC whatever the row count, 61 calls in every SmolLM2 step,
// about a thousandth of a second of a 20-30 ms step. One operator does it in a few µs.
//
// Each row: v = sum(x²) / D in float32, t = x * (1 / sqrt(v + eps)) rounded to the input's dtype, then weight * t
// rounded to it: transformers' operations and roundings in its order. The sum's own order differs from torch's
// reduction (16 lanes, then their sum), so a value may differ from transformers' in its last bit; it is the same for
// a row whatever the other rows of the call (a token gets the same bits in an AR step and in a TiDAR pass).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#ifndef HF_TIDAR_KERNEL_LIBRARY
#define HF_TIDAR_KERNEL_LIBRARY hf_tidar_cpu
#endif

namespace {

inline float as_float(float v) { return v; }
inline float as_float(c10::BFloat16 v) { return static_cast<float>(v); }

// The sum of squares of x[0, n) in float32: 16 lane sums (one 512-bit vector where the build has it), then theirs.
template <class T>
float sum_of_squares(const T* x, int64_t n) {
  float lanes[16] = {};
  int64_t i = 0;
#ifdef __AVX512F__
  if constexpr (std::is_same_v<T, float>) {
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));  // each square rounded, as torch's pow(2) then sum
    }
    _mm512_storeu_ps(lanes, acc);
  }
#endif
  for (; i + 16 <= n; i += 16)
    for (int lane = 0; lane < 16; ++lane) {
      const float v = as_float(x[i + lane]);
      lanes[lane] += v * v;
    }
  float total = 0.f;
  for (float lane : lanes) total += lane;
  for (; i < n; ++i) {
    const float v = as_float(x[i]);
    total += v * v;
  }
  return total;
}

template <class T>
void norm_rows(const T* x, const T* weight, T* y, int64_t rows, int64_t d, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * d;
    T* out = y + r * d;
    const float scale = 1.f / std::sqrt(sum_of_squares(row, d) / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) {
      const T t = static_cast<T>(as_float(row[i]) * scale);  // transformers casts back before the weight's mul
      out[i] = static_cast<T>(as_float(weight[i]) * as_float(t));
    }
  }
}

// y = weight * (x * rsqrt(mean(x², -1) + eps)) over the last dimension of a contiguous float32 or bfloat16 x.
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() >= 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rms_norm_rows: x must be a contiguous float32 or bfloat16 CPU tensor");
  const int64_t d = x.size(-1);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == d,
              "rms_norm_rows: weight must be ", d, " contiguous values of x's dtype");
  at::Tensor y = at::empty_like(x);
  const int64_t rows = d ? x.numel() / d : 0;
  if (x.scalar_type() == at::kFloat)
    norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), rows, d, static_cast<float>(eps));
  else
    norm_rows(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), rows, d,
              static_cast<float>(eps));
  return y;
}

}  // namespace

#define HF_TIDAR_RMS_NORM_FRAGMENT(name, m) TORCH_LIBRARY_FRAGMENT(name, m)
HF_TIDAR_RMS_NORM_FRAGMENT(HF_TIDAR_KERNEL_LIBRARY, m) {
  m.def("rms_norm_rows(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm_rows);
}
