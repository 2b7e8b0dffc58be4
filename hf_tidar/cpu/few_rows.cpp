// A matmul for the few rows of a decode step on x86 CPUs, with an optional LoRA update on a tail of the
// rows (the gated adapter's [MASK] rows), built by hf_tidar/cpu/kernel.py for the widest instruction set
// the CPU has: AVX2 + FMA (float32), AVX-512 (float32, twice the lanes) or AVX-512 BF16 (also bfloat16,
// with vdpbf16ps: two products per float32 lane and half the weight bytes).
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
// (x @ lora_aᵀ) @ lora_bᵀ, summed into the same dot products (see dot_tile). The low-rank codes
// x @ lora_aᵀ are kept in float32 whatever the weights' dtype. Under float32 weights the AVX-512 builds also
// take float16 factors (HalfFactors), widened exactly: the factors are streamed with every weight.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#ifndef HF_TIDAR_KERNEL_LIBRARY
#define HF_TIDAR_KERNEL_LIBRARY hf_tidar_cpu
#endif

namespace {

using bf16 = c10::BFloat16;

inline float to_float(float v) { return v; }
inline float to_float(bf16 v) { return static_cast<float>(v); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }
inline void store(float* y, float v) { *y = v; }
inline void store(bf16* y, float v) { *y = bf16(v); }  // round to nearest even, as torch's casts do

// -- instruction sets -----------------------------------------------------------------------------
// An instruction set is a float32 accumulator vector and two products, each a policy that loads a step
// of its two operands and multiply-adds them into an accumulator: `Main` (x row · weight row, both T)
// and `Lora` (float32 code · a T row of lora_b). Where the set can mask a load (`kMasked`: the AVX-512
// sets), the last partial step is a masked vector step and a tile's sums are taken together (tile_sums);
// otherwise (AVX2) each accumulator has its horizontal `sum` and the rest of a row is summed in scalar
// after it. Either way the summation order depends only on the row length.

#if !defined(__AVX512F__)
struct Avx2F32 {
  using T = float;
  using Acc = __m256;
  static constexpr int kRows = 4, kColumns = 3;  // 4 x 3 accumulators + 3 weight vectors + 1 input = 16 registers
  static constexpr bool kMasked = false;
  static Acc zero() { return _mm256_setzero_ps(); }
  static float sum(Acc v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  struct Main {
    using A = float;
    using B = float;
    using Vec = __m256;
    static constexpr int kStep = 8;
    static Vec load_a(const float* p) { return _mm256_loadu_ps(p); }
    static Vec load_b(const float* p) { return _mm256_loadu_ps(p); }
    static void fma(Acc& acc, Vec a, Vec b) { acc = _mm256_fmadd_ps(a, b, acc); }
  };
  using Lora = Main;
};
using F32 = Avx2F32;
#define HF_TIDAR_KERNEL_ISA "avx2"
#else
struct Avx512F32 {
  using T = float;
  using Acc = __m512;
  // 4 x 3 tiles with the loads kept in registers (see Main::pinned). One SmolLM2 layer at 6 rows, 1 thread
  // (benchmarks/kernel_rows.py): 866 µs in 4 x 2 tiles with folded loads, 717 in 4 x 2 or 4 x 4 kept, 674 in 4 x 3.
  static constexpr int kRows = 4, kColumns = 3;
  static constexpr bool kMasked = true;
  static Acc zero() { return _mm512_setzero_ps(); }
  static __mmask16 first(int n) { return static_cast<__mmask16>((1u << n) - 1); }
  struct Main {
    using A = float;
    using B = float;
    using Vec = __m512;
    static constexpr int kStep = 16;
    static Vec load_a(const float* p) { return pinned(_mm512_loadu_ps(p)); }
    static Vec load_b(const float* p) { return pinned(_mm512_loadu_ps(p)); }
    static Vec load_a(const float* p, int n) { return _mm512_maskz_loadu_ps(first(n), p); }
    static Vec load_b(const float* p, int n) { return _mm512_maskz_loadu_ps(first(n), p); }
    static void fma(Acc& acc, Vec a, Vec b) { acc = _mm512_fmadd_ps(a, b, acc); }
    // Kept in a register: GCC would otherwise fold the load into every FMA that uses it, loading an input row
    // once per weight row of the tile (10 loads for 8 FMAs in a 4 x 2 tile, against 7 for 12 in 4 x 3).
    static Vec pinned(Vec v) {
      asm("" : "+v"(v));
      return v;
    }
    static __m512i pinned_i(__m512i v) {
      asm("" : "+v"(v));
      return v;
    }
  };
  using Lora = Main;
};
using F32 = Avx512F32;

// float32 against float16 rows, widened exactly: the LoRA factors of an adapter saved in float16 keep their exact
// values at half the bytes (hf_tidar.cpu.linear.enable passes them so only when that loses nothing). As
// `Lora`, float32 codes · rows of lora_b; as `Main` of F32HalfCodes, input rows · rows of lora_a.
struct HalfFactors {
  using Acc = __m512;
  using A = float;
  using B = c10::Half;
  using Vec = __m512;
  static constexpr int kStep = 16;
  static __mmask16 first(int n) { return static_cast<__mmask16>((1u << n) - 1); }
  static __m512 widen(__m256i v) { return _mm512_cvtph_ps(v); }
  static Vec load_a(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load_b(const c10::Half* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static Vec load_a(const float* p, int n) { return _mm512_maskz_loadu_ps(first(n), p); }
  static Vec load_b(const c10::Half* p, int n) { return widen(_mm256_maskz_loadu_epi16(first(n), p)); }
  static void fma(Acc& acc, Vec a, Vec b) { acc = _mm512_fmadd_ps(a, b, acc); }
};
// The low-rank codes x @ lora_aᵀ for a float16 lora_a: float32 inputs against float16 "weight" rows.
struct F32HalfCodes : Avx512F32 {
  using Main = HalfFactors;
};
#define HF_TIDAR_KERNEL_HALF_FACTORS 1
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HF_TIDAR_KERNEL_BF16 1
#define HF_TIDAR_KERNEL_ISA "avx512_bf16"
#else
#define HF_TIDAR_KERNEL_ISA "avx512"
#endif
#endif

#ifdef HF_TIDAR_KERNEL_BF16
struct Avx512Bf16 {
  using T = bf16;
  using Acc = __m512;
  static constexpr int kRows = 4, kColumns = 4;  // measured: 1536x576 at 12 rows 65-87 µs, 4 x 2 154 µs
  static constexpr bool kMasked = true;
  static Acc zero() { return _mm512_setzero_ps(); }
  struct Main {  // vdpbf16ps: float32 lane i += a[2i]·b[2i] + a[2i+1]·b[2i+1]
    using A = bf16;
    using B = bf16;
    using Vec = __m512i;
    static constexpr int kStep = 32;
    static __mmask32 first(int n) { return static_cast<__mmask32>((uint64_t{1} << n) - 1); }
    static Vec load_a(const bf16* p) { return _mm512_loadu_si512(p); }
    static Vec load_b(const bf16* p) { return _mm512_loadu_si512(p); }
    static Vec load_a(const bf16* p, int n) { return _mm512_maskz_loadu_epi16(first(n), p); }
    static Vec load_b(const bf16* p, int n) { return _mm512_maskz_loadu_epi16(first(n), p); }
    static void fma(Acc& acc, Vec a, Vec b) {
      acc = _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(a), reinterpret_cast<__m512bh&>(b));
    }
  };
  struct Lora {  // float32 codes against lora_b's bf16 rows, widened exactly (a bf16 is a float's top half)
    using A = float;
    using B = bf16;
    using Vec = __m512;
    static constexpr int kStep = 16;
    static __mmask16 first(int n) { return static_cast<__mmask16>((1u << n) - 1); }
    static __m512 widen(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }
    static Vec load_a(const float* p) { return _mm512_loadu_ps(p); }
    static Vec load_b(const bf16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
    static Vec load_a(const float* p, int n) { return _mm512_maskz_loadu_ps(first(n), p); }
    static Vec load_b(const bf16* p, int n) { return widen(_mm256_maskz_loadu_epi16(first(n), p)); }
    static void fma(Acc& acc, Vec a, Vec b) { acc = _mm512_fmadd_ps(a, b, acc); }
  };
};
#endif

// The weight type of a set (its Main product's second operand), and the product a LoRA tail takes with lora_b
// rows of type LB: the set's own Lora, or HalfFactors for float16 factors under float32 weights.
template <class V>
using WeightOf = typename V::Main::B;
template <class V, class LB>
struct LoraFor {
  using type = typename V::Lora;
};
#ifdef HF_TIDAR_KERNEL_HALF_FACTORS
template <>
struct LoraFor<Avx512F32, c10::Half> {
  using type = HalfFactors;
};
#endif

// -- sums of a tile ------------------------------------------------------------------------------
#ifdef __AVX512F__
// The 16 float32 sums of up to 4 x 4 accumulators at once: out[4i + j] = the sum of acc[i][j]'s lanes. Each
// sum pairs its lanes exactly as _mm512_reduce_add_ps does (i with i + 8, then + 4, + 2, + 1), so every
// result is bit for bit that of a one-accumulator sum, whichever tile it came from; the 16 sums share each
// level's shuffles and adds (45 instructions instead of 16 x 8).
template <int MR, int NR>
inline void tile_sums(const __m512 (&acc)[MR][NR], float* out) {
  static_assert(MR <= 4 && NR <= 4, "a tile of at most 4 x 4 accumulators");
  __m512 a[16];
  for (int t = 0; t < 4; ++t)
    for (int q = 0; q < 4; ++q) a[4 * t + q] = (q < MR && t < NR) ? acc[q][t] : _mm512_setzero_ps();
  __m512 c[8], e[4], h[2];
  for (int m = 0; m < 8; ++m)  // lanes i + (i + 8): halves of two accumulators side by side
    c[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
  for (int n = 0; n < 4; ++n)  // + 4: one 128-bit lane per accumulator
    e[n] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * n], c[2 * n + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * n], c[2 * n + 1], 0xDD));
  for (int p = 0; p < 2; ++p)  // + 2
    h[p] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * p], e[2 * p + 1], 0x44), _mm512_shuffle_ps(e[2 * p], e[2 * p + 1], 0xEE));
  // + 1: lane 4q + t holds a[4t + q], i.e. acc[q][t]
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_ps(h[0], h[1], 0x88), _mm512_shuffle_ps(h[0], h[1], 0xDD)));
}
#endif

// -- tiles ----------------------------------------------------------------------------------------

// Weight prefetching: while a column block computes, its steps prefetch the block kPrefetchTiles ahead into L2
// (`_MM_HINT_T1`), as much per step as a step reads, so the stream of requests keeps pace with the arithmetic.
// Prefetching only the next block into L1 (as before) serialised memory and arithmetic at a few rows: on a Zen 4
// CPU (2 threads, float32, benchmarks/kernel_rows.py --against) one SmolLM2 layer at 4 rows took 687-698 µs that
// way and 505-516 µs this way, 1 row 501 -> 463-476, 12 rows 1049 -> 927-935; L2 4 or 8 blocks ahead were level,
// L1 2 or 4 ahead and L2 1 or 2 ahead in between. The AVX2 build and bfloat16 gained alike.
constexpr int64_t kPrefetchTiles = 4;
constexpr auto kWeightPrefetchHint = _MM_HINT_T1;

// A column block's prefetches: the weight rows of the block kPrefetchTiles ahead, spread over every step of every
// row tile of this block (`share` row tiles), so a many-row block issues them at an even pace. Issued all in the
// first row tile (as before), a 12-row block sent its prefetches in a burst and then none for two thirds of its
// time: on a Zen 4 CPU one SmolLM2 layer at 12 rows took ~930 µs from memory, against ~480 for 12 rows of
// weights already in cache plus nothing hidden.
struct Prefetch {
  const char* next;
  const char* end;
  int64_t share;
  int64_t bytes_per_step(int64_t step_bytes) const { return (step_bytes / share + 63) & ~int64_t(63); }
};

// Prefetch `bytes` (at most kMaxBytes, a step's worth) more of the lines from `next` on, up to `end`. The constant
// trip count unrolls the loop as when every step prefetched kMaxBytes. The caller keeps `next` in a local: held in
// the Prefetch struct, a char pointer would be stored and reloaded at every step (it may alias anything).
template <int64_t kMaxBytes>
inline void prefetch_lines(const char*& next, const char* end, int64_t bytes) {
  for (int64_t off = 0; off < kMaxBytes; off += 64)
    if (off < bytes && next < end) {
      _mm_prefetch(next, kWeightPrefetchHint);
      next += 64;
    }
}

// One segment of MR x NR dot products by policy P: MR rows of a (stride lda) against NR rows of b (stride
// ldb), length n. Returns where a scalar remainder starts (n where the last partial step is masked).
// Rows before `first` are left alone (a LoRA segment covers only the tile's tail rows; `a` then starts at row
// `first`).
template <class V, class P, int MR, int NR>
inline int64_t dot_segment(typename V::Acc (&acc)[MR][NR], const typename P::A* a, int64_t lda,
                           const typename P::B* b, int64_t ldb, int64_t n, Prefetch& pf, int first = 0) {
  constexpr int64_t kPrefetchBytes = NR * P::kStep * int64_t(sizeof(typename P::B));  // as much as a step uses
  const int64_t prefetch_bytes = pf.bytes_per_step(kPrefetchBytes);
  const char* next = pf.next;
  const char* const end = pf.end;
  int64_t k = 0;
  for (; k + P::kStep <= n; k += P::kStep) {
    prefetch_lines<kPrefetchBytes>(next, end, prefetch_bytes);  // a later tile's weight rows are on their way (see kPrefetchTiles)
    typename P::Vec bv[NR];
    for (int j = 0; j < NR; ++j) bv[j] = P::load_b(b + j * ldb + k);
    for (int i = 0; i < MR; ++i) {  // a constant trip count keeps every accumulator in a register
      if (i < first) continue;
      const typename P::Vec av = P::load_a(a + (i - first) * lda + k);
      for (int j = 0; j < NR; ++j) P::fma(acc[i][j], av, bv[j]);
    }
  }
  pf.next = next;
  if constexpr (V::kMasked) {
    if (k < n) {
      const int left = int(n - k);
      typename P::Vec bv[NR];
      for (int j = 0; j < NR; ++j) bv[j] = P::load_b(b + j * ldb + k, left);
      for (int i = 0; i < MR; ++i) {
        if (i < first) continue;
        const typename P::Vec av = P::load_a(a + (i - first) * lda + k, left);
        for (int j = 0; j < NR; ++j) P::fma(acc[i][j], av, bv[j]);
      }
    }
    return n;
  }
  return k;
}

// y[i, j] = x_i · w_j (+ z_i · b_j for the tile's rows from `first` on, a LoRA tail) (+ bias_j) for an MR x NR
// tile; z holds the codes of rows first.. only. The LoRA segment extends the same accumulators (a tail row is
// [x | z] against [w | b]), so the update costs R / K more work and streams b, in nn.Linear's [N, R] layout,
// next to w. Every row has its own accumulators, so a tile may mix clean and tail rows: a row's sums are the
// same whichever rows share its tile.
template <class V, int MR, int NR, class Out, class LB>
inline void dot_tile(const typename V::T* x, int64_t K, const WeightOf<V>* w, const float* z, int first,
                     const LB* b, int64_t R, Out* y, int64_t ldy, const typename V::T* bias,
                     Prefetch& pf) {
  typename V::Acc acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = V::zero();
  [[maybe_unused]] const int64_t k = dot_segment<V, typename V::Main, MR, NR>(acc, x, K, w, K, K, pf);
  [[maybe_unused]] const int64_t r =
      z ? dot_segment<V, typename LoraFor<V, LB>::type, MR, NR>(acc, z, R, b, R, R, pf, first) : 0;
#ifdef __AVX512F__
  static_assert(V::kMasked, "an AVX-512 set masks its last step: no scalar remainder to add");
  float sums[16];
  tile_sums<MR, NR>(acc, sums);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) store(y + i * ldy + j, bias ? sums[4 * i + j] + to_float(bias[j]) : sums[4 * i + j]);
#else
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = V::sum(acc[i][j]);
      for (int64_t kk = k; kk < K; ++kk) s += to_float(x[i * K + kk]) * to_float(w[j * K + kk]);
      if (z && i >= first)
        for (int64_t rr = r; rr < R; ++rr) s += z[(i - first) * R + rr] * to_float(b[j * R + rr]);
      store(y + i * ldy + j, bias ? s + to_float(bias[j]) : s);
    }
#endif
}

#ifdef HF_TIDAR_KERNEL_BF16
// Draft rows in bfloat16 under float32 weights. Rows before `first` are clean: the same 16-wide float32
// FMAs, in the same order, as the plain path (their bits do not change). Rows from `first` on (the [MASK]
// rows, whose outputs are only ever drafts) take vdpbf16ps on `b16`, the weight tile rounded to bfloat16
// once per column block (see column_block), against a bfloat16 copy of their inputs `a16`: half the
// instructions of float32 for those rows. The last n mod 32 terms are float32 for every row.
template <int MR, int NR>
inline void dot_segment_mixed(__m512 (&acc)[MR][NR], const float* a, const bf16* a16, int64_t lda, const float* b,
                              const bf16* b16, int64_t ldb, int64_t n, Prefetch& pf, int first) {
  using P = F32::Main;
  constexpr int64_t kPrefetchBytes = NR * 32 * int64_t(sizeof(float));
  const int64_t prefetch_bytes = pf.bytes_per_step(kPrefetchBytes);
  const char* next = pf.next;
  const char* const end = pf.end;
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    prefetch_lines<kPrefetchBytes>(next, end, prefetch_bytes);
    if (first > 0) {  // clean rows: step k, then step k + 16, as the 16-wide loop does
      __m512 lo[NR], hi[NR];
      for (int j = 0; j < NR; ++j) {
        lo[j] = P::load_b(b + j * ldb + k);
        hi[j] = P::load_b(b + j * ldb + k + 16);
      }
      for (int i = 0; i < MR; ++i) {
        if (i >= first) continue;
        const __m512 a0 = P::load_a(a + i * lda + k);
        for (int j = 0; j < NR; ++j) P::fma(acc[i][j], a0, lo[j]);
        const __m512 a1 = P::load_a(a + i * lda + k + 16);
        for (int j = 0; j < NR; ++j) P::fma(acc[i][j], a1, hi[j]);
      }
    }
    if (first < MR) {
      __m512i w[NR];
      for (int j = 0; j < NR; ++j) w[j] = P::pinned_i(_mm512_loadu_si512(b16 + j * ldb + k));
      for (int i = 0; i < MR; ++i) {
        if (i < first) continue;
        __m512i av = P::pinned_i(_mm512_loadu_si512(a16 + (i - first) * lda + k));
        for (int j = 0; j < NR; ++j)
          acc[i][j] = _mm512_dpbf16_ps(acc[i][j], reinterpret_cast<__m512bh&>(av), reinterpret_cast<__m512bh&>(w[j]));
      }
    }
  }
  pf.next = next;
  if (k < n)
    dot_segment<F32, P, MR, NR>(acc, a + k, lda, b + k, ldb, n - k, pf);
}

// NR weight rows of length K rounded to bfloat16 into `out` (the first K - K mod 32 columns of each row).
template <int NR>
inline void round_weight_tile(const float* w, int64_t K, bf16* out) {
  for (int j = 0; j < NR; ++j)
    for (int64_t k = 0; k + 32 <= K; k += 32) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(w + j * K + k + 16), _mm512_loadu_ps(w + j * K + k));
      _mm512_storeu_si512(out + j * K + k, reinterpret_cast<const __m512i&>(v));  // elements k..k+31 in order
    }
}

// dot_tile with draft rows in bfloat16 (rows from `first` on; see dot_segment_mixed), their LoRA update from
// bfloat16 lora_b rows.
template <int MR, int NR>
inline void dot_tile_mixed(const float* x, const bf16* x16, int64_t K, const float* w, const bf16* w16,
                           const float* z, int first, const bf16* b, int64_t R, float* y, int64_t ldy,
                           const float* bias, Prefetch& pf) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  dot_segment_mixed<MR, NR>(acc, x, x16, K, w, w16, K, K, pf, first);
  if (z) dot_segment<Avx512Bf16, Avx512Bf16::Lora, MR, NR>(acc, z, R, b, R, R, pf, first);
  float sums[16];
  tile_sums<MR, NR>(acc, sums);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = bias ? sums[4 * i + j] + bias[j] : sums[4 * i + j];
}
#endif

// All M rows of x against NR weight rows, in row tiles of at most kRows, rows from `tail` on with their LoRA
// codes z ([M - tail, R]; none if z is null). One pass over the weight tile serves clean and tail rows alike
// (tiles of their own cost up to 50% more in float32), and the tiles have near-equal heights (6 rows: 3 + 3,
// not 4 + 2). Measured by benchmarks/kernel_rows.py against the split tiles, float32, one decoder layer of
// SmolLM2: 2 clean + 2 tail rows 659 -> 463 µs, 3 + 9 rows 1085 -> 878 µs, 5 clean rows 623 -> 518 µs.
template <class V, int NR, bool Mixed, class Out, class LB>
inline void column_block(const typename V::T* x, const bf16* x16, int64_t M, int64_t K, const WeightOf<V>* w,
                         const float* z, const LB* b, int64_t R, int64_t tail, Out* y, int64_t N,
                         const typename V::T* bias, const char* next, const char* end) {
  static_assert(V::kRows == 4, "the remainder switch below covers 1-3 rows");
#ifdef HF_TIDAR_KERNEL_BF16
  // Draft rows read the weight tile rounded to bfloat16 once here, whatever the number of their row tiles.
  thread_local std::vector<bf16> w16;
  if constexpr (Mixed) {
    if (tail < M) {
      w16.resize(NR * K);
      round_weight_tile<NR>(w, K, w16.data());
    }
  }
#endif
  const int64_t tiles = (M + V::kRows - 1) / V::kRows;
  Prefetch pf{next, end, tiles};
  auto tile = [&](auto rows, int64_t m) {
    constexpr int MR = decltype(rows)::value;
    const int first = (z || Mixed) ? int(std::clamp<int64_t>(tail - m, 0, MR)) : MR;
    const float* codes = z && first < MR ? z + (m + first - tail) * R : nullptr;
#ifdef HF_TIDAR_KERNEL_BF16
    if constexpr (Mixed) {
      const bf16* drafts = first < MR ? x16 + (m + first - tail) * K : nullptr;
      dot_tile_mixed<MR, NR>(x + m * K, drafts, K, w, w16.data(), codes, first, b, R, y + m * N, N, bias, pf);
      return;
    }
#endif
    if constexpr (!Mixed) dot_tile<V, MR, NR>(x + m * K, K, w, codes, first, b, R, y + m * N, N, bias, pf);
  };
  // Tiles of near-equal height (6 rows: 3 + 3, not 4 + 2), measured faster than full tiles and a remainder.
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t height = M / tiles + (t < M % tiles ? 1 : 0);
    switch (height) {
      case 4: tile(std::integral_constant<int, 4>{}, m); break;
      case 3: tile(std::integral_constant<int, 3>{}, m); break;
      case 2: tile(std::integral_constant<int, 2>{}, m); break;
      default: tile(std::integral_constant<int, 1>{}, m); break;
    }
    m += height;
  }
}

template <class V, int NR, bool Mixed, class Out, class LB>
inline void column_block_of(int64_t width, const typename V::T* x, const bf16* x16, int64_t M, int64_t K,
                            const WeightOf<V>* w, const float* z, const LB* b, int64_t R, int64_t tail, Out* y,
                            int64_t N, const typename V::T* bias, const char* next, const char* end) {
  if constexpr (NR > 1) {
    if (width < NR)
      return column_block_of<V, NR - 1, Mixed>(width, x, x16, M, K, w, z, b, R, tail, y, N, bias, next, end);
  }
  column_block<V, NR, Mixed>(x, x16, M, K, w, z, b, R, tail, y, N, bias, next, end);
}

// y = x @ wᵀ (+ bias), rows from `tail` on plus z @ bᵀ (z: [M - tail, R] float32, b: [N, R]; none if z is null).
// `Mixed`: rows from `tail` on in bfloat16 (x16: their inputs rounded to bfloat16; b: bfloat16), see
// dot_segment_mixed. `parallel`: split the columns among torch's threads (a small product is faster on the
// calling thread alone: a thread-pool dispatch costs more than the LoRA codes x @ lora_aᵀ themselves).
template <class V, bool Mixed = false, class Out, class LB = typename V::T>
void rows_times_weight(const typename V::T* x, int64_t M, int64_t K, const WeightOf<V>* w, int64_t N, Out* y,
                       const typename V::T* bias, const float* z, const LB* b, int64_t R, int64_t tail,
                       bool parallel = true, const bf16* x16 = nullptr) {
  constexpr int kColumns = V::kColumns;
  if (!z && !Mixed) tail = M;
  const int64_t blocks = (N + kColumns - 1) / kColumns;
  auto run = [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n = blk * kColumns;
      const typename V::T* bn = bias ? bias + n : nullptr;
      const LB* lora = b ? b + n * R : nullptr;
      const int64_t ahead = n + kPrefetchTiles * kColumns;  // the block this one prefetches, as it computes
      const char* next = reinterpret_cast<const char*>(w + std::min<int64_t>(ahead, N) * K);
      const char* end = reinterpret_cast<const char*>(w + std::min<int64_t>(ahead + kColumns, N) * K);
      if (blk + kPrefetchTiles >= b1) end = next;  // that block belongs to the other thread
      if (lora && blk + 1 < b1) {  // and the next block's LoRA rows (a few lines, missed otherwise)
        const char* lines = reinterpret_cast<const char*>(lora + kColumns * R);
        for (int64_t off = 0; off < kColumns * R * int64_t(sizeof(LB)); off += 64) _mm_prefetch(lines + off, _MM_HINT_T0);
      }
      column_block_of<V, kColumns, Mixed>(std::min<int64_t>(kColumns, N - n), x, x16, M, K, w + n * K, z, lora, R,
                                          tail, y + n, N, bn, next, end);
    }
  };
  if (parallel)
    at::parallel_for(0, blocks, 8, run);
  else
    run(0, blocks);
}

// -- the operator ---------------------------------------------------------------------------------

void check_matrix(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous(), "few_row_linear: ", name,
              " must be a contiguous CPU tensor of x's dtype (float32",
#ifdef HF_TIDAR_KERNEL_BF16
              " or bfloat16",
#endif
              "; LoRA factors under float32 may also be float16 in the AVX-512 builds)");
}

// bias's data, checked to be N elements of `dtype` (nullptr without a bias). `op` names the operator in errors.
template <class T>
const T* checked_bias(const std::optional<at::Tensor>& bias, at::ScalarType dtype, int64_t N, const char* op) {
  if (!bias.has_value()) return nullptr;
  check_matrix(*bias, "bias", dtype);
  TORCH_CHECK(bias->numel() == N, op, ": bias must have N elements");
  return bias->data_ptr<T>();
}

// The LoRA rank R, with lora_a checked to be [R, K] and lora_b [N, R] of `dtype` (0 without lora_a).
int64_t checked_lora_rank(const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
                          at::ScalarType dtype, int64_t K, int64_t N, const char* op) {
  if (!lora_a.has_value()) return 0;
  TORCH_CHECK(lora_b.has_value(), op, ": lora_a needs lora_b");
  check_matrix(*lora_a, "lora_a", dtype);
  check_matrix(*lora_b, "lora_b", dtype);
  const int64_t R = lora_a->size(0);
  TORCH_CHECK(lora_a->dim() == 2 && lora_a->size(1) == K && lora_b->dim() == 2 && lora_b->size(0) == N &&
                  lora_b->size(1) == R,
              op, ": lora_a must be [R, K] and lora_b [N, R]");
  return R;
}

// few_row_linear on the set V. CodesV computes the tail's low-rank codes x @ lora_aᵀ: V itself (factors of x's
// dtype), or F32HalfCodes for float16 factors under float32 weights (the same sums as with their values in
// float32, each widened exactly before its FMA, from half the bytes).
template <class V, class CodesV = V>
at::Tensor linear_with_tail(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
                            int64_t tail_start) {
  using T = typename V::T;
  using F = WeightOf<CodesV>;  // the factors' type
  const auto dtype = x.scalar_type();
  check_matrix(weight, "weight", dtype);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const T* bias_data = checked_bias<T>(bias, dtype, N, "few_row_linear");
  const int64_t tail = std::clamp<int64_t>(tail_start, 0, M);
  std::vector<float> z;
  const F* b_data = nullptr;
  const int64_t R =
      tail < M ? checked_lora_rank(lora_a, lora_b, c10::CppTypeToScalarType<F>::value, K, N, "few_row_linear") : 0;
  if (R > 0) {
    z.resize((M - tail) * R);  // the tail rows' low-rank codes x @ lora_aᵀ, in float32
    rows_times_weight<CodesV, false, float, T>(x.data_ptr<T>() + tail * K, M - tail, K, lora_a->data_ptr<F>(), R,
                                               z.data(), nullptr, nullptr, nullptr, 0, M - tail, /*parallel=*/false);
    b_data = lora_b->data_ptr<F>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  rows_times_weight<V, false, T, F>(x.data_ptr<T>(), M, K, weight.data_ptr<T>(), N, y.data_ptr<T>(), bias_data,
                                    z.empty() ? nullptr : z.data(), b_data, R, tail);
  return y;
}

#ifdef HF_TIDAR_KERNEL_BF16
// few_row_linear for float32 x and weight whose rows from tail_start on are drafts: those rows are multiplied
// in bfloat16 (inputs and weights rounded to bfloat16, float32 sums; lora_a and lora_b, if given, bfloat16).
// Rows before tail_start are bit for bit few_row_linear's.
at::Tensor few_row_linear_bf16_tail(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                    const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
                                    int64_t tail_start) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "few_row_linear_bf16_tail: x must be [M, K] and weight [N, K]");
  check_matrix(x, "x", at::kFloat);
  check_matrix(weight, "weight", at::kFloat);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const char* op = "few_row_linear_bf16_tail";
  const float* bias_data = checked_bias<float>(bias, at::kFloat, N, op);
  const int64_t tail = std::clamp<int64_t>(tail_start, 0, M);
  const float* xs = x.data_ptr<float>();
  std::vector<bf16> x16((M - tail) * K);
  for (int64_t i = 0; i < (M - tail) * K; ++i) x16[i] = bf16(xs[tail * K + i]);
  std::vector<float> z;
  const bf16* b_data = nullptr;
  const int64_t R = tail < M ? checked_lora_rank(lora_a, lora_b, at::kBFloat16, K, N, op) : 0;
  if (R > 0) {
    z.resize((M - tail) * R);
    rows_times_weight<Avx512Bf16, false, float, bf16>(x16.data(), M - tail, K, lora_a->data_ptr<bf16>(), R, z.data(),
                                                      nullptr, nullptr, nullptr, 0, M - tail, /*parallel=*/false);
    b_data = lora_b->data_ptr<bf16>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  rows_times_weight<F32, true, float, bf16>(xs, M, K, weight.data_ptr<float>(), N, y.data_ptr<float>(), bias_data,
                                            z.empty() ? nullptr : z.data(), b_data, R, tail, true, x16.data());
  return y;
}
#endif

at::Tensor few_row_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
                          int64_t tail_start) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "few_row_linear: x must be [M, K] and weight [N, K]");
  if (x.scalar_type() == at::kFloat || !x.is_cpu()) {
    check_matrix(x, "x", at::kFloat);
    if (lora_a.has_value() && lora_a->scalar_type() == at::kHalf) {
#ifdef HF_TIDAR_KERNEL_HALF_FACTORS
      return linear_with_tail<F32, F32HalfCodes>(x, weight, bias, lora_a, lora_b, tail_start);
#else
      TORCH_CHECK(false, "few_row_linear: float16 LoRA factors need the kernel's AVX-512 build");
#endif
    }
    return linear_with_tail<F32>(x, weight, bias, lora_a, lora_b, tail_start);
  }
#ifdef HF_TIDAR_KERNEL_BF16
  check_matrix(x, "x", at::kBFloat16);
  return linear_with_tail<Avx512Bf16>(x, weight, bias, lora_a, lora_b, tail_start);
#else
  check_matrix(x, "x", at::kFloat);
  return x;  // not reached: the check above fails
#endif
}

// The instruction set this build uses ("avx2", "avx512" or "avx512_bf16").
std::string few_row_isa() { return HF_TIDAR_KERNEL_ISA; }

// Whether few_row_linear takes float16 LoRA factors under float32 weights (the AVX-512 builds).
bool few_row_half_factors() {
#ifdef HF_TIDAR_KERNEL_HALF_FACTORS
  return true;
#else
  return false;
#endif
}

}  // namespace

// TORCH_LIBRARY stringifies its first argument: one more macro level expands the library's name first.
#define HF_TIDAR_DEFINE_LIBRARY(name, m) TORCH_LIBRARY(name, m)
HF_TIDAR_DEFINE_LIBRARY(HF_TIDAR_KERNEL_LIBRARY, m) {
  m.def("few_row_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? lora_a, Tensor? lora_b, int tail_start)"
        " -> Tensor",
        &few_row_linear);
#ifdef HF_TIDAR_KERNEL_BF16
  m.def("few_row_linear_bf16_tail(Tensor x, Tensor weight, Tensor? bias, Tensor? lora_a, Tensor? lora_b, "
        "int tail_start) -> Tensor",
        &few_row_linear_bf16_tail);
#endif
  m.def("few_row_isa() -> str", &few_row_isa);
  m.def("few_row_half_factors() -> bool", &few_row_half_factors);
}
