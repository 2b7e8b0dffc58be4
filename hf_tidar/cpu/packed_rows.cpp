// The few-row float32 matmul on weights packed by columns, for the AVX-512 builds and, on two 8-lane registers a
// column block (lanes16.h), the AVX2 build (built with few_rows.cpp).
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
// LoRA on a tail of the rows (the gated adapter's [MASK] rows): the tail rows' codes z = x @ lora_aᵀ come first
// (lora_a packed by pack_codes, see tail_codes), then each tail row's accumulators continue with z @ lora_bᵀ after its
// K terms (lora_b packed as the weight; either factor may stay float16, widened exactly at each step, which halves
// its stream next to every weight).
//
// packed_row_linear_bf16_tail (the AVX-512 BF16 build) takes the tail rows in bfloat16 instead: they are drafts,
// which verification never trusts, and vdpbf16ps does two of their products per instruction (see mixed_tile).
//
// packed_pair_linear (the AVX-512 BF16 build) is the same sweep for bfloat16 weights (a bfloat16 model), packed
// by pack_column_pairs as [N/16][K/2][16][2] so that vdpbf16ps takes each output's pair of weights (see pair_tile).
//
// packed_gated_linear is a gated MLP's first half, silu(x @ gateᵀ) * (x @ upᵀ), from one sweep over both weights
// packed together (their column blocks interleaved), see gated_rows.

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "lanes16.h"
#include "vector_math.h"

#ifndef HF_TIDAR_KERNEL_LIBRARY
#define HF_TIDAR_KERNEL_LIBRARY hf_tidar_cpu
#endif

namespace {

using namespace hf_tidar_cpu;

constexpr int kLanes = 16;  // float32 lanes of a 512-bit vector (two 256-bit ones): the width of a packed column block
#ifdef __AVX512F__
constexpr int kMaxTileRows = 12;
#else
// AVX2 has 16 vector registers, and a column block takes two: a row tile holds at most 6 rows' accumulators, and a
// pass of more rows sweeps each block in several tiles (see chunk_blocks and ahead_of).
constexpr int kMaxTileRows = 6;
#endif
// Each step of a tile reads one 64-byte line of every column block it sweeps; the line kPrefetchSteps steps
// ahead is asked into L1 (prefetcht0) meanwhile. The hardware prefetchers alone left the streams short of the
// multiply-adds: on a Zen 4 CPU, SmolLM2 layers 4-8% faster at 1-16 rows (8 lines ahead into L2; 4-24 lines and
// the L1 hint within a few percent of it). The distance must cover the memory's latency in time, not in lines: a
// step of a 12-row tile takes 24 multiply-adds, so 8 steps ahead asked too late there. On a 2-core Intel Xeon with
// AMX, float32 layers at 8 / 12 / 16 rows 8.5% / 12% / 10% cheaper 64 lines ahead into L1 than 8 into L2, 1 row
// the same, bfloat16 pairs the same or cheaper (benchmarks/packed_variants.py, the variants interleaved in one
// process; 32-128 lines within a few percent of 64). Lines past a block's end are the next block's, or unmapped
// (a prefetch never faults).
// On a 2-core AMD EPYC with AVX2 only (Zen 3), into L2 (prefetcht1) rather than L1: four SmolLM2 layers at 8 / 12 / 20
// rows 6% / 5% / 7% cheaper, 1 row 2% (benchmarks/packed_variants.py, 20 rounds).
constexpr int64_t kPrefetchSteps = 64;
#ifdef __AVX512F__
constexpr auto kPrefetchHint = _MM_HINT_T0;
#else
constexpr auto kPrefetchHint = _MM_HINT_T1;
#endif

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
  const auto dtype = w.scalar_type();
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu() && w.is_contiguous() &&
                  (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16),
              "pack_columns: weight must be a contiguous [N, K] float32, float16 or bfloat16 CPU tensor");
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor packed = at::zeros({(N + kLanes - 1) / kLanes, K, kLanes}, w.options());
  if (dtype == at::kFloat)
    pack_into(w.data_ptr<float>(), N, K, packed.data_ptr<float>());
  else if (dtype == at::kHalf)
    pack_into(w.data_ptr<c10::Half>(), N, K, packed.data_ptr<c10::Half>());
  else
    pack_into(w.data_ptr<c10::BFloat16>(), N, K, packed.data_ptr<c10::BFloat16>());
  return packed;
}

// A step of a packed block: 16 float32 lanes, or 16 float16 lanes widened exactly (the LoRA factors), or 16 bfloat16
// lanes widened exactly (bfloat16 models' LoRA factors).
inline Lanes16 load_lanes(const float* p) { return lanes_load(p); }
inline Lanes16 load_lanes(const c10::Half* p) { return lanes_load_half(p); }
inline Lanes16 load_lanes(const c10::BFloat16* p) { return lanes_load_bfloat16(p); }

inline void store_lanes(float* y, Keep16 keep, Lanes16 v) { lanes_store_kept(y, keep, v); }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
inline void store_lanes(c10::BFloat16* y, __mmask16 keep, __m512 v) {  // rounded to nearest even, as torch's casts
  const __m256bh half = _mm512_cvtneps_pbh(v);
  _mm256_mask_storeu_epi16(y, keep, reinterpret_cast<const __m256i&>(half));
}
#endif

// Each tail row's LoRA update (rows from `first` on: their codes z, stride R, against NV packed lora_b blocks, R x 16
// each) added to its accumulators after the K terms of the product; then the bias, and `valid` outputs of each row
// stored (fewer than NV * 16 at the end of N; float32, or bfloat16 rounded to nearest even). With `z_odd` (a gated
// product's two factors, see packed_gated_linear), the blocks alternate factors: block v takes z where
// (parity + v) is even and z_odd where it is odd, each against its own lora_b rows.
template <int MR, int NV, class B, class Y>
inline void finish_tile(Lanes16 (&acc)[MR][NV], const float* z, int64_t R, const B* b, int first, const float* bias,
                        Y* y, int64_t ldy, int64_t valid, const float* z_odd = nullptr, int parity = 0) {
  if (z) {
    for (int64_t r = 0; r < R; ++r) {
      Lanes16 bv[NV];
      for (int v = 0; v < NV; ++v) bv[v] = load_lanes(b + v * R * kLanes + r * kLanes);
      for (int i = 0; i < MR; ++i) {
        if (i < first) continue;
        const Lanes16 a = lanes_set1(z[(i - first) * R + r]);
        if (!z_odd) {
          for (int v = 0; v < NV; ++v) acc[i][v] = lanes_fmadd(a, bv[v], acc[i][v]);
          continue;
        }
        const Lanes16 odd = lanes_set1(z_odd[(i - first) * R + r]);
        for (int v = 0; v < NV; ++v) acc[i][v] = lanes_fmadd((parity + v) & 1 ? odd : a, bv[v], acc[i][v]);
      }
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t left = valid - v * kLanes;
    if (left <= 0) break;
    const Keep16 keep = lanes_first(left);
    const Lanes16 bias_v = bias ? lanes_load_kept(bias + v * kLanes, keep) : lanes_zero();
    for (int i = 0; i < MR; ++i)
      store_lanes(y + i * ldy + v * kLanes, keep, bias ? lanes_add(acc[i][v], bias_v) : acc[i][v]);
  }
}

// One tile: MR rows of x (stride ldx) against NV packed column blocks (each K x 16, `block` elements apart; float32,
// or float16 widened exactly: a LoRA factor's codes); rows from `first` on also get z (their codes, stride R) against
// NV packed lora_b blocks (R x 16 each).
template <int MR, int NV, class B, class W>
inline void packed_tile(const float* x, int64_t ldx, int64_t K, const W* w, int64_t block, int64_t ahead,
                        const float* z, int64_t R, const B* b, int first, const float* bias, float* y, int64_t ldy,
                        int64_t valid, const float* z_odd = nullptr, int parity = 0) {
  Lanes16 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = lanes_zero();
  for (int64_t k = 0; k < K; ++k) {
    Lanes16 wv[NV];
    for (int v = 0; v < NV; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(w + v * block + k * kLanes + ahead), kPrefetchHint);
      wv[v] = load_lanes(w + v * block + k * kLanes);
    }
    for (int i = 0; i < MR; ++i) {  // constant trip counts keep every accumulator in a register
      const Lanes16 a = lanes_set1(x[i * ldx + k]);
      for (int v = 0; v < NV; ++v) acc[i][v] = lanes_fmadd(a, wv[v], acc[i][v]);
    }
  }
  finish_tile<MR, NV>(acc, z, R, b, first, bias, y, ldy, valid, z_odd, parity);
}

// Column blocks per tile for a row tile of MR rows: as many as the vector registers hold (MR x NV accumulators, NV
// weight vectors and one broadcast; 32 registers a block on AVX-512, 16 registers two a block on AVX2), and at least 8
// independent accumulators for one row.
template <int MR>
constexpr int columns_for() {
#ifdef __AVX512F__
  return MR == 1 ? 8 : MR <= 3 ? 6 : MR <= 6 ? 4 : MR <= 8 ? 3 : 2;
#else
  return MR == 1 ? 4 : MR == 2 ? 2 : 1;
#endif
}

// The same for pairs of bfloat16 (PairProduct), except that a 4-row tile takes 6 blocks (24 accumulators, 6 weight
// vectors, one broadcast: 31 registers). The wider sweep made SmolLM2 layers' 4-row bfloat16 products (a k = 2 pass
// with one group) 4% cheaper on a Zen 4 CPU, where the float32 ones got no cheaper (benchmarks/packed_variants.py).
template <int MR>
constexpr int pair_columns_for() {
  return MR == 4 ? 6 : columns_for<MR>();
}

// How far ahead of a tile's step its prefetch reads (elements): kPrefetchSteps steps. On AVX2, where a pass of more
// rows than one tile holds sweeps each block in several tiles one block at a time, the tiles ask for the next blocks
// (NV blocks on) at the step they are at instead: their arithmetic, from cache, then overlaps the next blocks' stream
// from memory rather than waiting for it. Four SmolLM2 layers on a 2-core Zen 3 EPYC against chunks of 12 blocks
// with the in-block prefetch (benchmarks/packed_variants.py, 20 rounds, µs): 8 rows 1053 -> 976, 12 rows 1109 -> 1084,
// 20 rows 1608 -> 1571.
inline int64_t ahead_of(int64_t M, int64_t K, int NV) {
#ifdef __AVX512F__
  (void)M, (void)K, (void)NV;
  return kPrefetchSteps * kLanes;
#else
  return M > kMaxTileRows ? NV * K * kLanes : kPrefetchSteps * kLanes;
#endif
}

template <class B, class W = float>
struct Product {
  const float* x;  // [M, K]
  int64_t M, K;
  const W* w;  // packed [blocks, K, 16]: float32 (a weight) or float16 (lora_a, for the codes)
  int64_t N;
  const float* bias;
  const float* z;  // the tail rows' codes [M - tail, R], or null
  const B* b;      // packed lora_b [blocks, R, 16], float32 or float16
  int64_t R, tail;
  float* y;  // [M, N]
  int64_t odd_codes = 0;  // a gated product's: where the odd blocks' codes start after z (see finish_tile)

  static constexpr int kTileRows = kMaxTileRows;  // the most rows a tile takes

  template <int MR>
  static constexpr int columns() { return columns_for<MR>(); }

  template <int MR>
  void start_rows() const {}  // what a row tile of MR rows needs first (nothing here; the AMX product's tiles)

  // Rows m..m+MR-1 against column blocks blk..blk+NV-1 (rows from `first` on with their codes).
  template <int MR, int NV>
  void tile(int64_t m, int64_t blk, const float* codes, int first) const {
    const int64_t n = blk * kLanes;
    packed_tile<MR, NV>(x + m * K, K, K, w + blk * K * kLanes, K * kLanes, ahead_of(M, K, NV), codes, R,
                        codes ? b + blk * R * kLanes : nullptr,
                        first, bias ? bias + n : nullptr, y + m * N + n, N, N - n,
                        codes && odd_codes ? codes + odd_codes : nullptr, int(blk & 1));
  }
};

// Rows m..m+MR-1 of `p` against column blocks [first_block, last_block), NV at a time.
template <int MR, class P>
void row_tile(const P& p, int64_t m, int64_t first_block, int64_t last_block) {
  constexpr int NV = P::template columns<MR>();
  const int first = p.z ? int(std::clamp<int64_t>(p.tail - m, 0, MR)) : MR;
  const float* codes = p.z && first < MR ? p.z + (m + first - p.tail) * p.R : nullptr;
  p.template start_rows<MR>();
  for (int64_t blk = first_block; blk < last_block;) {
    if (last_block - blk >= NV) {
      p.template tile<MR, NV>(m, blk, codes, first);
      blk += NV;
    } else {
      p.template tile<MR, 1>(m, blk, codes, first);
      blk += 1;
    }
  }
}

// f(m, std::integral_constant<int, height>) for the height H or below that equals `height` (1 if none does).
template <int H, class F>
inline void with_height(int64_t height, int64_t m, F& f) {
  if constexpr (H > 1) {
    if (height != H) return with_height<H - 1>(height, m, f);
  }
  f(m, std::integral_constant<int, H>{});
}

// Calls f(m, std::integral_constant<int, height>) for row tiles [m, m + height) of near-equal height, at most
// kMax (kMaxTileRows, or 16 for the tile unit's products), covering rows [from, to): a tile's height must be a
// constant for its accumulators to stay in registers.
template <int kMax = kMaxTileRows, class F>
void near_equal_tiles(int64_t from, int64_t to, F&& f) {
  static_assert(kMax >= 1 && kMax <= 16);
  const int64_t rows = to - from, tiles = (rows + kMax - 1) / kMax;
  for (int64_t t = 0, m = from; t < tiles; ++t) {
    const int64_t height = rows / tiles + (t < rows % tiles ? 1 : 0);
    with_height<kMax>(height, m, f);
    m += height;
  }
}

// The column blocks of a chunk, where several row tiles sweep the same blocks (more rows than one tile, or clean and
// draft rows in separate tiles): every tile takes the chunk in turn, so its blocks come from memory once and from L2
// for the later tiles (12 blocks of K <= 1024 take at most 768 KB) rather than from memory once per tile. Four
// SmolLM2 layers, cold weights, 2-core Zen 4 EPYC (benchmarks/packed_variants.py, µs a layer, each tile sweeping
// all blocks -> chunks): 13 rows 687 -> 649, 20 rows 918 -> 887, 32 rows 1337 -> 1284, 100 rows 3770 -> 3630.
// On AVX2 a pass of more than 6 rows sweeps every block in two or more row tiles, one block at a time (the later
// tiles read it from cache); see ahead_of.
inline int64_t chunk_blocks(int64_t K) {
#ifdef __AVX512F__
  return K <= 1024 ? 12 : 6;
#else
  (void)K;
  return 1;
#endif
}

// All rows of `p` against column blocks [b0, b1).
template <class P>
void rows_times_blocks(const P& p, int64_t b0, int64_t b1) {
  constexpr int kMax = P::kTileRows;
  if (p.M <= kMax) {
    near_equal_tiles<kMax>(0, p.M, [&](int64_t m, auto height) { row_tile<decltype(height)::value>(p, m, b0, b1); });
    return;
  }
  const int64_t chunk = chunk_blocks(p.K);
  for (int64_t c0 = b0; c0 < b1; c0 += chunk) {
    const int64_t c1 = std::min<int64_t>(b1, c0 + chunk);
    near_equal_tiles<kMax>(0, p.M, [&](int64_t m, auto height) { row_tile<decltype(height)::value>(p, m, c0, c1); });
  }
}

void check_packed(const char* op, const at::Tensor& t, const char* name, int64_t blocks, int64_t K,
                  bool half_too = false) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || (half_too && t.scalar_type() == at::kHalf)) &&
                  t.is_contiguous() && t.dim() == 3 && t.size(0) == blocks && t.size(1) == K && t.size(2) == kLanes,
              op, ": ", name, " must be a contiguous ", half_too ? "float32 or float16" : "float32",
              " CPU tensor of pack_columns' layout [", blocks, ", ", K, ", 16]");
}

template <class P>
void run_product(const P& product, int64_t blocks) {
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) { rows_times_blocks(product, b0, b1); });
}

inline void prefetch_bytes(const void* data, int64_t bytes) {
  for (int64_t offset = 0; offset < bytes; offset += 64)
    _mm_prefetch(reinterpret_cast<const char*>(data) + offset, _MM_HINT_T0);
}

// The LoRA codes z = x @ lora_aᵀ of a product's tail rows, computed on the calling thread before the product's threads
// start (they all need every code). Packed as a weight ([R/16, K, 16]), a rank-4 factor would fill 4 of a block's 16
// lanes: its stream 4 times the factor's size, and each code one chain of K dependent multiply-adds. pack_codes
// instead puts S = 16 / P consecutive k of each code side by side (P: the code count rounded up to a power of two,
// for up to 8 codes): lane r * S + s of vector t holds a[r, t * S + s], and a row's inputs
// x[t * S .. t * S + S - 1] are one broadcast of S floats. The factor streams P / 16 of the bytes, and each code sums
// S interleaved partial sums, added in order of s at the end: a row's codes depend on its own inputs alone. More
// than 8 codes: S = 1, 16 codes a block (pack_columns' layout).
inline int64_t code_group(int64_t codes) {
  if (codes > 8) return 1;
  int64_t lanes = 1;
  while (lanes < codes) lanes *= 2;
  return kLanes / lanes;
}

// pack_codes' layout of a rank-R factor over `units` inputs (k, or pairs of k for bfloat16): `group` inputs of each
// code side by side, `steps` vectors to a block of 16 codes, `blocks` blocks; rows are read `width` units wide.
struct CodeLayout {
  int64_t group, steps, width, blocks;
};

inline CodeLayout code_layout(int64_t R, int64_t units) {
  const int64_t group = code_group(R), steps = (units + group - 1) / group;
  return {group, steps, steps * group, (R + kLanes - 1) / kLanes};
}

template <class T>
void pack_codes_into(const T* s, int64_t R, int64_t K, int64_t group, int64_t steps, T* d) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < K; ++k)
      d[((r / kLanes) * steps + k / group) * kLanes + (r % kLanes) * group + k % group] = s[r * K + k];
}

// Rows [rows, K] of bfloat16 values as pairs (uint32: (v[2p], v[2p + 1])), `width` pairs a row, zeros past K.
void bfloat16_pairs_into(const c10::BFloat16* v, int64_t rows, int64_t K, int64_t width, uint32_t* out) {
  for (int64_t i = 0; i < rows; ++i) {
    uint32_t* row = out + i * width;
    std::fill(row, row + width, 0u);
    std::copy(v + i * K, v + (i + 1) * K, reinterpret_cast<c10::BFloat16*>(row));
  }
}

// a [R, K] as [ceil(R / 16), ceil(K / S), 16] of its own dtype, S = code_group(R), zeros elsewhere; bfloat16 as pairs
// of k ([ceil(R / 16), ceil(K / 2S), 16, 2]: lane r * S + s of vector t holds the pair t * S + s, for vdpbf16ps).
at::Tensor pack_codes(const at::Tensor& a) {
  const auto dtype = a.scalar_type();
  TORCH_CHECK(a.dim() == 2 && a.device().is_cpu() && a.is_contiguous() &&
                  (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16),
              "pack_codes: lora_a must be a contiguous [R, K] float32, float16 or bfloat16 CPU tensor");
  const int64_t R = a.size(0), K = a.size(1);
  if (dtype == at::kBFloat16) {
    const int64_t pairs = (K + 1) / 2;
    const CodeLayout c = code_layout(R, pairs);
    std::vector<uint32_t> rows(R * pairs);
    bfloat16_pairs_into(a.data_ptr<c10::BFloat16>(), R, K, pairs, rows.data());
    at::Tensor packed = at::zeros({c.blocks, c.steps, kLanes, 2}, a.options());
    pack_codes_into(rows.data(), R, pairs, c.group, c.steps,
                    reinterpret_cast<uint32_t*>(packed.data_ptr<c10::BFloat16>()));
    return packed;
  }
  const CodeLayout c = code_layout(R, K);
  at::Tensor packed = at::zeros({c.blocks, c.steps, kLanes}, a.options());
  if (dtype == at::kFloat)
    pack_codes_into(a.data_ptr<float>(), R, K, c.group, c.steps, packed.data_ptr<float>());
  else
    pack_codes_into(a.data_ptr<c10::Half>(), R, K, c.group, c.steps, packed.data_ptr<c10::Half>());
  return packed;
}

// One step of a codes tile: the factor's vector, then a row's S inputs broadcast and multiply-added into acc. Float32
// rows (a float32 or float16 factor), or bfloat16 rows and factor as pairs of k (pack_codes' bfloat16 layout), where
// vdpbf16ps adds both products of a pair to each lane (exact products, float32 sums): two k a lane and instruction,
// read straight from the bfloat16 rows.
template <class A>
inline Lanes16 factor_step(const A* a) { return load_lanes(a); }
template <int S>
inline Lanes16 multiply_add(Lanes16 acc, const float* x, Lanes16 av) {
  return lanes_fmadd(lanes_repeat<S>(x), av, acc);
}
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
inline __m512i factor_step(const uint32_t* a) { return _mm512_loadu_si512(a); }
template <int S>
inline __m512 multiply_add(__m512 acc, const uint32_t* x, __m512i av) {
  __m512i xv;
  if constexpr (S == 1) {
    xv = _mm512_set1_epi32(static_cast<int>(*x));
  } else if constexpr (S == 2) {
    long long pairs;
    std::memcpy(&pairs, x, sizeof pairs);
    xv = _mm512_set1_epi64(pairs);
  } else if constexpr (S == 4) {
    xv = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  } else if constexpr (S == 8) {
    xv = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  } else {
    xv = _mm512_loadu_si512(x);
  }
  return _mm512_dpbf16_ps(acc, reinterpret_cast<const __m512bh&>(av), reinterpret_cast<const __m512bh&>(xv));
}
#endif

// Codes [MR, count] (stride ldz) of MR rows (stride ldx, zero-padded to steps * S) against one packed codes block.
// Each row sums even and odd steps apart (two chains of dependent multiply-adds, so that up to 4 rows keep 8 in flight).
template <int S, int MR, class X, class A>
void code_tile(const X* x, int64_t ldx, const A* a, int64_t steps, int64_t count, float* z, int64_t ldz) {
  Lanes16 even[MR], odd[MR];
  for (int i = 0; i < MR; ++i) even[i] = odd[i] = lanes_zero();
  int64_t t = 0;
  for (; t + 1 < steps; t += 2) {
    const auto av = factor_step(a + t * kLanes), next = factor_step(a + (t + 1) * kLanes);
    for (int i = 0; i < MR; ++i) {
      even[i] = multiply_add<S>(even[i], x + i * ldx + t * S, av);
      odd[i] = multiply_add<S>(odd[i], x + i * ldx + (t + 1) * S, next);
    }
  }
  if (t < steps) {
    const auto av = factor_step(a + t * kLanes);
    for (int i = 0; i < MR; ++i) even[i] = multiply_add<S>(even[i], x + i * ldx + t * S, av);
  }
  for (int i = 0; i < MR; ++i) {
    alignas(64) float lanes[kLanes];
    lanes_store(lanes, lanes_add(even[i], odd[i]));
    for (int64_t c = 0; c < count; ++c) {
      float sum = lanes[c * S];
      for (int s = 1; s < S; ++s) sum += lanes[c * S + s];
      z[i * ldz + c] = sum;
    }
  }
}

constexpr int kCodeTileRows = 4;  // rows sharing a codes tile

template <int S, class X, class A>
void code_rows(const X* x, int64_t T, int64_t ldx, const A* a, int64_t steps, int64_t count, float* z,
               int64_t ldz) {
  for (int64_t m = 0; m < T; m += kCodeTileRows) {
    const X* rows = x + m * ldx;
    float* out = z + m * ldz;
    switch (std::min<int64_t>(T - m, kCodeTileRows)) {
      case 4: code_tile<S, 4>(rows, ldx, a, steps, count, out, ldz); break;
      case 3: code_tile<S, 3>(rows, ldx, a, steps, count, out, ldz); break;
      case 2: code_tile<S, 2>(rows, ldx, a, steps, count, out, ldz); break;
      default: code_tile<S, 1>(rows, ldx, a, steps, count, out, ldz); break;
    }
  }
}

// lora_a: `factors` rank-R factors (2: a gated product's gate and up), each packed by pack_codes, one after the other.
void check_codes(const at::Tensor& a, const char* op, int64_t factors, int64_t R, int64_t K, bool bfloat16) {
  const CodeLayout c = code_layout(R, bfloat16 ? (K + 1) / 2 : K);
  const int64_t blocks = c.blocks, steps = c.steps;
  const auto dtype = a.scalar_type();
  TORCH_CHECK(a.device().is_cpu() && a.is_contiguous() && a.dim() == (bfloat16 ? 4 : 3) &&
                  a.size(0) == factors * blocks && a.size(1) == steps && a.size(2) == kLanes &&
                  (bfloat16 ? dtype == at::kBFloat16 && a.size(3) == 2 : dtype == at::kFloat || dtype == at::kHalf),
              op, ": lora_a must be a contiguous ", bfloat16 ? "bfloat16" : "float32 or float16", " CPU tensor: ",
              factors == 2 ? "gate's and up's factors each packed by pack_codes, concatenated, " : "pack_codes' layout ",
              "[", factors * blocks, ", ", steps, bfloat16 ? ", 16, 2]" : ", 16]");
}

// A thread's scratch floats (one buffer per `Slot`), kept from call to call. A fresh std::vector each call can cost a
// few µs of page faults (glibc may hand a freed arena top back to the system, and the next call touches new pages):
// timed inside a k = 4 SmolLM2 float32 pass, a product's codes took 2.4 µs with a fresh copy of their inputs, 1.3
// with this scratch (benchmarks/adapter_cost.py has the whole adapter's share).
template <int Slot, class T = float>
T* scratch(int64_t count) {
  thread_local std::vector<T> buffer;
  if (int64_t(buffer.size()) < count) buffer.resize(count);
  return buffer.data();
}

// The codes [factors][T, R] of T rows (`width` units a row: whole groups) against `factors` packed rank-R factors
// (`steps` vectors a block), into this thread's scratch.
template <class X, class A>
const float* all_codes(const X* rows, int64_t T, int64_t width, const A* a, int64_t factors, int64_t R,
                       int64_t steps) {
  const int64_t blocks = (R + kLanes - 1) / kLanes;
  float* z = scratch<1>(factors * T * R);
  for (int64_t f = 0; f < factors; ++f)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const A* block = a + (f * blocks + blk) * steps * kLanes;
      const int64_t count = std::min<int64_t>(kLanes, R - blk * kLanes);
      float* out = z + f * T * R + blk * kLanes;
      switch (code_group(R)) {
        case 16: code_rows<16>(rows, T, width, block, steps, count, out, R); break;
        case 8: code_rows<8>(rows, T, width, block, steps, count, out, R); break;
        case 4: code_rows<4>(rows, T, width, block, steps, count, out, R); break;
        case 2: code_rows<2>(rows, T, width, block, steps, count, out, R); break;
        default: code_rows<1>(rows, T, width, block, steps, count, out, R); break;
      }
    }
  return z;
}

// The codes of T float32 rows of x ([T, K]) against `factors` rank-R factors packed by pack_codes one after the other
// (checked by check_codes), into this thread's scratch (read by the product's threads during the call): [factors][T,
// R], each factor's codes as a product with it alone would give. A few KB of factor and a few thousand multiply-adds.
template <class A>
const float* tail_codes(const float* x, int64_t T, int64_t K, const A* a, int64_t factors, int64_t R) {
  const CodeLayout c = code_layout(R, K);
  prefetch_bytes(a, factors * c.blocks * c.steps * kLanes * int64_t(sizeof(A)));  // asked for before any copy of the rows
  const float* rows = x;
  if (c.width != K) {  // padded to whole groups: no broadcast reads past a row
    float* copy = scratch<0>(T * c.width);
    for (int64_t t = 0; t < T; ++t) {
      std::copy(x + t * K, x + (t + 1) * K, copy + t * c.width);
      std::fill(copy + t * c.width + K, copy + (t + 1) * c.width, 0.0f);
    }
    rows = copy;
  }
  return all_codes(rows, T, c.width, a, factors, R, c.steps);
}

// What both operators check and prepare: the bias, the tail's start and, with LoRA, the tail rows' codes z.
struct Prepared {
  int64_t M, K, blocks;
  const float* bias = nullptr;
  int64_t tail = 0, R = 0;
  const float* z = nullptr;  // the codes (the calling thread's scratch)
  // A gated product's: where up's codes start after gate's in z (the even blocks read gate's, the odd up's:
  // finish_tile's z and z_odd).
  int64_t odd_codes = 0;
};

// gated: lora_a holds two factors (gate's, then up's, each packed by pack_codes) and lora_b [N, R] alternates their
// 16-column blocks.
Prepared prepare(const char* op, const at::Tensor& x, const at::Tensor& packed, int64_t N,
                 const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& lora_a,
                 const std::optional<at::Tensor>& lora_b, int64_t tail_start, bool gated = false) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              op, ": x must be a contiguous [M, K] float32 CPU tensor");
  Prepared p{x.size(0), x.size(1), (N + kLanes - 1) / kLanes};
  TORCH_CHECK(N > 0, op, ": N must be positive");
  check_packed(op, packed, "weight", p.blocks, p.K);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                op, ": bias must be N contiguous float32 values");
    p.bias = bias->data_ptr<float>();
  }
  p.tail = std::clamp<int64_t>(tail_start, 0, p.M);
  if (lora_a.has_value() && p.tail < p.M) {
    TORCH_CHECK(lora_b.has_value(), op, ": lora_a needs lora_b");
    p.R = lora_b->dim() == 3 ? lora_b->size(1) : 0;
    const int64_t factors = gated ? 2 : 1;
    check_packed(op, *lora_b, "lora_b", p.blocks, p.R, /*half_too=*/true);
    check_codes(*lora_a, op, factors, p.R, p.K, /*bfloat16=*/false);
    const float* rows = x.data_ptr<float>() + p.tail * p.K;
    if (lora_a->scalar_type() == at::kHalf)  // an exact float16 factor: half its stream, the same products
      p.z = tail_codes(rows, p.M - p.tail, p.K, lora_a->data_ptr<c10::Half>(), factors, p.R);
    else
      p.z = tail_codes(rows, p.M - p.tail, p.K, lora_a->data_ptr<float>(), factors, p.R);
    if (gated) p.odd_codes = (p.M - p.tail) * p.R;
  }
  return p;
}

// Calls f with the packed lora_b's data as its own type (float16 or float32; a null float pointer without LoRA).
template <class F>
void with_lora_b(const Prepared& p, const std::optional<at::Tensor>& lora_b, F&& f) {
  if (p.R && lora_b->scalar_type() == at::kHalf)
    f(lora_b->data_ptr<c10::Half>());
  else
    f(p.R ? lora_b->data_ptr<float>() : static_cast<const float*>(nullptr));
}

template <class T>
using Element = std::remove_const_t<std::remove_pointer_t<T>>;

// The float32 product of a prepared call (every row float32).
at::Tensor float32_rows(const at::Tensor& x, const at::Tensor& packed, int64_t N, const Prepared& p,
                        const std::optional<at::Tensor>& lora_b) {
  at::Tensor y = at::empty({p.M, N}, x.options());
  if (p.M == 0) return y;
  const float* codes = p.z;
  with_lora_b(p, lora_b, [&](const auto* b) {
    run_product(Product<Element<decltype(b)>>{x.data_ptr<float>(), p.M, p.K, packed.data_ptr<float>(), N, p.bias,
                                              codes, b, p.R, p.tail, y.data_ptr<float>(), p.odd_codes}, p.blocks);
  });
  return y;
}

// y = x @ wᵀ (+ bias) from w packed by pack_columns; rows from tail_start on plus (x @ lora_aᵀ) @ lora_bᵀ,
// with lora_a [R, K] packed by pack_codes and lora_b [N, R] by pack_columns (each float32 or float16: its stream
// halved).
at::Tensor packed_row_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                             const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& lora_a,
                             const std::optional<at::Tensor>& lora_b, int64_t tail_start) {
  return float32_rows(x, packed, N, prepare("packed_row_linear", x, packed, N, bias, lora_a, lora_b, tail_start), lora_b);
}

// Logits whose top is exact (an LM head in greedy decoding: only each row's largest logit is read). y holds a row's
// logits computed from a cheaper copy of the weight, each within eps_v = relative * |x|_2 * |w_v|_2 + per_l1 *
// |x|_1 + floor of the float32 product (norms: |w_v|_2 rounded up, given; the caller derives the three terms from
// its copy's roundings). An output whose upper bound y_v + eps_v lies below the largest lower bound y_u - eps_u of
// the row cannot be its largest; every other one (the candidates, usually 1-10 of SmolLM2's 49152) is recomputed as
// packed_row_linear computes it (one fused multiply-add per k, in order of k, from zero: the same bits), and so are
// the `watched` outputs, which the lower bound does not count (a processor that removes them, as TiDAR's [MASK]
// suppression does, leaves the row's largest among the exact values). The other outputs keep their cheaper values,
// each certified below the row's exact largest.
void certify_top(const float* x, int64_t K, const float* weight, const float* norms, int64_t N,
                 const std::vector<int64_t>& watched, float* y, double relative, double per_l1, float floor) {
  double squares = 0, magnitudes = 0;
  for (int64_t k = 0; k < K; ++k) squares += double(x[k]) * x[k], magnitudes += std::abs(double(x[k]));
  // 1.001: room for the roundings of this bound's own float arithmetic.
  const float scale = float(1.001 * relative * std::sqrt(squares));
  const float flushed = float(1.001 * per_l1 * magnitudes) + floor;
  // The watched outputs leave the lower bound (set to -inf, they are no candidate) and are recomputed after.
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  for (int64_t id : watched) y[id] = kNone;
  float low = kNone;
  for (int64_t v = 0; v < N; ++v) low = std::max(low, y[v] - scale * norms[v] - flushed);
  auto exact = [&](int64_t v) {
    const float* w = weight + v * K;
    float acc = 0.0f;
    for (int64_t k = 0; k < K; ++k) acc = std::fma(x[k], w[k], acc);
    y[v] = acc;
  };
  for (int64_t v = 0; v < N; ++v)
    if (!(y[v] + scale * norms[v] + flushed < low)) exact(v);  // NaN: recomputed
  for (int64_t id : watched) exact(id);
}

// The arguments top_exact_linear and top_exact_linear_half check alike; returns the watched ids.
std::vector<int64_t> check_head(const char* op, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& norms,
                                const at::Tensor& watched) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              op, ": x must be a contiguous [M, K] float32 CPU tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(1) == x.size(1),
              op, ": weight must be a contiguous [N, K] float32 tensor");
  const int64_t N = weight.size(0);
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.numel() == N,
              op, ": norms must be N contiguous float32 values");
  TORCH_CHECK(watched.scalar_type() == at::kLong && watched.dim() == 1, op, ": watched must be int64 ids");
  std::vector<int64_t> ids(watched.data_ptr<int64_t>(), watched.data_ptr<int64_t>() + watched.numel());
  for (int64_t id : ids) TORCH_CHECK(id >= 0 && id < N, op, ": watched id ", id, " out of range");
  return ids;
}

// Certifies every row of y (see certify_top), the rows spread over the threads.
void certify_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& norms,
                  const std::vector<int64_t>& ids, at::Tensor& y, double relative, double per_l1, float floor) {
  const int64_t K = x.size(1), N = weight.size(0);
  at::parallel_for(0, x.size(0), 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      certify_top(x.data_ptr<float>() + m * K, K, weight.data_ptr<float>(), norms.data_ptr<float>(), N, ids,
                  y.data_ptr<float>() + m * N, relative, per_l1, floor);
  });
}

// top_exact_linear on every build: the logits from a float16 copy of the weight packed by pack_columns (half the
// bytes; F16C widens each step exactly), x and the sums in float32 as packed_row_linear's. Each product x[k] * w~[k]
// differs from x[k] * w[k] by the weight's rounding to nearest float16, at most 2^-11 |w[k]| for a normal float16
// and 2^-25 for a subnormal one, so by at most 2^-11 |x|_2 |w_v|_2 + 2^-25 |x|_1 in all (Cauchy-Schwarz); the two
// products' K fused multiply-adds, each rounded to nearest, add at most K * 2^-24 of the sum of magnitudes each
// (2.1 K * 2^-24 taken for both); K * 2^-120 covers the products' underflows. Weights of magnitude 65504 or more
// have no finite float16: the caller must not pack them (hf_tidar.cpu.top_exact_head checks).
at::Tensor top_exact_linear_half(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight,
                                 const at::Tensor& norms, const at::Tensor& watched) {
  const std::vector<int64_t> ids = check_head("top_exact_linear_half", x, weight, norms, watched);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), blocks = (N + kLanes - 1) / kLanes;
  check_packed("top_exact_linear_half", packed, "weight", blocks, K, /*half_too=*/true);
  TORCH_CHECK(packed.scalar_type() == at::kHalf, "top_exact_linear_half: packed must be the float16 weight packed "
              "by pack_columns");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  run_product(Product<float, c10::Half>{x.data_ptr<float>(), M, K, packed.data_ptr<c10::Half>(), N, nullptr, nullptr,
                                        nullptr, 0, M, y.data_ptr<float>()}, blocks);
  certify_rows(x, weight, norms, ids, y, 1.0 / 2048 + 2.1 * K / 16777216.0, 1.0 / 33554432.0,
               std::ldexp(float(K), -120));
  return y;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HF_TIDAR_PACKED_BF16 1

// Draft rows in bfloat16 (TiDAR's [MASK] rows, whose outputs verification never trusts). vdpbf16ps adds two
// products to each float32 lane, lane i += a[2i]·b[2i] + a[2i+1]·b[2i+1]: with the pair (x[k], x[k+1]) broadcast,
// the weights must hold (w[n, k], w[n, k+1]) side by side. The packed float32 blocks hold w[., k] and w[., k+1] as
// two lines; they are rounded to bfloat16 together (vcvtne2ps2bf16) and interleaved (vpermw) as they are read, so
// one instruction does the work of two fused multiply-adds for every draft row of the tile: the saving grows with
// the draft rows, the rounding and interleaving cost a fixed two instructions a step.
alignas(64) constexpr uint16_t kPairOrder[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// A tile of MC clean rows (float32, packed_tile's order: their bits) and MT draft rows sharing one sweep over NV
// column blocks (MC = 0: draft rows alone). xp holds each draft row's x rounded to bfloat16 as pairs (stride ldp
// pairs), xt the draft rows in float32 (an odd K's last term, stride K); the draft rows then get their LoRA update
// (codes z, and z_odd for a gated product's odd blocks: see finish_tile) in float32. Each step's two weight lines are
// loaded once, multiply-added into the clean rows as they are and, rounded and interleaved, into the draft rows.
template <int MC, int MT, int NV, class B>
inline void mixed_tile(const float* x, int64_t ldx, const uint32_t* xp, int64_t ldp, const float* xt, int64_t K,
                       const float* w, int64_t block, const float* z, int64_t R, const B* b, const float* bias,
                       float* y, int64_t ldy, int64_t valid, const float* z_odd = nullptr, int parity = 0) {
  constexpr int MR = MC + MT;
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  const __m512i order = _mm512_load_si512(kPairOrder);
  int64_t k = 0;
  for (; k + 1 < K; k += 2) {
    for (int v = 0; v < NV; ++v) {
      const float* line = w + v * block + k * kLanes;
      _mm_prefetch(reinterpret_cast<const char*>(line + kPrefetchSteps * kLanes), kPrefetchHint);
      _mm_prefetch(reinterpret_cast<const char*>(line + (kPrefetchSteps + 1) * kLanes), kPrefetchHint);
      const __m512 w0 = _mm512_loadu_ps(line), w1 = _mm512_loadu_ps(line + kLanes);
      for (int i = 0; i < MC; ++i)
        acc[i][v] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * ldx + k + 1]), w1,
                                    _mm512_fmadd_ps(_mm512_set1_ps(x[i * ldx + k]), w0, acc[i][v]));
      const __m512bh both = _mm512_cvtne2ps_pbh(w1, w0);
      const __m512i pairs = _mm512_permutexvar_epi16(order, reinterpret_cast<const __m512i&>(both));
      for (int i = 0; i < MT; ++i) {
        const __m512i a = _mm512_set1_epi32(static_cast<int>(xp[i * ldp + k / 2]));
        acc[MC + i][v] = _mm512_dpbf16_ps(acc[MC + i][v], reinterpret_cast<const __m512bh&>(pairs),
                                          reinterpret_cast<const __m512bh&>(a));
      }
    }
  }
  if (k < K) {  // an odd K's last term, in float32 for every row
    for (int v = 0; v < NV; ++v) {
      const __m512 wl = _mm512_loadu_ps(w + v * block + k * kLanes);
      for (int i = 0; i < MC; ++i) acc[i][v] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * ldx + k]), wl, acc[i][v]);
      for (int i = 0; i < MT; ++i)
        acc[MC + i][v] = _mm512_fmadd_ps(_mm512_set1_ps(xt[i * K + k]), wl, acc[MC + i][v]);
    }
  }
  finish_tile<MR, NV>(acc, z, R, b, MC, bias, y, ldy, valid, z_odd, parity);
}

// Column blocks per draft tile: MR x NV accumulators, NV interleaved weights, two lines being rounded, a broadcast.
template <int MR>
constexpr int bf16_columns_for() {
  return MR <= 3 ? 6 : MR <= 5 ? 4 : MR <= 8 ? 3 : 2;
}

template <class B>
struct DraftRows {
  const uint32_t* xp;  // [T, ldp] bfloat16 pairs of the draft rows
  int64_t ldp;
  const float* x;  // [T, K] the draft rows in float32 (an odd K's last term)
  int64_t T, K;
  const float* w;
  int64_t N;
  const float* bias;
  const float* z;  // [T, R] codes, or null
  const B* b;
  int64_t R;
  float* y;  // [T, N]
  int64_t odd_codes = 0;  // a gated product's: where the odd blocks' codes start after z (see finish_tile)
};

// Draft rows m..m+MT-1 of `d`, after the MC clean rows of `clean_x` (MC > 0 only with m = 0: the clean rows are the
// rows right before the drafts), against column blocks [first_block, last_block), NV at a time.
template <int MC, int MT, class B>
void mixed_row_tile(const float* clean_x, const DraftRows<B>& d, int64_t m, int64_t first_block, int64_t last_block) {
  constexpr int NV = MC ? columns_for<MC + MT>() : bf16_columns_for<MT>();
  const int64_t K = d.K, N = d.N;
  const float* codes = d.z ? d.z + m * d.R : nullptr;
  float* y = d.y + (m - MC) * N;  // rows are contiguous in y: the clean rows' outputs, then the draft rows'
  for (int64_t blk = first_block; blk < last_block;) {
    const int64_t n = blk * kLanes;
    const float* w = d.w + blk * K * kLanes;
    const B* b = codes ? d.b + blk * d.R * kLanes : nullptr;
    const float* bias = d.bias ? d.bias + n : nullptr;
    const float* odd = codes && d.odd_codes ? codes + d.odd_codes : nullptr;
    if (last_block - blk >= NV) {
      mixed_tile<MC, MT, NV>(clean_x, K, d.xp + m * d.ldp, d.ldp, d.x + m * K, K, w, K * kLanes, codes, d.R, b, bias,
                             y + n, N, N - n, odd, int(blk & 1));
      blk += NV;
    } else {
      mixed_tile<MC, MT, 1>(clean_x, K, d.xp + m * d.ldp, d.ldp, d.x + m * K, K, w, K * kLanes, codes, d.R, b, bias,
                            y + n, N, N - n, odd, int(blk & 1));
      blk += 1;
    }
  }
}

// Draft rows [from, to) of `d` against column blocks [b0, b1).
template <class B>
void bf16_rows_times_blocks(const DraftRows<B>& d, int64_t from, int64_t to, int64_t b0, int64_t b1) {
  near_equal_tiles(from, to, [&](int64_t m, auto height) {
    mixed_row_tile<0, decltype(height)::value>(nullptr, d, m, b0, b1);
  });
}

constexpr int kMaxMixedClean = 4;  // clean rows a mixed tile takes (a pass verifies k of them: k <= 4 here)

// mixed_row_tile<MC, height - MC> for a height known at run time (MC < height <= MR).
template <int MC, int MR, class B>
void mixed_row_tile_of(int64_t height, const Product<B>& clean, const DraftRows<B>& drafts, int64_t b0, int64_t b1) {
  if constexpr (MR > MC) {
    if (height == MR) return mixed_row_tile<MC, MR - MC>(clean.x, drafts, 0, b0, b1);
    mixed_row_tile_of<MC, MR - 1>(height, clean, drafts, b0, b1);
  }
}

template <class B>
void mixed_first_tile(int64_t height, const Product<B>& clean, const DraftRows<B>& drafts, int64_t b0, int64_t b1) {
  switch (clean.M) {
    case 1: mixed_row_tile_of<1, kMaxTileRows>(height, clean, drafts, b0, b1); break;
    case 2: mixed_row_tile_of<2, kMaxTileRows>(height, clean, drafts, b0, b1); break;
    case 3: mixed_row_tile_of<3, kMaxTileRows>(height, clean, drafts, b0, b1); break;
    default: mixed_row_tile_of<4, kMaxTileRows>(height, clean, drafts, b0, b1); break;
  }
}

// Rows of x rounded to bfloat16 (to nearest even), each padded to an even length and read as pairs.
std::vector<uint32_t> bfloat16_pairs(const float* x, int64_t rows, int64_t K) {
  const int64_t ldp = (K + 1) / 2;
  std::vector<uint32_t> pairs(rows * ldp, 0);
  for (int64_t i = 0; i < rows; ++i) {
    auto* out = reinterpret_cast<uint16_t*>(pairs.data() + i * ldp);
    for (int64_t k = 0; k < K; k += kLanes) {
      const __mmask16 keep = K - k >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
      const __m256bh half = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(keep, x + i * K + k));
      _mm256_mask_storeu_epi16(out + k, keep, reinterpret_cast<const __m256i&>(half));
    }
  }
  return pairs;
}

// Clean rows, then draft rows, against column blocks [b0, b1). The first row tile holds the clean rows (up to
// kMaxMixedClean of them) and the first draft rows in one sweep; where the clean rows do not fit one (a longer
// verification), clean and draft tiles sweep each chunk of blocks in turn.
template <class B>
void mixed_rows_times_blocks(const Product<B>& clean, const DraftRows<B>& drafts, int64_t b0, int64_t b1) {
  const int64_t rows = clean.M + drafts.T, tiles = (rows + kMaxTileRows - 1) / kMaxTileRows;
  const int64_t first = rows / tiles + (rows % tiles ? 1 : 0);
  if (clean.M >= 1 && clean.M <= kMaxMixedClean && first > clean.M) {
    mixed_first_tile(first, clean, drafts, b0, b1);
    bf16_rows_times_blocks(drafts, first - clean.M, drafts.T, b0, b1);
    return;
  }
  const int64_t chunk = chunk_blocks(clean.K);
  for (int64_t c0 = b0; c0 < b1; c0 += chunk) {
    const int64_t c1 = std::min(b1, c0 + chunk);
    if (clean.M) rows_times_blocks(clean, c0, c1);
    bf16_rows_times_blocks(drafts, 0, drafts.T, c0, c1);
  }
}

template <class B>
void mixed_product(const Product<B>& clean, const DraftRows<B>& drafts, int64_t blocks) {
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) { mixed_rows_times_blocks(clean, drafts, b0, b1); });
}

// The product of a prepared call whose rows from p.tail on are drafts (see packed_row_linear_bf16_tail).
at::Tensor bf16_tail_rows(const at::Tensor& x, const at::Tensor& packed, int64_t N, const Prepared& p,
                          const std::optional<at::Tensor>& lora_b) {
  if (p.tail == p.M) return float32_rows(x, packed, N, p, lora_b);
  at::Tensor y = at::empty({p.M, N}, x.options());
  const float* x_data = x.data_ptr<float>();
  float* y_data = y.data_ptr<float>();
  const std::vector<uint32_t> pairs = bfloat16_pairs(x_data + p.tail * p.K, p.M - p.tail, p.K);
  const float* codes = p.z;
  const float* w = packed.data_ptr<float>();
  with_lora_b(p, lora_b, [&](const auto* b) {
    using B = Element<decltype(b)>;
    const Product<B> clean{x_data, p.tail, p.K, w, N, p.bias, nullptr, nullptr, 0, p.tail, y_data};
    const DraftRows<B> drafts{pairs.data(), (p.K + 1) / 2, x_data + p.tail * p.K, p.M - p.tail, p.K, w, N, p.bias,
                              codes, b, p.R, y_data + p.tail * N, p.odd_codes};
    mixed_product(clean, drafts, p.blocks);
  });
  return y;
}

// packed_row_linear whose rows from tail_start on are drafts, multiplied in bfloat16: x and the weights rounded to
// bfloat16, products summed in float32 (an odd K's last term in float32); their LoRA update, if given, as in
// packed_row_linear. Rows before tail_start are bit for bit packed_row_linear's.
at::Tensor packed_row_linear_bf16_tail(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& lora_a,
                                       const std::optional<at::Tensor>& lora_b, int64_t tail_start) {
  return bf16_tail_rows(x, packed, N, prepare("packed_row_linear_bf16_tail", x, packed, N, bias, lora_a, lora_b,
                                              tail_start), lora_b);
}

// Bfloat16 weights (a bfloat16 model), packed by columns as pairs: [N/16, K/2, 16, 2], lane l of pair step s holding
// (w[n, 2s], w[n, 2s + 1]) for the block's 16 outputs n, so one 64-byte line is one step of a block and vdpbf16ps
// adds both products to each output's float32 sum: the row's input pair (x[2s], x[2s + 1]) is one broadcast 32-bit
// value, read straight from the bfloat16 input. Half the bytes of the float32 layout, the same sweep; each output
// sums its pairs in order of s (the instruction's own rounding, to nearest even), adds the bias and is rounded
// once to bfloat16, so as for float32 a row's bits do not depend on the row count.

// bfloat16 w [N, K] -> [ceil(N / 16), ceil(K / 2), 16, 2], zeros past N and K.
at::Tensor pack_column_pairs(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu() && w.is_contiguous() && w.scalar_type() == at::kBFloat16,
              "pack_column_pairs: weight must be a contiguous [N, K] bfloat16 CPU tensor");
  const int64_t N = w.size(0), K = w.size(1), steps = (K + 1) / 2, blocks = (N + kLanes - 1) / kLanes;
  at::Tensor packed = at::zeros({blocks, steps, kLanes, 2}, w.options());
  const auto* s = w.data_ptr<c10::BFloat16>();
  auto* d = packed.data_ptr<c10::BFloat16>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t lane = 0; lane < kLanes && b * kLanes + lane < N; ++lane) {
        const c10::BFloat16* row = s + (b * kLanes + lane) * K;
        c10::BFloat16* out = d + b * steps * 2 * kLanes + lane * 2;
        for (int64_t k = 0; k < K; ++k) out[(k / 2) * 2 * kLanes + (k & 1)] = row[k];
      }
  });
  return packed;
}

// One tile: MR rows of bfloat16 pairs (`steps` pairs a row) against NV pair-packed column blocks (`block` pairs
// apart), rows from `first` on also with their codes z against NV packed lora_b blocks; float32 (the codes) or
// bfloat16 out.
template <int MR, int NV, class B, class Y>
inline void pair_tile(const uint32_t* x, int64_t steps, const uint32_t* w, int64_t block,
                      const float* z, int64_t R, const B* b, int first, const float* bias, Y* y, int64_t ldy,
                      int64_t valid, const float* z_odd = nullptr, int parity = 0) {
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    __m512i wv[NV];
    for (int v = 0; v < NV; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(w + v * block + (s + kPrefetchSteps) * kLanes), kPrefetchHint);
      wv[v] = _mm512_loadu_si512(w + v * block + s * kLanes);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(x[i * steps + s]));
      for (int v = 0; v < NV; ++v)
        acc[i][v] = _mm512_dpbf16_ps(acc[i][v], reinterpret_cast<const __m512bh&>(wv[v]),
                                     reinterpret_cast<const __m512bh&>(a));
    }
  }
  finish_tile<MR, NV>(acc, z, R, b, first, bias, y, ldy, valid, z_odd, parity);
}

template <class B, class Y>
struct PairProduct {
  const uint32_t* x;  // [M, steps] bfloat16 pairs (an odd K's rows padded with a zero)
  int64_t M, K, steps;
  const uint32_t* w;  // pair-packed [blocks, steps, 16] (32 bits a lane)
  int64_t N;
  const float* bias;
  const float* z;  // the tail rows' codes [M - tail, R], or null
  const B* b;      // packed lora_b [blocks, R, 16], bfloat16
  int64_t R, tail;
  Y* y;  // [M, N]
  int64_t odd_codes = 0;  // a gated product's: where the odd blocks' codes start after z (see finish_tile)

  static constexpr int kTileRows = kMaxTileRows;

  template <int MR>
  static constexpr int columns() { return pair_columns_for<MR>(); }

  template <int MR>
  void start_rows() const {}

  template <int MR, int NV>
  void tile(int64_t m, int64_t blk, const float* codes, int first) const {
    const int64_t n = blk * kLanes;
    pair_tile<MR, NV>(x + m * steps, steps, w + blk * steps * kLanes, steps * kLanes, codes, R,
                      codes ? b + blk * R * kLanes : nullptr, first, bias ? bias + n : nullptr, y + m * N + n, N, N - n,
                      codes && odd_codes ? codes + odd_codes : nullptr, int(blk & 1));
  }
};

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HF_TIDAR_AMX 1
// The same product on AMX's tile unit (the amx_bf16 build, for Intel CPUs from Sapphire Rapids on), where K is a
// multiple of 32. vdpbf16ps does 32 multiply-adds an instruction, so a 12-row pass costs about 12 times a row's
// arithmetic and on 2 cores a SmolLM2 pass grows by about 1 ms a row; one tdpbf16ps multiplies up to 16 rows by a
// 32 x 16 weight tile, and a pass of a few rows costs little more than a one-row step. pack_column_pairs' layout is
// already the tile unit's: 16 pair steps of a column block ([16][16][2], 1 KB, contiguous) are one weight tile.
// Each output sums its 32-term tiles in order of k with the tile unit's own rounding, whatever the number of rows
// in its tile, so a row's bits still do not depend on M (they are not vdpbf16ps's bits: every bfloat16 product of
// a process takes one path, chosen by K and the CPU).

// Linux gives a process the tile registers only on request (once a process; a refusal leaves AMX off).
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

constexpr int kAmxColumns = 4;     // tiles 0-3: a row tile's sums for up to 4 column blocks; 4: its rows; 5, 6: weights
constexpr int64_t kAmxPairs = 16;  // pair steps in one weight tile (32 terms of k)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// The tile shapes of an MR-row tile. Configured at every row tile, not once a thread: other libraries in the
// process (oneDNN) configure the same registers for their own products.
template <int MR>
void configure_tiles() {
  TileConfig config;
  for (int t = 0; t <= 4; ++t) config.rows[t] = MR;
  config.rows[5] = config.rows[6] = kAmxPairs;
  for (int t = 0; t <= 6; ++t) config.bytes_per_row[t] = 64;
  _tile_loadconfig(&config);
}

// Sums for column block V of the tile += rows (tile 4) x the block's weight tile at w; two weight tiles in turn,
// so that one block's load overlaps the previous block's product. (GCC's tile intrinsics spell the register
// numbers into the assembly: they must be literals.)
template <int V>
inline void amx_block(const uint32_t* w) {
  if constexpr (V == 0) {
    _tile_loadd(5, w, 64);
    _tile_dpbf16ps(0, 4, 5);
  } else if constexpr (V == 1) {
    _tile_loadd(6, w, 64);
    _tile_dpbf16ps(1, 4, 6);
  } else if constexpr (V == 2) {
    _tile_loadd(5, w, 64);
    _tile_dpbf16ps(2, 4, 5);
  } else {
    _tile_loadd(6, w, 64);
    _tile_dpbf16ps(3, 4, 6);
  }
}

// pair_tile on the tile unit (steps a multiple of 16): the sums leave the tiles through memory into finish_tile.
// No software prefetch: the weight tiles are contiguous 1 KB steps that the hardware prefetchers follow, and
// prefetching the next 1-4 tiles' lines made SmolLM2's products 1-8% slower at 1-12 rows (a scratch timing).
template <int MR, int NV, class B, class Y>
inline void amx_pair_tile(const uint32_t* x, int64_t steps, const uint32_t* w, int64_t block, const float* z,
                          int64_t R, const B* b, int first, const float* bias, Y* y, int64_t ldy, int64_t valid,
                          const float* z_odd = nullptr, int parity = 0) {
  static_assert(NV >= 1 && NV <= kAmxColumns);
  _tile_zero(0);
  if constexpr (NV > 1) _tile_zero(1);
  if constexpr (NV > 2) _tile_zero(2);
  if constexpr (NV > 3) _tile_zero(3);
  for (int64_t s = 0; s < steps; s += kAmxPairs) {
    _tile_loadd(4, x + s, steps * sizeof(uint32_t));
    const uint32_t* ws = w + s * kLanes;
    amx_block<0>(ws);
    if constexpr (NV > 1) amx_block<1>(ws + block);
    if constexpr (NV > 2) amx_block<2>(ws + 2 * block);
    if constexpr (NV > 3) amx_block<3>(ws + 3 * block);
  }
  alignas(64) float sums[NV][MR][kLanes];
  _tile_stored(0, sums[0], 64);
  if constexpr (NV > 1) _tile_stored(1, sums[1], 64);
  if constexpr (NV > 2) _tile_stored(2, sums[2], 64);
  if constexpr (NV > 3) _tile_stored(3, sums[3], 64);
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_load_ps(sums[v][i]);
  finish_tile<MR, NV>(acc, z, R, b, first, bias, y, ldy, valid, z_odd, parity);
}

template <class B, class Y>
struct AmxPairProduct : PairProduct<B, Y> {
  // A tile product costs about the same at 1 and at 16 rows: up to 16 rows take one tile, not two.
  static constexpr int kTileRows = 16;

  template <int MR>
  static constexpr int columns() { return kAmxColumns; }

  template <int MR>
  void start_rows() const { configure_tiles<MR>(); }

  template <int MR, int NV>
  void tile(int64_t m, int64_t blk, const float* codes, int first) const {
    const int64_t n = blk * kLanes;
    const auto& p = static_cast<const PairProduct<B, Y>&>(*this);
    amx_pair_tile<MR, NV>(p.x + m * p.steps, p.steps, p.w + blk * p.steps * kLanes, p.steps * kLanes, codes, p.R,
                          codes ? p.b + blk * p.R * kLanes : nullptr, first, p.bias ? p.bias + n : nullptr,
                          p.y + m * p.N + n, p.N, p.N - n, codes && p.odd_codes ? codes + p.odd_codes : nullptr,
                          int(blk & 1));
  }
};

// Whether a pair product of `steps` pair steps runs on the tile unit here.
bool on_tiles(int64_t steps) { return steps % kAmxPairs == 0 && amx_permitted(); }
#endif

// Calls f with the pair product `p`, as it is or on the tile unit where on_tiles says so.
template <class B, class Y, class F>
void with_pair_product(const PairProduct<B, Y>& p, F&& f) {
#ifdef HF_TIDAR_AMX
  if (on_tiles(p.steps)) return f(AmxPairProduct<B, Y>{p});
#endif
  f(p);
}

void check_pairs(const at::Tensor& t, const char* name, int64_t blocks, int64_t steps) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.dim() == 4 &&
                  t.size(0) == blocks && t.size(1) == steps && t.size(2) == kLanes && t.size(3) == 2,
              "packed_pair_linear: ", name, " must be a contiguous bfloat16 CPU tensor of pack_column_pairs' layout [",
              blocks, ", ", steps, ", 16, 2]");
}

// tail_codes for T bfloat16 rows and factors packed by pack_codes as bfloat16 (pairs of k): the rows are read as pairs
// where they hold whole groups of them (copied, zero-padded, where not).
const float* tail_pair_codes(const c10::BFloat16* x, int64_t T, int64_t K, const c10::BFloat16* a, int64_t factors,
                             int64_t R) {
  const int64_t pairs = (K + 1) / 2;
  const CodeLayout c = code_layout(R, pairs);
  prefetch_bytes(a, factors * c.blocks * c.steps * kLanes * int64_t(sizeof(uint32_t)));
  const uint32_t* rows = reinterpret_cast<const uint32_t*>(x);
  if (K % 2 || c.width != pairs) {
    uint32_t* copy = scratch<0, uint32_t>(T * c.width);
    bfloat16_pairs_into(x, T, K, c.width, copy);
    rows = copy;
  }
  return all_codes(rows, T, c.width, reinterpret_cast<const uint32_t*>(a), factors, R, c.steps);
}

// packed_pair_linear's product (below); gated: as prepare's (lora_a holds gate's and up's factors, lora_b alternates their blocks).
at::Tensor pair_rows(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
                     int64_t tail_start, bool gated) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "packed_pair_linear: x must be a contiguous [M, K] bfloat16 CPU tensor");
  TORCH_CHECK(N > 0, "packed_pair_linear: N must be positive");
  const int64_t M = x.size(0), K = x.size(1), steps = (K + 1) / 2, blocks = (N + kLanes - 1) / kLanes;
  check_pairs(packed, "weight", blocks, steps);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  // An odd K: each row padded with a zero (the packed weight has zeros there too).
  std::vector<uint32_t> padded;
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
  if (K % 2) {
    padded.resize(M * steps);
    bfloat16_pairs_into(x.data_ptr<c10::BFloat16>(), M, K, steps, padded.data());
    pairs = padded.data();
  }
  std::vector<float> bias_values;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "packed_pair_linear: bias must be N contiguous bfloat16 values");
    const auto* values = bias->data_ptr<c10::BFloat16>();
    bias_values.assign(values, values + N);
  }
  const float* bias_data = bias_values.empty() ? nullptr : bias_values.data();
  const int64_t tail = std::clamp<int64_t>(tail_start, 0, M);
  int64_t R = 0, odd_codes = 0;
  const float* z = nullptr;
  const c10::BFloat16* b = nullptr;
  if (lora_a.has_value() && tail < M) {
    TORCH_CHECK(lora_b.has_value(), "packed_pair_linear: lora_a needs lora_b");
    R = lora_b->dim() == 3 ? lora_b->size(1) : 0;
    TORCH_CHECK(lora_b->scalar_type() == at::kBFloat16 && lora_b->is_contiguous() && lora_b->dim() == 3 &&
                    lora_b->size(0) == blocks && lora_b->size(2) == kLanes,
                "packed_pair_linear: lora_b must be a contiguous bfloat16 CPU tensor of pack_columns' layout [",
                blocks, ", R, 16]");
    const int64_t factors = gated ? 2 : 1;
    check_codes(*lora_a, "packed_pair_linear", factors, R, K, /*bfloat16=*/true);
    z = tail_pair_codes(x.data_ptr<c10::BFloat16>() + tail * K, M - tail, K, lora_a->data_ptr<c10::BFloat16>(), factors,
                        R);
    if (gated) odd_codes = (M - tail) * R;
    b = lora_b->data_ptr<c10::BFloat16>();
  }
  with_pair_product(PairProduct<c10::BFloat16, c10::BFloat16>{
                  pairs, M, K, steps, reinterpret_cast<const uint32_t*>(packed.data_ptr<c10::BFloat16>()), N,
                  bias_data, z, b, R, tail, y.data_ptr<c10::BFloat16>(), odd_codes},
              [&](const auto& q) { run_product(q, blocks); });
  return y;
}

// Logits whose top is exact, for greedy decoding of a float32 model (an LM head: N outputs, no bias), from a
// bfloat16 copy of the weight packed as pairs (half the bytes of the float32 sweep); see certify_top. The bfloat16
// value of output v of row x differs from the float32 dot product by at most eps_v = c * |x|_2 * |w_v|_2: x and w
// rounded to nearest bfloat16 change each product by at most 2^-7 + 2^-16 of its magnitude (the products themselves
// are exact in float32), the K float32 additions add at most K * 2^-24 of the sum of magnitudes each rounded to
// nearest, as vdpbf16ps and the tile unit's tdpbf16ps are specified to round, in any order; the bound takes twice
// that (2^-23 a step: an addition rounded toward zero), so it holds whichever of the two computes the product and
// however the tile unit orders its sums. The sum of magnitudes is at most |x|_2 * |w_v|_2 (Cauchy-Schwarz).
constexpr double kBf16ProductError = 1.0 / 128 + 1.0 / 65536;

// See certify_top: x float32 [M, K], pairs the weight [N, K] packed by pack_column_pairs, weight the float32 weight
// itself, norms [N] its rows' L2 norms rounded up, watched the ids always computed exactly.
at::Tensor top_exact_linear(const at::Tensor& x, const at::Tensor& pairs, const at::Tensor& weight,
                            const at::Tensor& norms, const at::Tensor& watched) {
  const std::vector<int64_t> ids = check_head("top_exact_linear", x, weight, norms, watched);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), steps = (K + 1) / 2;
  const int64_t blocks = (N + kLanes - 1) / kLanes;
  check_pairs(pairs, "weight pairs", blocks, steps);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const std::vector<uint32_t> rounded = bfloat16_pairs(x.data_ptr<float>(), M, K);
  // On the tile unit where it multiplies K, at every row count (a row's values then do not depend on the others):
  // SmolLM2's head, cold, on a 2-core Xeon with AMX (benchmarks/packed_variants.py --head), at 1 / 4 / 9 / 12 rows
  // 2.26 / 2.54 / 3.87 / 4.75 ms with vdpbf16ps, 2.26 / 2.44 / 2.88 / 2.99 on the tiles. The top is exact either way.
  with_pair_product(PairProduct<float, float>{rounded.data(), M, K, steps,
                                              reinterpret_cast<const uint32_t*>(pairs.data_ptr<c10::BFloat16>()), N,
                                              nullptr, nullptr, nullptr, 0, M, y.data_ptr<float>()},
                    [&](const auto& q) { run_product(q, blocks); });
  certify_rows(x, weight, norms, ids, y, kBf16ProductError + 2.1 * K / 16777216.0, 0.0,
               std::ldexp(float(K), -120));  // vdpbf16ps and tdpbf16ps flush subnormals to zero
  return y;
}

// y = x @ wᵀ (+ bias) for bfloat16 x [M, K] and w packed by pack_column_pairs, rounded once to bfloat16; rows from
// tail_start on plus (x @ lora_aᵀ) @ lora_bᵀ, with lora_a [R, K] packed by pack_codes and lora_b [N, R] by
// pack_columns (both bfloat16; the codes and the update in float32).
at::Tensor packed_pair_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                              const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& lora_a,
                              const std::optional<at::Tensor>& lora_b, int64_t tail_start) {
  return pair_rows(x, packed, N, bias, lora_a, lora_b, tail_start, /*gated=*/false);
}
#endif  // bfloat16

#ifdef __AVX512F__
// 16 float32 lanes rounded to bfloat16 as torch's conversion rounds (nearest even, NaN to 0x7FC0, subnormals kept:
// vcvtneps2bf16, which store_lanes uses for the products, flushes them) and widened back, in integer arithmetic that
// every AVX-512 build has; stored as bfloat16 by store_torch_rounded.
inline __m512 rounded_lanes(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd);
  const __m512i top = _mm512_and_si512(up, _mm512_set1_epi32(int32_t(0xFFFF0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(top), nan, _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
}
inline void store_torch_rounded(__m512 v, c10::BFloat16* p) {
  const __m256i halves = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded_lanes(v)), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), halves);
}
inline __m512 as_dtype(__m512 v, const c10::BFloat16*) { return rounded_lanes(v); }
#endif
inline void store_torch_rounded(Lanes16 v, float* p) { lanes_store(p, v); }
inline Lanes16 as_dtype(Lanes16 v, const float*) { return v; }

// out[m, n] = silu(gate) * up for the product `both` [M, 2N] whose 16-column blocks alternate gate (even) and up (odd),
// float32 or bfloat16 bits: transformers' act_fn(gate_proj(x)) * up_proj(x) with its roundings (silu rounded to the
// dtype, then the product); silu16 (within a few ulp of torch's silu), the same for every element.
// Shared among threads by rows and blocks: at a many-row pass's 20 rows the silus cost a tenth of the product's time.
template <class T>
void gated_rows(const T* both, int64_t M, int64_t N, T* out) {
  const int64_t blocks = N / kLanes;
  at::parallel_for(0, M * blocks, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / blocks, blk = i % blocks;
      const T* gate = both + m * 2 * N + 2 * blk * kLanes;
      const Lanes16 silu = as_dtype(lanes_silu(load_lanes(gate)), gate);
      store_torch_rounded(lanes_mul(silu, load_lanes(gate + kLanes)), out + m * N + blk * kLanes);
    }
  });
}

// silu(x @ gateᵀ) * (x @ upᵀ) [M, N] for a gated MLP whose gate_proj and up_proj weights ([N, K] each, N a multiple
// of 16, no bias) were packed together: their rows interleaved 16 at a time (gate's first 16, up's first 16, ...),
// then packed by pack_columns (float32) or pack_column_pairs (bfloat16). One sweep over both; the LoRA tail as in
// packed_row_linear / packed_pair_linear, with lora_a gate's [R, K] factor and up's, each packed by pack_codes and
// concatenated, and lora_b [2N, R] their B rows interleaved as the weights', each block updated by its own factor's
// codes (finish_tile's z_odd). gate and up get the bits of their own packed products (with their factors at the
// common rank R).
// With draft_tail (float32 x and weights, the AVX-512 BF16 build), the rows from tail_start on are multiplied in
// bfloat16 as packed_row_linear_bf16_tail multiplies them; the rows before keep their float32 bits.
at::Tensor gated_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                        const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
                        int64_t tail_start, bool draft_tail) {
  const char* op = draft_tail ? "packed_gated_linear_bf16_tail" : "packed_gated_linear";
  TORCH_CHECK(N > 0 && N % kLanes == 0, op, ": N must be a positive multiple of 16");
  at::Tensor both;
  if (x.scalar_type() == at::kFloat) {
    const Prepared p = prepare(op, x, packed, 2 * N, std::nullopt, lora_a, lora_b, tail_start, /*gated=*/true);
#ifdef HF_TIDAR_PACKED_BF16
    both = draft_tail ? bf16_tail_rows(x, packed, 2 * N, p, lora_b) : float32_rows(x, packed, 2 * N, p, lora_b);
#else
    both = float32_rows(x, packed, 2 * N, p, lora_b);
#endif
  } else {
    TORCH_CHECK(!draft_tail, op, ": x must be float32 (bfloat16 draft rows are for float32 weights)");
#ifdef HF_TIDAR_PACKED_BF16
    both = pair_rows(x, packed, 2 * N, std::nullopt, lora_a, lora_b, tail_start, /*gated=*/true);
#else
    TORCH_CHECK(false, "packed_gated_linear: bfloat16 needs the AVX-512 BF16 build; x must be float32 here");
#endif
  }
  at::Tensor out = at::empty({both.size(0), N}, x.options());
#ifdef HF_TIDAR_PACKED_BF16
  if (x.scalar_type() != at::kFloat) {
    gated_rows(both.data_ptr<c10::BFloat16>(), both.size(0), N, out.data_ptr<c10::BFloat16>());
    return out;
  }
#endif
  gated_rows(both.data_ptr<float>(), both.size(0), N, out.data_ptr<float>());
  return out;
}

at::Tensor packed_gated_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                               const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
                               int64_t tail_start) {
  return gated_linear(x, packed, N, lora_a, lora_b, tail_start, /*draft_tail=*/false);
}

#ifdef HF_TIDAR_PACKED_BF16
// packed_gated_linear whose rows from tail_start on are drafts (float32 x and weights): gate and up of those rows have
// the bits of packed_row_linear_bf16_tail's products, the rows before tail_start packed_gated_linear's.
at::Tensor packed_gated_linear_bf16_tail(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                                         const std::optional<at::Tensor>& lora_a,
                                         const std::optional<at::Tensor>& lora_b, int64_t tail_start) {
  return gated_linear(x, packed, N, lora_a, lora_b, tail_start, /*draft_tail=*/true);
}
#endif

}  // namespace

#define HF_TIDAR_PACKED_FRAGMENT(name, m) TORCH_LIBRARY_FRAGMENT(name, m)
HF_TIDAR_PACKED_FRAGMENT(HF_TIDAR_KERNEL_LIBRARY, m) {
  m.def("pack_columns(Tensor weight) -> Tensor", &pack_columns);
  m.def("pack_codes(Tensor lora_a) -> Tensor", &pack_codes);
  m.def("packed_row_linear(Tensor x, Tensor packed, int N, Tensor? bias, Tensor? lora_a, Tensor? lora_b, "
        "int tail_start) -> Tensor",
        &packed_row_linear);
  m.def("packed_gated_linear(Tensor x, Tensor packed, int N, Tensor? lora_a, Tensor? lora_b, int tail_start) -> Tensor",
        &packed_gated_linear);
  m.def("top_exact_linear_half(Tensor x, Tensor packed, Tensor weight, Tensor norms, Tensor watched) -> Tensor",
        &top_exact_linear_half);
#ifdef HF_TIDAR_PACKED_BF16
  m.def("packed_row_linear_bf16_tail(Tensor x, Tensor packed, int N, Tensor? bias, Tensor? lora_a, Tensor? lora_b, "
        "int tail_start) -> Tensor",
        &packed_row_linear_bf16_tail);
  m.def("packed_gated_linear_bf16_tail(Tensor x, Tensor packed, int N, Tensor? lora_a, Tensor? lora_b, "
        "int tail_start) -> Tensor",
        &packed_gated_linear_bf16_tail);
  m.def("pack_column_pairs(Tensor weight) -> Tensor", &pack_column_pairs);
  m.def("top_exact_linear(Tensor x, Tensor pairs, Tensor weight, Tensor norms, Tensor watched) -> Tensor",
        &top_exact_linear);
  m.def("packed_pair_linear(Tensor x, Tensor packed, int N, Tensor? bias, Tensor? lora_a, Tensor? lora_b, "
        "int tail_start) -> Tensor",
        &packed_pair_linear);
#endif
#ifdef HF_TIDAR_AMX
  // Whether this process got the tile registers (else every pair product stays on vdpbf16ps).
  m.def("tile_unit_ready() -> bool", [] { return amx_permitted(); });
#endif
}

#endif  // AVX-512, or AVX2 with FMA and F16C
