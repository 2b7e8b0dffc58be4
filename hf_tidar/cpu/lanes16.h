// Sixteen float32 lanes for the column-packed products (packed_rows.cpp): one AVX-512 register, or two AVX2 registers
// side by side on a CPU without AVX-512. A column block of the packed layout is 16 outputs wide on every build, so the
// packed tensors, and every lane's operations in order (fused multiply-adds, the same exp), are the same on both:
// a lane gets the same bits from either build.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "vector_math.h"

namespace hf_tidar_cpu {

#ifdef __AVX512F__

using Lanes16 = __m512;
using Keep16 = __mmask16;  // which lanes a partial load or store touches

inline Lanes16 lanes_zero() { return _mm512_setzero_ps(); }
inline Lanes16 lanes_set1(float v) { return _mm512_set1_ps(v); }
inline Lanes16 lanes_load(const float* p) { return _mm512_loadu_ps(p); }
inline Lanes16 lanes_load_half(const void* p) {  // 16 float16 values widened exactly
  return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
}
inline Lanes16 lanes_load_bfloat16(const void* p) {  // a bfloat16 is a float32's top half: widened by a shift
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void lanes_store(float* p, Lanes16 v) { _mm512_storeu_ps(p, v); }
inline Lanes16 lanes_fmadd(Lanes16 a, Lanes16 b, Lanes16 c) { return _mm512_fmadd_ps(a, b, c); }
inline Lanes16 lanes_add(Lanes16 a, Lanes16 b) { return _mm512_add_ps(a, b); }
inline Lanes16 lanes_mul(Lanes16 a, Lanes16 b) { return _mm512_mul_ps(a, b); }
inline Keep16 lanes_first(int64_t n) { return n >= 16 ? Keep16(0xFFFF) : Keep16((1u << n) - 1); }
inline Lanes16 lanes_load_kept(const float* p, Keep16 keep) { return _mm512_maskz_loadu_ps(keep, p); }
inline void lanes_store_kept(float* p, Keep16 keep, Lanes16 v) { _mm512_mask_storeu_ps(p, keep, v); }

// S consecutive floats at x repeated across the lanes (lane j: x[j % S]); loads only, no shuffle port.
template <int S>
inline Lanes16 lanes_repeat(const float* x) {
  if constexpr (S == 1) {
    return _mm512_set1_ps(*x);
  } else if constexpr (S == 2) {
    double pair;
    std::memcpy(&pair, x, sizeof pair);
    return _mm512_castpd_ps(_mm512_set1_pd(pair));
  } else if constexpr (S == 4) {
    return _mm512_broadcast_f32x4(_mm_loadu_ps(x));
  } else if constexpr (S == 8) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(reinterpret_cast<const double*>(x))));
  } else {
    return _mm512_loadu_ps(x);
  }
}

// silu(x) = x / (1 + e^-|x|) (times e^-|x| above for x < 0), e^-|x| by exp16_nonpositive (vector_math.h): every
// element takes the same operations, whatever the row count.
inline Lanes16 lanes_silu(Lanes16 x) {
  const __m512 t = _mm512_castsi512_ps(  // -|x| (the sign bit set; integer arithmetic: no AVX-512 DQ needed)
      _mm512_or_si512(_mm512_castps_si512(x), _mm512_set1_epi32(int32_t(0x80000000u))));
  const __m512 e = exp16_nonpositive(t);
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 numerator = _mm512_mask_mul_ps(x, negative, x, e);  // x, or x * e where x < 0
  return _mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

struct Lanes16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
struct Keep16 {
  __m256i lo, hi;  // all ones in the lanes kept
};

inline Lanes16 lanes_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Lanes16 lanes_set1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline Lanes16 lanes_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Lanes16 lanes_load_half(const void* p) {
  const auto* h = static_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(h)), _mm256_cvtph_ps(_mm_loadu_si128(h + 1))};
}
inline Lanes16 lanes_load_bfloat16(const void* p) {
  const auto* h = static_cast<const __m128i*>(p);
  const auto widen = [](__m128i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)); };
  return {widen(_mm_loadu_si128(h)), widen(_mm_loadu_si128(h + 1))};
}
inline void lanes_store(float* p, Lanes16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline Lanes16 lanes_fmadd(Lanes16 a, Lanes16 b, Lanes16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Lanes16 lanes_add(Lanes16 a, Lanes16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Lanes16 lanes_mul(Lanes16 a, Lanes16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Keep16 lanes_first(int64_t n) {
  const __m256i count = _mm256_set1_epi32(int(n < 16 ? n : 16));
  return {_mm256_cmpgt_epi32(count, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
          _mm256_cmpgt_epi32(count, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15))};
}
inline Lanes16 lanes_load_kept(const float* p, Keep16 keep) {  // lanes not kept read nothing (no fault) and are 0
  return {_mm256_maskload_ps(p, keep.lo), _mm256_maskload_ps(p + 8, keep.hi)};
}
inline void lanes_store_kept(float* p, Keep16 keep, Lanes16 v) {
  _mm256_maskstore_ps(p, keep.lo, v.lo);
  _mm256_maskstore_ps(p + 8, keep.hi, v.hi);
}

// The sum of the 16 lanes by halves, as row_attention.cpp's sum16 adds them: a_i = v_i + v_(i+8), b_i = a_i + a_(i+4),
// then (b_0 + b_2) + (b_1 + b_3). (The AVX-512 build sums 16 keys' lanes at once there, sum16_each.)
inline float lanes_sum(Lanes16 v) {
  const __m256 a = _mm256_add_ps(v.lo, v.hi);
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

template <int S>
inline Lanes16 lanes_repeat(const float* x) {
  if constexpr (S == 1) {
    return lanes_set1(*x);
  } else if constexpr (S == 2) {
    double pair;
    std::memcpy(&pair, x, sizeof pair);
    const __m256 v = _mm256_castpd_ps(_mm256_set1_pd(pair));
    return {v, v};
  } else if constexpr (S == 4) {
    const __m256 v = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(x));
    return {v, v};
  } else if constexpr (S == 8) {
    const __m256 v = _mm256_loadu_ps(x);
    return {v, v};
  } else {
    return lanes_load(x);
  }
}

// exp_nonpositive (vector_math.h) on 8 lanes, as exp16_nonpositive does it on 16: the same operations in order.
inline __m256 exp8_nonpositive(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(kExpLowest);
  const __m256 clamped = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(kLog2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), clamped);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kExpPolynomial[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPolynomial[i]));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i scaled = _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23));
  const __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  return _mm256_andnot_ps(underflow, _mm256_castsi256_ps(scaled));
}

inline __m256 silu8(__m256 x) {
  const __m256 t = _mm256_or_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(int32_t(0x80000000u))));  // -|x|
  const __m256 e = exp8_nonpositive(t);
  const __m256 negative = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 numerator = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), negative);
  return _mm256_div_ps(numerator, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}
inline Lanes16 lanes_silu(Lanes16 x) { return {silu8(x.lo), silu8(x.hi)}; }

#endif

}  // namespace hf_tidar_cpu
