// Element-wise float32 functions shared by the operator library's sources: plain arithmetic, so that a loop over
// them vectorises (`#pragma omp simd`) and every element gets the same operations.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace hf_tidar_cpu {

// e^x for x <= 0 (a softmax's shifted scores, a sigmoid's e^-|x|), float32, about 2 ulp: the exponent's integer part
// goes into the float's exponent bits, the rest through a degree-6 polynomial; below -87 it returns 0.
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

// silu(x) = x / (1 + e^-x), with e^-|x| only (no overflow): x / (1 + e) for x >= 0, x * e / (1 + e) below.
inline float silu(float x) {
  const float e = exp_nonpositive(x < 0.0f ? x : -x);
  return x >= 0.0f ? x / (1.0f + e) : x * e / (1.0f + e);
}

}  // namespace hf_tidar_cpu
