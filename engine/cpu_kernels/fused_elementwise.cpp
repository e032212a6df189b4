// Fused element-wise ops of a Llama-family decoder layer, one pass over memory each where
// eager torch runs several ops (and allocates their intermediates):
//
//   rms_norm(x, w, eps)              out = w * dtype(x_f / sqrt(mean(x_f^2) + eps))
//   add_rms_norm(x, residual, w, eps)  sum = dtype(x + residual); (rms_norm(sum), sum)
//   rotary_(q, k, cos, sin)          in place, rotate-half (GPT-NeoX) rope:
//                                    x' = x * cos + rotate_half(x) * sin,
//                                    rotate_half(x) = cat(-x[D/2:], x[:D/2])
//   silu_and_mul(gate_up)            silu(gate_up[:, :I]) * gate_up[:, I:]
//
// The semantics are those of engine/models/llama.py's eager path (transformers' Llama):
// RMSNorm in float32, cast to the input dtype before the weight; every other product and sum
// rounded to the input dtype as the eager ops round them. Arithmetic in float32.
//
// Shapes and dtypes: x, residual, out [T, N] with contiguous rows (any row stride), weight
// [N]; q [T, H, D] and k [T, Hkv, D] with contiguous head vectors (views into the fused QKV
// output are fine), cos and sin [T, D] or [T, 1, D]; gate_up [T, 2I] -> [T, I]. float32,
// bfloat16 or float16, all operands alike (float32 and bfloat16 in vectors, float16 element
// by element). Rows are spread over torch's threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "vec_math.h"

namespace {

using loragate_cpu::exp_vec;
using loragate_cpu::load_vec;
using loragate_cpu::store_vec;
using loragate_cpu::Vec;
constexpr int kW = loragate_cpu::kVecWidth;

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// Rows per parallel chunk: enough elements that a chunk outweighs handing it to a thread.
inline int64_t row_grain(int64_t row_elems) {
  constexpr int64_t kElemsPerChunk = 16384;
  return std::max<int64_t>(1, kElemsPerChunk / std::max<int64_t>(row_elems, 1));
}

// float32 and bfloat16 rows go a vector (kW elements) at a time, read and written as
// storage_t (float, or bfloat16's raw bits widened and narrowed by vec_math.h); float16
// goes element by element (torch's conversions).
template <typename scalar_t>
struct Storage {
  using type = void;
};
template <>
struct Storage<float> {
  using type = float;
};
template <>
struct Storage<c10::BFloat16> {
  using type = uint16_t;
};
template <typename scalar_t>
constexpr bool kVectorRows = !std::is_void_v<typename Storage<scalar_t>::type>;

// x rounded to the storage dtype and back (the value an eager op would have stored).
template <typename storage_t>
inline Vec rounded(Vec x) {
  if constexpr (std::is_same_v<storage_t, float>) {
    return x;
  } else {
    return loragate_cpu::round_bf16(x);
  }
}

// f(i0, m) for each vector of a row of n: i0 the first element, m (<= kW) how many.
template <typename F>
inline void each_vector(int64_t n, F f) {
  for (int64_t i0 = 0; i0 < n; i0 += kW) f(i0, std::min<int64_t>(kW, n - i0));
}

template <typename T>
inline Vec load_n(const T* p, int64_t m) {
  return m == kW ? load_vec(p) : loragate_cpu::load_partial(p, m);
}

template <typename T>
inline void store_n(T* p, Vec a, int64_t m) {
  if (m == kW) {
    store_vec(p, a);
  } else {
    loragate_cpu::store_partial(p, a, m);
  }
}

template <typename scalar_t>
void norm_row(const scalar_t* x_in, const scalar_t* w_in, scalar_t* out_in, int64_t n,
              float eps) {
  if constexpr (kVectorRows<scalar_t>) {
    using storage_t = typename Storage<scalar_t>::type;
    const auto* x = reinterpret_cast<const storage_t*>(x_in);
    const auto* w = reinterpret_cast<const storage_t*>(w_in);
    auto* out = reinterpret_cast<storage_t*>(out_in);
    Vec squares = {};
    each_vector(n, [&](int64_t i0, int64_t m) {
      const Vec v = load_n(x + i0, m);
      squares += v * v;
    });
    const float inv = 1.0f / std::sqrt(loragate_cpu::sum_of(squares) / static_cast<float>(n)
                                       + eps);
    each_vector(n, [&](int64_t i0, int64_t m) {
      const Vec normed = rounded<storage_t>(load_n(x + i0, m) * inv);
      store_n(out + i0, load_n(w + i0, m) * normed, m);
    });
  } else {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += to_float(x_in[i]) * to_float(x_in[i]);
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) {
      const scalar_t normed = static_cast<scalar_t>(to_float(x_in[i]) * inv);
      out_in[i] = static_cast<scalar_t>(to_float(w_in[i]) * to_float(normed));
    }
  }
}

template <typename scalar_t>
void add_rows(const scalar_t* x, const scalar_t* residual, scalar_t* sum, int64_t n) {
  if constexpr (kVectorRows<scalar_t>) {
    using storage_t = typename Storage<scalar_t>::type;
    const auto* a = reinterpret_cast<const storage_t*>(x);
    const auto* b = reinterpret_cast<const storage_t*>(residual);
    auto* c = reinterpret_cast<storage_t*>(sum);
    each_vector(n, [&](int64_t i0, int64_t m) {
      store_n(c + i0, load_n(a + i0, m) + load_n(b + i0, m), m);
    });
  } else {
    for (int64_t i = 0; i < n; ++i) {
      sum[i] = static_cast<scalar_t>(to_float(x[i]) + to_float(residual[i]));
    }
  }
}

template <typename scalar_t>
void silu_mul_row(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t n) {
  if constexpr (kVectorRows<scalar_t>) {
    using storage_t = typename Storage<scalar_t>::type;
    const auto* g = reinterpret_cast<const storage_t*>(gate);
    const auto* u = reinterpret_cast<const storage_t*>(up);
    auto* o = reinterpret_cast<storage_t*>(out);
    each_vector(n, [&](int64_t i0, int64_t m) {
      const Vec gv = load_n(g + i0, m);
      // silu rounded to the dtype before the product, as the eager ops round it.
      const Vec act = rounded<storage_t>(gv / (1.0f + exp_vec(-gv)));
      store_n(o + i0, act * load_n(u + i0, m), m);
    });
  } else {
    each_vector(n, [&](int64_t i0, int64_t m) {
      Vec g = {};
      for (int64_t i = 0; i < m; ++i) g[i] = to_float(gate[i0 + i]);
      const Vec act = g / (1.0f + exp_vec(-g));
      for (int64_t i = 0; i < m; ++i) {
        const scalar_t a = static_cast<scalar_t>(act[i]);
        out[i0 + i] = static_cast<scalar_t>(to_float(a) * to_float(up[i0 + i]));
      }
    });
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [T, N] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), op,
              ": weight must be a contiguous [N]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": x and weight must share a dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(n), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        norm_row(xp + r * stride, wp, op + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 &&
                  residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must be like x");
  const int64_t rows = x.size(0), n = x.size(1);
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::Tensor out = at::empty({rows, n}, x.options());
  at::Tensor sum = at::empty({rows, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(n), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        add_rows(xp + r * xs, rp + r * rs, sp + r * n, n);
        norm_row(sp + r * n, wp, op + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return {out, sum};
}

template <typename scalar_t>
void rotate_heads(scalar_t* x, int64_t heads, int64_t head_stride, const scalar_t* cos,
                  const scalar_t* sin, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    scalar_t* v = x + h * head_stride;
    if constexpr (kVectorRows<scalar_t>) {
      using storage_t = typename Storage<scalar_t>::type;
      auto* lo = reinterpret_cast<storage_t*>(v);
      auto* hi = lo + half;
      const auto* c = reinterpret_cast<const storage_t*>(cos);
      const auto* s = reinterpret_cast<const storage_t*>(sin);
      each_vector(half, [&](int64_t i0, int64_t m) {
        const Vec a = load_n(lo + i0, m), b = load_n(hi + i0, m);
        // Each product rounded to the dtype, then the sum, as the eager ops do.
        const Vec a_cos = rounded<storage_t>(a * load_n(c + i0, m));
        const Vec b_sin = rounded<storage_t>(-b * load_n(s + i0, m));
        const Vec b_cos = rounded<storage_t>(b * load_n(c + half + i0, m));
        const Vec a_sin = rounded<storage_t>(a * load_n(s + half + i0, m));
        store_n(lo + i0, a_cos + b_sin, m);
        store_n(hi + i0, b_cos + a_sin, m);
      });
    } else {
      for (int64_t i = 0; i < half; ++i) {
        const float a = to_float(v[i]), b = to_float(v[i + half]);
        const float a_cos = to_float(static_cast<scalar_t>(a * to_float(cos[i])));
        const float b_sin = to_float(static_cast<scalar_t>(-b * to_float(sin[i])));
        const float b_cos = to_float(static_cast<scalar_t>(b * to_float(cos[i + half])));
        const float a_sin = to_float(static_cast<scalar_t>(a * to_float(sin[i + half])));
        v[i] = static_cast<scalar_t>(a_cos + b_sin);
        v[i + half] = static_cast<scalar_t>(b_cos + a_sin);
      }
    }
  }
}

void check_heads(const at::Tensor& x, const at::Tensor& cos, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 &&
                  x.size(0) == cos.size(0) && x.size(2) == cos.size(1) &&
                  x.scalar_type() == cos.scalar_type(),
              "rotary_: ", name, " must be [T, heads, D] with contiguous head vectors, "
              "like cos");
}

void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  const at::Tensor cos = cos_in.reshape({cos_in.size(0), -1}).contiguous();
  const at::Tensor sin = sin_in.reshape({sin_in.size(0), -1}).contiguous();
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(1) % 2 == 0,
              "rotary_: cos and sin must be [T, D] (or [T, 1, D]) with an even D");
  check_heads(q, cos, "q");
  check_heads(k, cos, "k");
  const int64_t tokens = q.size(0), dim = cos.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    const int64_t heads = q.size(1) + k.size(1);
    at::parallel_for(0, tokens, row_grain(heads * dim), [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        rotate_heads(qp + t * q.stride(0), q.size(1), q.stride(1), cp + t * dim, sp + t * dim,
                     dim);
        rotate_heads(kp + t * k.stride(0), k.size(1), k.stride(1), cp + t * dim, sp + t * dim,
                     dim);
      }
    });
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.stride(1) == 1 &&
                  gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be [T, 2I] with contiguous rows");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul",
                                  [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(2 * inter), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        silu_mul_row(gp + r * stride, gp + r * stride + inter, op + r * inter, inter);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(loragate, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("silu_and_mul", &silu_and_mul);
}
