// Float math on vectors (GCC vector extensions), shared by the CPU kernels. GCC 12 does not
// vectorize a loop whose exp builds 2^n through a scalar bit cast, so the kernels call exp
// on whole vectors here instead.
//
// Two vector types: Lanes, 16 floats whatever the target (one AVX-512 register, two AVX2
// ones), and Vec, the target's own register width (16 floats with AVX-512, 8 with AVX2, 4
// elsewhere). Without AVX-512, GCC 12 handles 64-byte vectors poorly: a comparison becomes
// 16 scalar compares and branches, a broadcast goes through the stack lane by lane, and
// values cross between general and vector registers (measured on an AVX2 build: exp_lanes
// and the decode kernel 4x slower, a Lanes-based span kernel 30x slower than on Vec). So
// kernels written for speed on every target use Vec; comparisons of Lanes go through the
// where_less / lane_max / lane_min overloads below, which compare 256-bit halves with
// intrinsics on AVX2.
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace loragate_cpu {

using Lanes = float __attribute__((vector_size(64)));
using LaneInts = int32_t __attribute__((vector_size(64)));

#if defined(__AVX512F__)
#define LORAGATE_VEC_WIDTH 16
#elif defined(__AVX2__)
#define LORAGATE_VEC_WIDTH 8
#else
#define LORAGATE_VEC_WIDTH 4
#endif
constexpr int kVecWidth = LORAGATE_VEC_WIDTH;
using Vec = float __attribute__((vector_size(4 * kVecWidth)));
using VecInts = int32_t __attribute__((vector_size(4 * kVecWidth)));

inline Lanes load_lanes(const float* p) {
  Lanes a;
  std::memcpy(&a, p, sizeof(Lanes));
  return a;
}

inline void store_lanes(float* p, Lanes a) { std::memcpy(p, &a, sizeof(Lanes)); }

inline Vec load_vec(const float* p) {
  Vec a;
  std::memcpy(&a, p, sizeof(Vec));
  return a;
}

inline void store_vec(float* p, Vec a) { std::memcpy(p, &a, sizeof(Vec)); }

// Lane i: a[i] < b[i] ? x[i] : y[i]; the lane-wise max and min.
template <typename V>
inline V where_less(V a, V b, V x, V y) { return a < b ? x : y; }

template <typename V>
inline V lane_max(V a, V b) { return a < b ? b : a; }

template <typename V>
inline V lane_min(V a, V b) { return a < b ? a : b; }

#if defined(__AVX2__) && !defined(__AVX512F__)
struct LaneHalves {
  __m256 lo, hi;
};

inline LaneHalves halves(Lanes a) {
  LaneHalves h;
  std::memcpy(&h, &a, sizeof(Lanes));
  return h;
}

inline Lanes joined(__m256 lo, __m256 hi) {
  const LaneHalves h{lo, hi};
  Lanes a;
  std::memcpy(&a, &h, sizeof(Lanes));
  return a;
}

inline Lanes where_less(Lanes a, Lanes b, Lanes x, Lanes y) {
  const LaneHalves ah = halves(a), bh = halves(b), xh = halves(x), yh = halves(y);
  return joined(_mm256_blendv_ps(yh.lo, xh.lo, _mm256_cmp_ps(ah.lo, bh.lo, _CMP_LT_OQ)),
                _mm256_blendv_ps(yh.hi, xh.hi, _mm256_cmp_ps(ah.hi, bh.hi, _CMP_LT_OQ)));
}

inline Lanes lane_max(Lanes a, Lanes b) {
  const LaneHalves ah = halves(a), bh = halves(b);
  return joined(_mm256_max_ps(ah.lo, bh.lo), _mm256_max_ps(ah.hi, bh.hi));
}

inline Lanes lane_min(Lanes a, Lanes b) {
  const LaneHalves ah = halves(a), bh = halves(b);
  return joined(_mm256_min_ps(ah.lo, bh.lo), _mm256_min_ps(ah.hi, bh.hi));
}
#endif

// exp of every lane, inputs clamped to [-87, 88] (float's normal range: exp(-87) ~ 1.6e-38):
// x = n ln2 + r, |r| <= ln2 / 2, exp(r) by the degree-6 Cephes polynomial (relative error
// ~2e-7), times 2^n built in the exponent bits. V: Lanes or Vec.
template <typename V>
inline V exp_vec(V x) {
  using Ints = decltype(x < x);
  x = lane_min(lane_max(x, V{} - 87.0f), V{} + 88.0f);
  const V t = x * 1.44269504088896341f;
  const V half = where_less(t, V{}, V{} - 0.5f, V{} + 0.5f);
  const Ints n = __builtin_convertvector(t + half, Ints);  // round to nearest
  const V fn = __builtin_convertvector(n, V);
  V r = x - fn * 0.693359375f;
  r = r + fn * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * reinterpret_cast<V>((n + 127) << 23);  // same-size vectors: the bits as floats
}

inline Lanes exp_lanes(Lanes x) { return exp_vec(x); }

// exp of one float, by exp_vec (for the few scalars outside vector loops).
inline float exp_scalar(float x) { return exp_vec(Vec{} + x)[0]; }

}  // namespace loragate_cpu
