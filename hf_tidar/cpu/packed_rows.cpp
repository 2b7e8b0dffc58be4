// The few-row float32 matmul on weights packed by columns, for the AVX-512 builds (built with few_rows.cpp).
//
// few_rows.cpp keeps nn.Linear's [N, K] layout: a tile of 3 weight rows is one dot product per output, and a
// 12-row pass goes over it in three row tiles. Its arithmetic and its memory traffic then hardly overlap: on a
// Zen 4 CPU one SmolLM2 layer cost 816 µs at 12 rows against 488 at one row. Here the weight is packed once
// (pack_columns) as [N/16][K][16]: the 16 outputs of a column block lie side by side at every k, so a row tile
// broadcasts x[i, k] and multiply-adds it into 16 outputs at once (outer products, as oneDNN does), and all
// rows of a pass (up to 12) share one sweep over the block: every weight byte is read once, in a few
// contiguous streams the hardware prefetchers follow. Measured on that CPU (benchmarks/kernel_rows.py --packed,
// LoRA tails as in a pass): one layer 488 -> 442 µs at one row, 566 -> 494 at 8, 816 -> 617 at 12.
//
// Each output lane sums x[i, k] * w[n, k] for k = 0, 1, ..., K - 1 in that order, then adds the bias: the
// order depends only on K, never on M or on which rows share a tile, so a row's result is bit for bit the same
// in a one-row AR step and in a many-row TiDAR pass (not the same bits as few_rows.cpp's, which sums 16 lanes
// and then reduces them).
//
// LoRA on a tail of the rows (the gated adapter's [MASK] rows): lora_a and lora_b are packed the same way
// (lora_b may stay float16, widened exactly at each step, which halves its stream next to every weight); the tail
// rows' codes z = x @ lora_aᵀ come first, then each tail row's accumulators continue with z @ lora_bᵀ after its
// K terms.

#ifdef __AVX512F__

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#ifndef HF_TIDAR_KERNEL_LIBRARY
#define HF_TIDAR_KERNEL_LIBRARY hf_tidar_cpu
#endif

namespace {

constexpr int kLanes = 16;  // float32 lanes of a 512-bit vector: the width of a packed column block
constexpr int kMaxTileRows = 12;
// Each step of a tile reads one 64-byte line of every column block it sweeps; the line kPrefetchSteps steps
// ahead is asked into L2 (prefetcht1) meanwhile. The hardware prefetchers alone left the streams short of the
// multiply-adds: on a Zen 4 CPU, SmolLM2 layers 4-8% faster at 1-16 rows (8 lines ahead; 4-24 lines and the
// L1 hint within a few percent of it; benchmarks/packed_variants.py, the variants interleaved in one process).
constexpr int64_t kPrefetchSteps = 8;

// w [N, K] as [ceil(N / 16), K, 16] of its own dtype (float32 or float16), zeros past N.
template <class T>
void pack_into(const T* s, int64_t N, int64_t K, T* d) {
  const int64_t blocks = (N + kLanes - 1) / kLanes;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t lane = 0; lane < kLanes && b * kLanes + lane < N; ++lane) {
        const T* row = s + (b * kLanes + lane) * K;
        T* out = d + b * K * kLanes + lane;
        for (int64_t k = 0; k < K; ++k) out[k * kLanes] = row[k];
      }
  });
}

at::Tensor pack_columns(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu() && w.is_contiguous() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kHalf),
              "pack_columns: weight must be a contiguous [N, K] float32 or float16 CPU tensor");
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor packed = at::zeros({(N + kLanes - 1) / kLanes, K, kLanes}, w.options());
  if (w.scalar_type() == at::kFloat)
    pack_into(w.data_ptr<float>(), N, K, packed.data_ptr<float>());
  else
    pack_into(w.data_ptr<c10::Half>(), N, K, packed.data_ptr<c10::Half>());
  return packed;
}

// A step of a packed lora_b block: 16 float32 lanes, or 16 float16 lanes widened exactly.
inline __m512 load_lanes(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_lanes(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One tile: MR rows of x (stride ldx) against NV packed column blocks (each K x 16, `block` floats apart);
// rows from `first` on also get z (their codes, stride R) against NV packed lora_b blocks (R x 16 each).
// Writes `valid` outputs of each row (fewer than NV * 16 at the end of N), plus the bias.
template <int MR, int NV, class B>
inline void packed_tile(const float* x, int64_t ldx, int64_t K, const float* w, int64_t block, const float* z,
                        int64_t R, const B* b, int first, const float* bias, float* y, int64_t ldy,
                        int64_t valid) {
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[NV];
    for (int v = 0; v < NV; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(w + v * block + (k + kPrefetchSteps) * kLanes), _MM_HINT_T1);
      wv[v] = _mm512_loadu_ps(w + v * block + k * kLanes);
    }
    for (int i = 0; i < MR; ++i) {  // constant trip counts keep every accumulator in a register
      const __m512 a = _mm512_set1_ps(x[i * ldx + k]);
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(a, wv[v], acc[i][v]);
    }
  }
  if (z) {
    for (int64_t r = 0; r < R; ++r) {
      __m512 bv[NV];
      for (int v = 0; v < NV; ++v) bv[v] = load_lanes(b + v * R * kLanes + r * kLanes);
      for (int i = 0; i < MR; ++i) {
        if (i < first) continue;
        const __m512 a = _mm512_set1_ps(z[(i - first) * R + r]);
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(a, bv[v], acc[i][v]);
      }
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t left = valid - v * kLanes;
    if (left <= 0) break;
    const __mmask16 keep = left >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512 bias_v = bias ? _mm512_maskz_loadu_ps(keep, bias + v * kLanes) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i)
      _mm512_mask_storeu_ps(y + i * ldy + v * kLanes, keep, bias ? _mm512_add_ps(acc[i][v], bias_v) : acc[i][v]);
  }
}

// Column blocks per tile for a row tile of MR rows: as many as the 32 vector registers hold (MR x NV
// accumulators, NV weight vectors and one broadcast), and at least 8 independent accumulators for one row.
template <int MR>
constexpr int columns_for() {
  return MR == 1 ? 8 : MR <= 3 ? 6 : MR <= 6 ? 4 : MR <= 8 ? 3 : 2;
}

template <class B>
struct Product {
  const float* x;  // [M, K]
  int64_t M, K;
  const float* w;  // packed [blocks, K, 16]
  int64_t N;
  const float* bias;
  const float* z;  // the tail rows' codes [M - tail, R], or null
  const B* b;      // packed lora_b [blocks, R, 16], float32 or float16
  int64_t R, tail;
  float* y;  // [M, N]
};

// Rows m..m+MR-1 of `p` against column blocks [first_block, last_block), NV at a time.
template <int MR, class B>
void row_tile(const Product<B>& p, int64_t m, int64_t first_block, int64_t last_block) {
  constexpr int NV = columns_for<MR>();
  const int first = p.z ? int(std::clamp<int64_t>(p.tail - m, 0, MR)) : MR;
  const float* codes = p.z && first < MR ? p.z + (m + first - p.tail) * p.R : nullptr;
  for (int64_t blk = first_block; blk < last_block;) {
    const int64_t n = blk * kLanes;
    const float* w = p.w + blk * p.K * kLanes;
    const B* b = codes ? p.b + blk * p.R * kLanes : nullptr;
    const float* bias = p.bias ? p.bias + n : nullptr;
    if (last_block - blk >= NV) {
      packed_tile<MR, NV>(p.x + m * p.K, p.K, p.K, w, p.K * kLanes, codes, p.R, b, first, bias, p.y + m * p.N + n,
                          p.N, p.N - n);
      blk += NV;
    } else {
      packed_tile<MR, 1>(p.x + m * p.K, p.K, p.K, w, p.K * kLanes, codes, p.R, b, first, bias, p.y + m * p.N + n,
                         p.N, p.N - n);
      blk += 1;
    }
  }
}

// All rows of `p` against column blocks [b0, b1): row tiles of near-equal height, at most kMaxTileRows.
template <class B>
void rows_times_blocks(const Product<B>& p, int64_t b0, int64_t b1) {
  const int64_t tiles = (p.M + kMaxTileRows - 1) / kMaxTileRows;
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t height = p.M / tiles + (t < p.M % tiles ? 1 : 0);
    switch (height) {
      case 12: row_tile<12>(p, m, b0, b1); break;
      case 11: row_tile<11>(p, m, b0, b1); break;
      case 10: row_tile<10>(p, m, b0, b1); break;
      case 9: row_tile<9>(p, m, b0, b1); break;
      case 8: row_tile<8>(p, m, b0, b1); break;
      case 7: row_tile<7>(p, m, b0, b1); break;
      case 6: row_tile<6>(p, m, b0, b1); break;
      case 5: row_tile<5>(p, m, b0, b1); break;
      case 4: row_tile<4>(p, m, b0, b1); break;
      case 3: row_tile<3>(p, m, b0, b1); break;
      case 2: row_tile<2>(p, m, b0, b1); break;
      default: row_tile<1>(p, m, b0, b1); break;
    }
    m += height;
  }
}

void check_packed(const at::Tensor& t, const char* name, int64_t blocks, int64_t K, bool half_too = false) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || (half_too && t.scalar_type() == at::kHalf)) &&
                  t.is_contiguous() && t.dim() == 3 && t.size(0) == blocks && t.size(1) == K && t.size(2) == kLanes,
              "packed_row_linear: ", name, " must be a contiguous ", half_too ? "float32 or float16" : "float32",
              " CPU tensor of pack_columns' layout [", blocks, ", ", K, ", 16]");
}

template <class B>
void run_product(const Product<B>& product, int64_t blocks) {
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) { rows_times_blocks(product, b0, b1); });
}

// y = x @ wᵀ (+ bias) from w packed by pack_columns; rows from tail_start on plus (x @ lora_aᵀ) @ lora_bᵀ,
// with lora_a [R, K] (float32) and lora_b [N, R] (float32 or float16: its stream halved) packed the same way.
at::Tensor packed_row_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                             const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& lora_a,
                             const std::optional<at::Tensor>& lora_b, int64_t tail_start) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "packed_row_linear: x must be a contiguous [M, K] float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), blocks = (N + kLanes - 1) / kLanes;
  TORCH_CHECK(N > 0, "packed_row_linear: N must be positive");
  check_packed(packed, "weight", blocks, K);
  const float* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "packed_row_linear: bias must be N contiguous float32 values");
    bias_data = bias->data_ptr<float>();
  }
  const int64_t tail = std::clamp<int64_t>(tail_start, 0, M);
  std::vector<float> z;
  int64_t R = 0;
  if (lora_a.has_value() && tail < M) {
    TORCH_CHECK(lora_b.has_value(), "packed_row_linear: lora_a needs lora_b");
    R = lora_b->dim() == 3 ? lora_b->size(1) : 0;
    check_packed(*lora_b, "lora_b", blocks, R, /*half_too=*/true);
    check_packed(*lora_a, "lora_a", (R + kLanes - 1) / kLanes, K);
    z.resize((M - tail) * R);  // the codes: a product of its own, too small to share among threads
    const Product<float> codes{x.data_ptr<float>() + tail * K, M - tail, K, lora_a->data_ptr<float>(), R, nullptr,
                               nullptr, nullptr, 0, M - tail, z.data()};
    rows_times_blocks(codes, 0, (R + kLanes - 1) / kLanes);
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* x_data = x.data_ptr<float>();
  const float* codes = z.empty() ? nullptr : z.data();
  if (R && lora_b->scalar_type() == at::kHalf)
    run_product(Product<c10::Half>{x_data, M, K, packed.data_ptr<float>(), N, bias_data, codes,
                                   lora_b->data_ptr<c10::Half>(), R, tail, y.data_ptr<float>()}, blocks);
  else
    run_product(Product<float>{x_data, M, K, packed.data_ptr<float>(), N, bias_data, codes,
                               R ? lora_b->data_ptr<float>() : nullptr, R, tail, y.data_ptr<float>()}, blocks);
  return y;
}

}  // namespace

#define HF_TIDAR_PACKED_FRAGMENT(name, m) TORCH_LIBRARY_FRAGMENT(name, m)
HF_TIDAR_PACKED_FRAGMENT(HF_TIDAR_KERNEL_LIBRARY, m) {
  m.def("pack_columns(Tensor weight) -> Tensor", &pack_columns);
  m.def("packed_row_linear(Tensor x, Tensor packed, int N, Tensor? bias, Tensor? lora_a, Tensor? lora_b, "
        "int tail_start) -> Tensor",
        &packed_row_linear);
}

#endif  // __AVX512F__
