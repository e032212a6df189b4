// Float math on vectors of the target's own register width (GCC vector extensions): Vec is
// 16 floats with AVX-512, 8 with AVX2, 4 elsewhere; the kernels are written in it. Not a fixed
// 16-float type: without AVX-512, GCC 12 compiles one badly (a comparison becomes 16 scalar
// compares and branches, a broadcast goes through the stack lane by lane; measured on an AVX2
// build, the decode kernel in 16-float vectors ran 3-4x slower than in Vec). GCC 12 does not vectorize a loop whose exp builds 2^n through a scalar bit cast, so
// the kernels call exp on whole vectors here instead.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace loragate_cpu {

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

inline Vec load_vec(const float* p) {
  Vec a;
  std::memcpy(&a, p, sizeof(Vec));
  return a;
}

inline void store_vec(float* p, Vec a) { std::memcpy(p, &a, sizeof(Vec)); }

// x in every lane. Not Vec{} + x: adding 0.0f is not a no-op (it turns -0.0f into +0.0f),
// so the compiler keeps that add, a scalar add and a register broadcast in the innermost
// loops where a broadcast load would do; x - 0.0f is x for every x, and folds away.
inline Vec splat(float x) { return x - Vec{}; }

// bfloat16 (the top half of a float's bits), passed as raw uint16_t: kW of them widen to a
// Vec exactly (zero low bits), and a Vec narrows with round-to-nearest-even as torch's
// conversion rounds (NaN stays a quiet NaN). One vector load and a shift or an add and a
// shift per kW values, where converting element by element through c10::BFloat16 left the
// loops scalar.
using Bf16Vec = uint16_t __attribute__((vector_size(2 * kVecWidth)));
using VecUints = uint32_t __attribute__((vector_size(4 * kVecWidth)));

inline Vec widen_bf16(Bf16Vec h) {
  return reinterpret_cast<Vec>(__builtin_convertvector(h, VecUints) << 16);
}

inline Vec load_vec(const uint16_t* p) {
  Bf16Vec h;
  std::memcpy(&h, p, sizeof(Bf16Vec));
  return widen_bf16(h);
}

inline Bf16Vec narrow_bf16(Vec a) {
  const VecUints bits = reinterpret_cast<VecUints>(a);
  const VecUints rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const VecUints nan = VecUints{} + 0x7FC0u;
  return __builtin_convertvector(a != a ? nan : rounded, Bf16Vec);
}

inline void store_vec(uint16_t* p, Vec a) {
  const Bf16Vec h = narrow_bf16(a);
  std::memcpy(p, &h, sizeof(Bf16Vec));
}

// 2 * kW bfloat16 values read as kW 32-bit words: the even-indexed values (each word's low
// half, shifted up) and the odd-indexed ones (its high half, low bits cleared). Unlike
// widening kW values in order, this needs no lane shuffle, whose single port the
// kernels' transposes and reductions already keep busy; a dot product or a weighted sum
// of rows does not care about the order of its lanes, as long as the other operand is
// split alike (pair_split) and the result put back (pair_join).
inline void load_bf16_pairs(const uint16_t* p, Vec& even, Vec& odd) {
  VecUints words;
  std::memcpy(&words, p, sizeof(VecUints));
  even = reinterpret_cast<Vec>(words << 16);
  odd = reinterpret_cast<Vec>(words & 0xFFFF0000u);
}

// x [n] (n a multiple of 2 * kW) reordered in place as load_bf16_pairs splits a row: per
// 2 * kW values, the kW even-indexed ones, then the kW odd-indexed ones; pair_join undoes it.
inline void pair_split(float* x, int64_t n) {
  float tmp[2 * kVecWidth];
  for (int64_t base = 0; base < n; base += 2 * kVecWidth) {
    for (int i = 0; i < kVecWidth; ++i) {
      tmp[i] = x[base + 2 * i];
      tmp[kVecWidth + i] = x[base + 2 * i + 1];
    }
    std::memcpy(x + base, tmp, sizeof(tmp));
  }
}

inline void pair_join(float* x, int64_t n) {
  float tmp[2 * kVecWidth];
  for (int64_t base = 0; base < n; base += 2 * kVecWidth) {
    for (int i = 0; i < kVecWidth; ++i) {
      tmp[2 * i] = x[base + i];
      tmp[2 * i + 1] = x[base + kVecWidth + i];
    }
    std::memcpy(x + base, tmp, sizeof(tmp));
  }
}

// a rounded to bfloat16 and back: the value an eager bf16 op would have stored.
inline Vec round_bf16(Vec a) { return widen_bf16(narrow_bf16(a)); }

// The first n (< kW) lanes of p, the rest 0; and the first n lanes of a into p.
template <typename T>
inline Vec load_partial(const T* p, int64_t n) {
  T tmp[kVecWidth] = {};
  std::memcpy(tmp, p, sizeof(T) * n);
  return load_vec(tmp);
}

template <typename T>
inline void store_partial(T* p, Vec a, int64_t n) {
  T tmp[kVecWidth];
  store_vec(tmp, a);
  std::memcpy(p, tmp, sizeof(T) * n);
}

// Lane i: a[i] < b[i] ? x[i] : y[i]; the lane-wise max and min.
inline Vec where_less(Vec a, Vec b, Vec x, Vec y) { return a < b ? x : y; }

inline Vec lane_max(Vec a, Vec b) { return a < b ? b : a; }

inline Vec lane_min(Vec a, Vec b) { return a < b ? a : b; }

// exp of every lane, inputs clamped to [-87, 88] (float's normal range: exp(-87) ~ 1.6e-38):
// x = n ln2 + r, |r| <= ln2 / 2, exp(r) by the degree-6 Cephes polynomial (relative error
// ~2e-7), times 2^n built in the exponent bits.
inline Vec exp_vec(Vec x) {
  using V = Vec;
  using Ints = VecInts;
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

// Shuffle masks, constants (built at run time they cost about a quarter of the kernel
// time): kFirst/kSecond b swap the off-diagonal b x b sub-blocks of every 2b x 2b block of a
// kVecWidth x kVecWidth tile (a transpose in log2(kVecWidth) stages); kSwap b pairs lane j with lane j ^ b (the
// halving steps of a reduction).
#if LORAGATE_VEC_WIDTH == 16
constexpr VecInts kFirst8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
constexpr VecInts kSecond8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
constexpr VecInts kSwap8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
constexpr VecInts kFirst4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
constexpr VecInts kSecond4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
constexpr VecInts kSwap4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
constexpr VecInts kFirst2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
constexpr VecInts kSecond2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
constexpr VecInts kSwap2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
constexpr VecInts kFirst1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
constexpr VecInts kSecond1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
constexpr VecInts kSwap1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
#elif LORAGATE_VEC_WIDTH == 8
constexpr VecInts kFirst4 = {0, 1, 2, 3, 8, 9, 10, 11};
constexpr VecInts kSecond4 = {4, 5, 6, 7, 12, 13, 14, 15};
constexpr VecInts kSwap4 = {4, 5, 6, 7, 0, 1, 2, 3};
constexpr VecInts kFirst2 = {0, 1, 8, 9, 4, 5, 12, 13};
constexpr VecInts kSecond2 = {2, 3, 10, 11, 6, 7, 14, 15};
constexpr VecInts kSwap2 = {2, 3, 0, 1, 6, 7, 4, 5};
constexpr VecInts kFirst1 = {0, 8, 2, 10, 4, 12, 6, 14};
constexpr VecInts kSecond1 = {1, 9, 3, 11, 5, 13, 7, 15};
constexpr VecInts kSwap1 = {1, 0, 3, 2, 5, 4, 7, 6};
#else
constexpr VecInts kFirst2 = {0, 1, 4, 5};
constexpr VecInts kSecond2 = {2, 3, 6, 7};
constexpr VecInts kSwap2 = {2, 3, 0, 1};
constexpr VecInts kFirst1 = {0, 4, 2, 6};
constexpr VecInts kSecond1 = {1, 5, 3, 7};
constexpr VecInts kSwap1 = {1, 0, 3, 2};
#endif

// step(b, kFirst b, kSecond b, kSwap b) for b = kVecWidth / 2, ..., 2, 1 (b as an
// std::integral_constant): the stages of a transpose or of a halving reduction.
template <typename Step>
inline void each_stage(Step step) {
#if LORAGATE_VEC_WIDTH >= 16
  step(std::integral_constant<int, 8>{}, kFirst8, kSecond8, kSwap8);
#endif
#if LORAGATE_VEC_WIDTH >= 8
  step(std::integral_constant<int, 4>{}, kFirst4, kSecond4, kSwap4);
#endif
  step(std::integral_constant<int, 2>{}, kFirst2, kSecond2, kSwap2);
  step(std::integral_constant<int, 1>{}, kFirst1, kSecond1, kSwap1);
}

// r transposed in place (kVecWidth x kVecWidth floats).
inline void transpose_tile(Vec (&r)[kVecWidth]) {
  each_stage([&](auto b, VecInts first, VecInts second, VecInts) {
    for (int i = 0; i < kVecWidth; ++i) {
      if ((i & b) != 0) continue;
      const Vec x = r[i], y = r[i + b];
      r[i] = __builtin_shuffle(x, y, first);
      r[i + b] = __builtin_shuffle(x, y, second);
    }
  });
}

// Lane i of the result is the sum of v[i]'s lanes: kVecWidth dot products finished at once
// by the transpose's stages with adds (each stage halves the vectors) instead of a halving
// reduction per vector.
inline Vec transpose_sum(Vec (&v)[kVecWidth]) {
  each_stage([&](auto b, VecInts first, VecInts second, VecInts) {
    for (int i = 0; i < b; ++i)
      v[i] = __builtin_shuffle(v[i], v[i + b], first) + __builtin_shuffle(v[i], v[i + b], second);
  });
  return v[0];
}

// The largest and the sum of x's lanes, by halving shuffles.
inline float max_of(Vec x) {
  each_stage([&](auto, VecInts, VecInts, VecInts swap) {
    x = lane_max(x, __builtin_shuffle(x, swap));
  });
  return x[0];
}

inline float sum_of(Vec x) {
  each_stage([&](auto, VecInts, VecInts, VecInts swap) { x += __builtin_shuffle(x, swap); });
  return x[0];
}

// exp of one float, by exp_vec (for the few scalars outside vector loops).
inline float exp_scalar(float x) { return exp_vec(splat(x))[0]; }

}  // namespace loragate_cpu
