// Float math on 16-lane vectors (GCC vector extensions: one AVX-512 register or two AVX2
// ones), shared by the CPU kernels. GCC 12 does not vectorize a loop whose exp builds 2^n
// through a scalar bit cast, so the kernels call exp on whole vectors here instead.
#pragma once

#include <cstdint>
#include <cstring>

namespace loragate_cpu {

using Lanes = float __attribute__((vector_size(64)));
using LaneInts = int32_t __attribute__((vector_size(64)));

inline Lanes load_lanes(const float* p) {
  Lanes a;
  std::memcpy(&a, p, sizeof(Lanes));
  return a;
}

inline void store_lanes(float* p, Lanes a) { std::memcpy(p, &a, sizeof(Lanes)); }

// exp of every lane, inputs clamped to [-87, 88] (float's normal range: exp(-87) ~ 1.6e-38):
// x = n ln2 + r, |r| <= ln2 / 2, exp(r) by the degree-6 Cephes polynomial (relative error
// ~2e-7), times 2^n built in the exponent bits.
inline Lanes exp_lanes(Lanes x) {
  const Lanes lo = Lanes{} - 87.0f, hi = Lanes{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const Lanes t = x * 1.44269504088896341f;
  const Lanes half = t < 0.0f ? Lanes{} - 0.5f : Lanes{} + 0.5f;
  const LaneInts n = __builtin_convertvector(t + half, LaneInts);  // round to nearest
  const Lanes fn = __builtin_convertvector(n, Lanes);
  Lanes r = x - fn * 0.693359375f;
  r = r + fn * 2.12194440e-4f;
  Lanes p = Lanes{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * reinterpret_cast<Lanes>((n + 127) << 23);  // same-size vectors: the bits as floats
}

// exp of one float, by exp_lanes (for the few scalars outside vector loops).
inline float exp_scalar(float x) { return exp_lanes(Lanes{} + x)[0]; }

}  // namespace loragate_cpu
