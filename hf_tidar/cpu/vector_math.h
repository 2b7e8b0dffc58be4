// Element-wise float32 functions shared by the operator library's sources: plain arithmetic, so that a loop over
// them vectorises (`#pragma omp simd`) and every element gets the same operations.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace hf_tidar_cpu {

// exp_nonpositive's constants, shared with the 16-lane silu of packed_rows.cpp (the same steps as AVX-512 operations).
constexpr float kExpLowest = -87.0f;  // below it e^x underflows: 0
constexpr float kLog2E = 1.44269504088896341f;
constexpr float kLn2High = 0.693145751953125f, kLn2Low = 1.428606765330187e-06f;  // ln 2 in two parts
constexpr float kExpPolynomial[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                     4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// e^x for x <= 0 (a softmax's shifted scores, a sigmoid's e^-|x|), float32, about 2 ulp: the exponent's integer part
// goes into the float's exponent bits, the rest through a degree-6 polynomial; below -87 it returns 0.
inline float exp_nonpositive(float x) {
  const float clamped = x < kExpLowest ? kExpLowest : x;
  const float n = std::nearbyint(clamped * kLog2E);
  const float r = (clamped - n * kLn2High) - n * kLn2Low;
  float p = kExpPolynomial[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPolynomial[i];
  p = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return x < kExpLowest ? 0.0f : out;
}

#ifdef __AVX512F__
// exp_nonpositive on 16 lanes (x <= 0), its steps as explicit AVX-512 operations: left to the compiler, a loop of the
// scalar function ran at 1.4-1.7 ns an element (a gated MLP's silus, a softmax over a pass's keys). The multiply-adds
// are the ones GCC contracts the scalar function's into, so a lane gets the scalar function's bits.
inline __m512 exp16_nonpositive(__m512 x) {
  const __m512 lowest = _mm512_set1_ps(kExpLowest);
  const __m512 clamped = _mm512_max_ps(x, lowest);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(kLog2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), clamped);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpPolynomial[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPolynomial[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i scaled = _mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23));
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lowest, _CMP_LT_OQ);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), _mm512_castsi512_ps(scaled));
}
#endif

}  // namespace hf_tidar_cpu
