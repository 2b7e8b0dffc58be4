// A float32 matmul for the few rows of a decode step on AVX2 + FMA CPUs, with an optional LoRA update
// on a tail of the rows (the gated adapter's [MASK] rows), built by hf_tidar/cpu/kernel.py.
//
// y = x @ weightᵀ (+ bias), x [M, K] with M small (1-32), weight [N, K] in nn.Linear's own layout.
// torch's BLAS paths are tuned for large M: for M = 2-16 they either re-read the weight per row or take
// a slow packing path, where a decode step should stream each weight from memory once. Here every
// thread takes a slice of the output columns; a tile of NR weight rows stays in L1 while all M input
// rows go past it, so each weight byte is read from memory once whatever M is.
//
// Each output element is one dot product whose summation order depends only on K, never on M or on the
// other rows: a row's result is bit for bit the same in a one-row AR step and in a many-row TiDAR pass.
//
// With lora_a [R, K] and lora_bt [R, N] (scale·Bᵀ), rows from tail_start on also get
// (x @ lora_aᵀ) @ lora_bt, added in place after the base product.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace {

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// MR input rows against NR weight rows: MR * NR accumulators, K in steps of 8, then a scalar tail.
// Prefetches [next, end) two cache lines per step: the weight rows the next tile will need are on their
// way from memory while this tile computes (the hardware prefetcher alone leaves the two apart).
template <int MR, int NR>
inline void dot_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
                     int64_t K, const float* bias, const char*& next, const char* end) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (next < end) {
      _mm_prefetch(next, _MM_HINT_T0);
      _mm_prefetch(next + 64, _MM_HINT_T0);
      next += 128;
    }
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * ldw + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = horizontal_sum(acc[i][j]);
      for (int64_t kk = k; kk < K; ++kk) s += x[i * ldx + kk] * w[j * ldw + kk];
      y[i * ldy + j] = bias ? s + bias[j] : s;
    }
}

constexpr int kRows = 4;     // MR: 4 x 3 accumulators + 3 weight vectors + 1 input vector = 16 registers
constexpr int kColumns = 3;  // NR

// All M rows of x against weight rows [0, NR) of w (y and bias already offset to the first column).
// [next, end): the next column block's weight rows, to prefetch while this one computes.
template <int NR>
inline void column_block(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N,
                         const float* bias, const char* next, const char* end) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows)
    dot_tile<kRows, NR>(x + m * K, K, w, K, y + m * N, N, K, bias, next, end);
  switch (M - m) {
    case 3: dot_tile<3, NR>(x + m * K, K, w, K, y + m * N, N, K, bias, next, end); break;
    case 2: dot_tile<2, NR>(x + m * K, K, w, K, y + m * N, N, K, bias, next, end); break;
    case 1: dot_tile<1, NR>(x + m * K, K, w, K, y + m * N, N, K, bias, next, end); break;
    default: break;
  }
}

// y[:M] (+)= x[:M] @ wᵀ for w [N, K], over column blocks in parallel.
void rows_times_weight(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y,
                       const float* bias, bool parallel) {
  const int64_t blocks = (N + kColumns - 1) / kColumns;
  auto run = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kColumns;
      const float* bn = bias ? bias + n : nullptr;
      const char* next = reinterpret_cast<const char*>(w + std::min<int64_t>(n + kColumns, N) * K);
      const char* end = reinterpret_cast<const char*>(w + std::min<int64_t>(n + 2 * kColumns, N) * K);
      if (b + 1 >= b1) end = next;  // the next block belongs to the other thread
      switch (std::min<int64_t>(kColumns, N - n)) {
        case kColumns: column_block<kColumns>(x, M, K, w + n * K, y + n, N, bn, next, end); break;
        case 2: column_block<2>(x, M, K, w + n * K, y + n, N, bn, next, end); break;
        default: column_block<1>(x, M, K, w + n * K, y + n, N, bn, next, end); break;
      }
    }
  };
  if (parallel) at::parallel_for(0, blocks, 8, run);
  else run(0, blocks);
}

// y[m, :] += z[m, :] @ bt for m < M, z [M, R], bt [R, N]: broadcast-FMA over 8 output columns at a time.
void add_low_rank(const float* z, int64_t M, int64_t R, const float* bt, int64_t N, float* y, int64_t ldy) {
  const int64_t chunks = (N + 7) / 8;
  at::parallel_for(0, chunks, 16, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n = c * 8;
      if (n + 8 <= N) {
        for (int64_t m = 0; m < M; ++m) {
          __m256 acc = _mm256_loadu_ps(y + m * ldy + n);
          for (int64_t r = 0; r < R; ++r)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(z[m * R + r]), _mm256_loadu_ps(bt + r * N + n), acc);
          _mm256_storeu_ps(y + m * ldy + n, acc);
        }
      } else {
        for (int64_t m = 0; m < M; ++m)
          for (int64_t nn = n; nn < N; ++nn) {
            float s = y[m * ldy + nn];
            for (int64_t r = 0; r < R; ++r) s += z[m * R + r] * bt[r * N + nn];
            y[m * ldy + nn] = s;
          }
      }
    }
  });
}

void check_matrix(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "few_row_linear: ", name, " must be a contiguous float32 CPU tensor");
}

at::Tensor few_row_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_bt,
                          int64_t tail_start) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "few_row_linear: x must be [M, K] and weight [N, K]");
  check_matrix(x, "x");
  check_matrix(weight, "weight");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const float* bias_data = nullptr;
  if (bias.has_value()) {
    check_matrix(*bias, "bias");
    TORCH_CHECK(bias->numel() == N, "few_row_linear: bias must have N elements");
    bias_data = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  rows_times_weight(x.data_ptr<float>(), M, K, weight.data_ptr<float>(), N, y.data_ptr<float>(), bias_data, true);
  if (lora_a.has_value() && tail_start < M) {
    TORCH_CHECK(lora_bt.has_value(), "few_row_linear: lora_a needs lora_bt");
    check_matrix(*lora_a, "lora_a");
    check_matrix(*lora_bt, "lora_bt");
    const int64_t R = lora_a->size(0), tail = M - std::max<int64_t>(tail_start, 0);
    TORCH_CHECK(lora_a->dim() == 2 && lora_a->size(1) == K && lora_bt->dim() == 2 && lora_bt->size(0) == R &&
                    lora_bt->size(1) == N,
                "few_row_linear: lora_a must be [R, K] and lora_bt [R, N]");
    const float* x_tail = x.data_ptr<float>() + (M - tail) * K;
    std::vector<float> z(tail * R);
    rows_times_weight(x_tail, tail, K, lora_a->data_ptr<float>(), R, z.data(), nullptr, false);
    add_low_rank(z.data(), tail, R, lora_bt->data_ptr<float>(), N, y.data_ptr<float>() + (M - tail) * N, N);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(hf_tidar_cpu, m) {
  m.def("few_row_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? lora_a, Tensor? lora_bt, int tail_start)"
        " -> Tensor",
        &few_row_linear);
}
