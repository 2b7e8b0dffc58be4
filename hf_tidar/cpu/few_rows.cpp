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
// With lora_a [R, K] and lora_b [N, R] (scale·B, nn.Linear's layout), rows from tail_start on also get
// (x @ lora_aᵀ) @ lora_bᵀ, summed into the same dot products (see dot_tile).

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

// One segment of a dot product: MR rows of a (stride lda) against NR rows of b (stride ldb), length n.
template <int MR, int NR>
inline int64_t dot_segment(__m256 (&acc)[MR][NR], const float* a, int64_t lda, const float* b, int64_t ldb,
                           int64_t n, const char*& next, const char* end) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    if (next < end) {  // the next tile's weight rows are on their way from memory while this tile computes
      _mm_prefetch(next, _MM_HINT_T0);
      _mm_prefetch(next + 64, _MM_HINT_T0);
      next += 128;
    }
    __m256 bv[NR];
    for (int j = 0; j < NR; ++j) bv[j] = _mm256_loadu_ps(b + j * ldb + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 av = _mm256_loadu_ps(a + i * lda + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(av, bv[j], acc[i][j]);
    }
  }
  return k;  // where the scalar remainder starts
}

// y[i, j] = x_i · w_j (+ z_i · b_j for a LoRA tail) (+ bias_j) for an MR x NR tile. The LoRA segment extends
// the same accumulators (a tail row is [x | z] against [w | b]), so the update costs R / K more work and
// streams b, in nn.Linear's [N, R] layout, next to w.
template <int MR, int NR>
inline void dot_tile(const float* x, int64_t K, const float* w, const float* z, const float* b, int64_t R,
                     float* y, int64_t ldy, const float* bias, const char*& next, const char* end) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t k = dot_segment<MR, NR>(acc, x, K, w, K, K, next, end);
  const int64_t r = z ? dot_segment<MR, NR>(acc, z, R, b, R, R, next, end) : 0;
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = horizontal_sum(acc[i][j]);
      for (int64_t kk = k; kk < K; ++kk) s += x[i * K + kk] * w[j * K + kk];
      if (z)
        for (int64_t rr = r; rr < R; ++rr) s += z[i * R + rr] * b[j * R + rr];
      y[i * ldy + j] = bias ? s + bias[j] : s;
    }
}

constexpr int kRows = 4;     // MR: 4 x 3 accumulators + 3 weight vectors + 1 input vector = 16 registers
constexpr int kColumns = 3;  // NR

// Rows [m0, m1) of x (and of z, which starts at row m0) against NR weight rows: tiles of kRows, then the rest.
template <int NR>
inline void row_range(const float* x, int64_t m0, int64_t m1, int64_t K, const float* w, const float* z,
                      const float* b, int64_t R, float* y, int64_t N, const float* bias, const char*& next,
                      const char* end) {
  auto z_at = [&](int64_t m) { return z ? z + (m - m0) * R : nullptr; };
  int64_t m = m0;
  for (; m + kRows <= m1; m += kRows)
    dot_tile<kRows, NR>(x + m * K, K, w, z_at(m), b, R, y + m * N, N, bias, next, end);
  switch (m1 - m) {
    case 3: dot_tile<3, NR>(x + m * K, K, w, z_at(m), b, R, y + m * N, N, bias, next, end); break;
    case 2: dot_tile<2, NR>(x + m * K, K, w, z_at(m), b, R, y + m * N, N, bias, next, end); break;
    case 1: dot_tile<1, NR>(x + m * K, K, w, z_at(m), b, R, y + m * N, N, bias, next, end); break;
    default: break;
  }
}

// One column block of NR weight rows: the rows before the tail as a plain product, the tail with its LoRA
// segment (no tile mixes the two, so a clean row's result never depends on the tail).
template <int NR>
inline void column_block(const float* x, int64_t M, int64_t K, const float* w, const float* z, const float* b,
                         int64_t R, int64_t tail, float* y, int64_t N, const float* bias, const char* next,
                         const char* end) {
  row_range<NR>(x, 0, tail, K, w, nullptr, nullptr, 0, y, N, bias, next, end);
  row_range<NR>(x, tail, M, K, w, z, b, R, y, N, bias, next, end);
}

// y = x @ wᵀ (+ bias), rows from `tail` on plus z @ bᵀ (z: [M - tail, R], b: [N, R]; none if z is null).
void rows_times_weight(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y,
                       const float* bias, const float* z, const float* b, int64_t R, int64_t tail) {
  if (!z) tail = M;
  const int64_t blocks = (N + kColumns - 1) / kColumns;
  auto run = [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n = blk * kColumns;
      const float* bn = bias ? bias + n : nullptr;
      const float* lora = b ? b + n * R : nullptr;
      const char* next = reinterpret_cast<const char*>(w + std::min<int64_t>(n + kColumns, N) * K);
      const char* end = reinterpret_cast<const char*>(w + std::min<int64_t>(n + 2 * kColumns, N) * K);
      if (blk + 1 >= b1) end = next;  // the next block belongs to the other thread
      if (lora && blk + 1 < b1) {  // and the next block's LoRA rows (a few lines, missed otherwise)
        const char* lines = reinterpret_cast<const char*>(lora + kColumns * R);
        for (int64_t off = 0; off < kColumns * R * 4; off += 64) _mm_prefetch(lines + off, _MM_HINT_T0);
      }
      switch (std::min<int64_t>(kColumns, N - n)) {
        case kColumns: column_block<kColumns>(x, M, K, w + n * K, z, lora, R, tail, y + n, N, bn, next, end); break;
        case 2: column_block<2>(x, M, K, w + n * K, z, lora, R, tail, y + n, N, bn, next, end); break;
        default: column_block<1>(x, M, K, w + n * K, z, lora, R, tail, y + n, N, bn, next, end); break;
      }
    }
  };
  at::parallel_for(0, blocks, 8, run);
}

void check_matrix(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "few_row_linear: ", name, " must be a contiguous float32 CPU tensor");
}

at::Tensor few_row_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
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
  const int64_t tail = std::clamp<int64_t>(tail_start, 0, M);
  std::vector<float> z;
  const float* b_data = nullptr;
  int64_t R = 0;
  if (lora_a.has_value() && tail < M) {
    TORCH_CHECK(lora_b.has_value(), "few_row_linear: lora_a needs lora_b");
    check_matrix(*lora_a, "lora_a");
    check_matrix(*lora_b, "lora_b");
    R = lora_a->size(0);
    TORCH_CHECK(lora_a->dim() == 2 && lora_a->size(1) == K && lora_b->dim() == 2 && lora_b->size(0) == N &&
                    lora_b->size(1) == R,
                "few_row_linear: lora_a must be [R, K] and lora_b [N, R]");
    z.resize((M - tail) * R);  // the tail rows' low-rank codes x @ lora_aᵀ
    rows_times_weight(x.data_ptr<float>() + tail * K, M - tail, K, lora_a->data_ptr<float>(), R, z.data(),
                      nullptr, nullptr, nullptr, 0, M - tail);
    b_data = lora_b->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  rows_times_weight(x.data_ptr<float>(), M, K, weight.data_ptr<float>(), N, y.data_ptr<float>(), bias_data,
                    z.empty() ? nullptr : z.data(), b_data, R, tail);
  return y;
}

}  // namespace

TORCH_LIBRARY(hf_tidar_cpu, m) {
  m.def("few_row_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? lora_a, Tensor? lora_b, int tail_start)"
        " -> Tensor",
        &few_row_linear);
}
