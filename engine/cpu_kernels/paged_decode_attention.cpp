// Decode attention over a paged KV cache, read in place: one query token per sequence.
//
// Semantics (the torch reference is engine/attention.py's decode path): for sequence n and
// query head h, with kv head j = h / (H / Hkv), positions p in [lo, len) where
// len = context_lens[n] and lo = max(0, len - window) (window 0: lo = 0),
//   s_p   = scale * q[n, h] . K[p]            (softcap > 0: s_p = softcap * tanh(s_p / softcap))
//   out   = sum_p softmax(s)_p * V[p]
//   lse   = log sum_p exp(s_p)
// where K[p] = k_cache[block_tables[n, p / bs], p % bs, j] and likewise V.
//
// Shapes: q [N, H, D]; k_cache, v_cache [num_blocks, bs, Hkv, D]; block_tables [N, W] int32
// or int64 (W >= ceil(len / bs)); context_lens [N] int64. Returns out [N, H, D] in q's dtype
// and lse [N, H] float32. q and the caches: float32, bfloat16 or float16, all alike;
// arithmetic in float32.
//
// Work is split into items (a sequence, or a sequence's kv head when sequences are fewer than
// twice the threads), longest context first, handed out dynamically to torch's own threads
// (at::parallel_for; built with -fopenmp against the OpenMP runtime torch already loaded).
// An item reads each K/V row once for all the query heads that share it (grouped-query
// attention without repeating K/V).
// Softmax is online (running max and sum per query head), one cache block at a time.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <vector>

#include "vec_math.h"

// With AVX512-BF16 (Intel Cooper Lake / Sapphire Rapids and later, AMD Zen 4), a bfloat16
// cache's scores are dot products of the raw bf16 query and key rows, 32 products summed
// into 16 float lanes per instruction (exact products, float sums): no widening of either.
#if defined(__AVX512BF16__) && LORAGATE_VEC_WIDTH == 16
#include <immintrin.h>
#define PAGED_DECODE_DOT_BF16 1
#else
#define PAGED_DECODE_DOT_BF16 0
#endif

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

using loragate_cpu::exp_scalar;
using loragate_cpu::exp_vec;
using loragate_cpu::load_vec;
using loragate_cpu::store_vec;
using loragate_cpu::splat;
using loragate_cpu::sum_of;
using loragate_cpu::transpose_sum;
using loragate_cpu::Vec;
constexpr int kW = loragate_cpu::kVecWidth;

// q . k (the float kernel below computes kW of them at once instead).
template <typename scalar_t, int64_t kDim>
inline float dot(const float* q, const scalar_t* k, int64_t head_dim) {
  float s = 0.0f;
  for (int64_t d = 0; d < head_dim; ++d) s += q[d] * to_float(k[d]);
  return s;
}

// Work items: a sequence's kv heads [kv0, kv0 + kv_per_item): all of them when there are
// enough sequences to keep every thread busy (each position's K/V row, all kv heads side by
// side in the cache, is then read once, front to back), else one kv head. Longest contexts
// first, so the last items handed out are short ones.
struct WorkItems {
  int64_t kv_per_item;
  int64_t items_per_seq;
  std::vector<int64_t> order;

  WorkItems(int64_t num_seqs, int64_t num_kv_heads, const int64_t* context_lens)
      : kv_per_item(num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1),
        items_per_seq(num_kv_heads / kv_per_item),
        order(num_seqs * items_per_seq) {
    std::iota(order.begin(), order.end(), 0);
    const int64_t per = items_per_seq;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return context_lens[a / per] > context_lens[b / per];
    });
  }
};

// One item's per-query-head state, kept per thread: the queries as float (pre-scaled), the
// output accumulators and the online softmax's running max and sum. The item's query heads
// are contiguous in q, out and lse: rows first_head .. first_head + heads.
struct ItemState {
  std::vector<float> qf, acc, run_max, run_sum;

  ItemState(int64_t heads, int64_t dim)
      : qf(heads * dim), acc(heads * dim), run_max(heads), run_sum(heads) {}

  template <typename scalar_t>
  void start(const scalar_t* q, int64_t first_head, float qscale) {
    const int64_t dim = static_cast<int64_t>(qf.size() / run_max.size());
    const scalar_t* src = q + first_head * dim;
    for (size_t i = 0; i < qf.size(); ++i) qf[i] = to_float(src[i]) * qscale;
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<float>::infinity());
    std::fill(run_sum.begin(), run_sum.end(), 0.0f);
  }

  // out = acc / sum and lse = max + log(sum) per head (0 and -inf over no positions).
  template <typename scalar_t>
  void finish(scalar_t* out, float* lse, int64_t first_head) const {
    const int64_t heads = static_cast<int64_t>(run_max.size());
    const int64_t dim = static_cast<int64_t>(qf.size()) / heads;
    for (int64_t h = 0; h < heads; ++h) {
      const float total = run_sum[h];
      const float inv = total > 0.0f ? 1.0f / total : 0.0f;
      scalar_t* dst = out + (first_head + h) * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(acc[h * dim + d] * inv);
      lse[first_head + h] = total > 0.0f ? run_max[h] + std::log(total)
                                         : -std::numeric_limits<float>::infinity();
    }
  }
};

// The vector kernel for head_dim = kW * kChunks (kW: the target's vector width, vec_math.h)
// over float32 or bfloat16 caches, same semantics and work items as decode_kernel below.
// scalar_t is float or c10::BFloat16; the caches are read as storage_t (float or the raw
// uint16_t bits, widened a vector at a time by vec_math.h). Per cache block and query head:
// scores of kW positions at a time (transpose_sum), softmax over the block's scores as
// vectors, then the weighted V rows summed into accumulators held in registers for the
// whole block. Query heads sharing a kv head read its K/V rows back to back, so the second
// and later reads hit L1.
template <typename scalar_t, typename index_t, int kChunks>
void decode_kernel_vec(const scalar_t* q, const scalar_t* k_cache_in,
                       const scalar_t* v_cache_in, const index_t* block_tables,
                       const int64_t* context_lens, scalar_t* out,
                       float* lse, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                       int64_t block_size, int64_t table_width, double scale, double softcap,
                       int64_t window) {
  using storage_t = std::conditional_t<std::is_same_v<scalar_t, float>, float, uint16_t>;
  const auto* k_cache = reinterpret_cast<const storage_t*>(k_cache_in);
  const auto* v_cache = reinterpret_cast<const storage_t*>(v_cache_in);
  constexpr int64_t kDim = kW * kChunks;
  // bfloat16 rows are read a pair of vectors at a time (vec_math.h's load_bf16_pairs): the
  // queries and the accumulators are kept in that split order, put back at the end.
  constexpr bool kPaired = std::is_same_v<storage_t, uint16_t>;
  static_assert(!kPaired || kChunks % 2 == 0, "a bf16 head is a whole number of pairs");
  // Two sets of kChunks accumulators fit the vector registers (32 with AVX-512, 16 else)
  // beside the loads: up to head_dim 128 with AVX-512, 64 with AVX2.
  constexpr bool kTwoRows = 2 * kChunks <= (kW >= 16 ? 16 : 8);
  const WorkItems work(num_seqs, num_kv_heads, context_lens);
  const int64_t kv_per_item = work.kv_per_item, items_per_seq = work.items_per_seq;
  const int64_t items = static_cast<int64_t>(work.order.size());
  std::atomic<int64_t> next{0};
  const int64_t group = num_heads / num_kv_heads;
  const int64_t heads = kv_per_item * group;
  const int64_t row_stride = num_kv_heads * kDim;
  const float fscale = static_cast<float>(scale);
  const float fcap = static_cast<float>(softcap);
  const float qscale = fcap > 0.0f ? 1.0f : fscale;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t padded_block = (block_size + kW - 1) / kW * kW;

  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    ItemState state(heads, kDim);
    std::vector<float>& qf = state.qf;
    std::vector<float>& acc = state.acc;
    std::vector<float>& run_max = state.run_max;
    std::vector<float>& run_sum = state.run_sum;
    std::vector<float> scores(padded_block);
    for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
      const int64_t item = work.order[i];
      const int64_t n = item / items_per_seq, kv0 = (item % items_per_seq) * kv_per_item;
      const int64_t h0 = kv0 * group;
      const int64_t len = context_lens[n];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      state.start(q, n * num_heads + h0, qscale);
      if constexpr (kPaired && !PAGED_DECODE_DOT_BF16) {  // the dot products read q raw
        for (int64_t h = 0; h < heads; ++h) loragate_cpu::pair_split(qf.data() + h * kDim, kDim);
      }
      for (int64_t b = lo / block_size; b * block_size < len; ++b) {
        const int64_t block = static_cast<int64_t>(block_tables[n * table_width + b]);
        const int64_t t0 = std::max<int64_t>(lo - b * block_size, 0);
        const int64_t t1 = std::min<int64_t>(len - b * block_size, block_size);
        const int64_t count = t1 - t0;
        if ((b + 1) * block_size < len) {
          // The next block lies anywhere in the cache, which is read once per step from
          // memory: ask for its K/V rows of this item now, while this block computes (the
          // hardware prefetchers see no pattern across blocks).
          const int64_t next_block = static_cast<int64_t>(block_tables[n * table_width + b + 1]);
          const int64_t span = kv_per_item * kDim * static_cast<int64_t>(sizeof(storage_t));
          for (int64_t t = 0; t < block_size; ++t) {
            const int64_t row = (next_block * block_size + t) * row_stride + kv0 * kDim;
            for (int64_t byte = 0; byte < span; byte += 64) {
              __builtin_prefetch(reinterpret_cast<const char*>(k_cache + row) + byte);
              __builtin_prefetch(reinterpret_cast<const char*>(v_cache + row) + byte);
            }
          }
        }
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t offset = (kv0 + h / group) * kDim;
          const storage_t* kb = k_cache + (block * block_size + t0) * row_stride + offset;
          const storage_t* vb = v_cache + (block * block_size + t0) * row_stride + offset;
          Vec qv[kChunks];
          for (int c = 0; c < kChunks; ++c) qv[c] = load_vec(qf.data() + h * kDim + kW * c);
#if PAGED_DECODE_DOT_BF16
          // The raw bf16 query, unscaled: the scale multiplies the summed scores instead.
          __m512i qraw[kChunks / 2];
          if constexpr (kPaired) {
            const auto* qh = reinterpret_cast<const uint16_t*>(q) + (n * num_heads + h0 + h) * kDim;
            for (int c = 0; c < kChunks; c += 2) qraw[c / 2] = _mm512_loadu_si512(qh + kW * c);
          }
#endif
          for (int64_t c0 = 0; c0 < count; c0 += kW) {
            const int64_t in_chunk = std::min<int64_t>(kW, count - c0);
            Vec partial[kW];
            for (int64_t t = 0; t < kW; ++t) {
              Vec s = {};
              if (t < in_chunk) {
                const storage_t* kr = kb + (c0 + t) * row_stride;
#if PAGED_DECODE_DOT_BF16
                if constexpr (kPaired) {
                  __m512 dot = _mm512_setzero_ps();
                  for (int c = 0; c < kChunks; c += 2) {
                    dot = _mm512_dpbf16_ps(dot, (__m512bh)qraw[c / 2],
                                           (__m512bh)_mm512_loadu_si512(kr + kW * c));
                  }
                  partial[t] = (Vec)dot;
                  continue;
                }
#endif
                if constexpr (kPaired) {
                  for (int c = 0; c < kChunks; c += 2) {
                    Vec even, odd;
                    loragate_cpu::load_bf16_pairs(kr + kW * c, even, odd);
                    s += qv[c] * even + qv[c + 1] * odd;
                  }
                } else {
                  for (int c = 0; c < kChunks; ++c) s += qv[c] * load_vec(kr + kW * c);
                }
              }
              partial[t] = s;
            }
#if PAGED_DECODE_DOT_BF16
            if constexpr (kPaired) {
              store_vec(scores.data() + c0, transpose_sum(partial) * qscale);
              continue;
            }
#endif
            store_vec(scores.data() + c0, transpose_sum(partial));
          }
          float* sc = scores.data();
          if (fcap > 0.0f) {
            for (int64_t t = 0; t < count; ++t) sc[t] = fcap * std::tanh(sc[t] * fscale / fcap);
          }
          // The block's largest score, a vector at a time (a scalar max is a chain of
          // dependent instructions as long as the block).
          Vec maxes = splat(run_max[h]);
          for (int64_t c0 = 0; c0 < count; c0 += kW) {
            Vec v = load_vec(sc + c0);
            for (int64_t t = count - c0; t < kW; ++t) v[t] = kNegInf;  // past the block's end
            maxes = loragate_cpu::lane_max(maxes, v);
          }
          const float block_max = loragate_cpu::max_of(maxes);
          const float rescale = run_max[h] == kNegInf ? 0.0f
                                                      : exp_scalar(run_max[h] - block_max);
          Vec sums = {};
          for (int64_t c0 = 0; c0 < count; c0 += kW) {
            Vec p = exp_vec(load_vec(sc + c0) - block_max);
            for (int64_t t = count - c0; t < kW; ++t) p[t] = 0.0f;  // past the block's end
            store_vec(sc + c0, p);
            sums += p;
          }
          run_sum[h] = run_sum[h] * rescale + sum_of(sums);
          run_max[h] = block_max;
          float* ah = acc.data() + h * kDim;
          // Weighted V rows summed into accumulators held in registers; with registers to
          // spare, two rows at a time into two sets, so that each accumulator's chain of
          // dependent FMAs is half as long.
          Vec a[kChunks], a2[kChunks];
          for (int c = 0; c < kChunks; ++c) {
            a[c] = load_vec(ah + kW * c) * rescale;
            a2[c] = Vec{};
          }
          auto add_row = [&](Vec (&into)[kChunks], int64_t t) {
            const storage_t* vr = vb + t * row_stride;
            const Vec p = splat(sc[t]);
            if constexpr (kPaired) {
              for (int c = 0; c < kChunks; c += 2) {
                Vec even, odd;
                loragate_cpu::load_bf16_pairs(vr + kW * c, even, odd);
                into[c] += p * even;
                into[c + 1] += p * odd;
              }
            } else {
              for (int c = 0; c < kChunks; ++c) into[c] += p * load_vec(vr + kW * c);
            }
          };
          int64_t t = 0;
          if constexpr (kTwoRows) {
            for (; t + 1 < count; t += 2) {
              add_row(a, t);
              add_row(a2, t + 1);
            }
          }
          for (; t < count; ++t) add_row(a, t);
          for (int c = 0; c < kChunks; ++c) a[c] += a2[c];
          for (int c = 0; c < kChunks; ++c) store_vec(ah + kW * c, a[c]);
        }
      }
      if constexpr (kPaired) {
        for (int64_t h = 0; h < heads; ++h) loragate_cpu::pair_join(acc.data() + h * kDim, kDim);
      }
      state.finish(out, lse, n * num_heads + h0);
    }
  });
}

template <typename scalar_t, typename index_t, int64_t kDim>
void decode_kernel(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                   const index_t* block_tables, const int64_t* context_lens, scalar_t* out,
                   float* lse, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t block_size, int64_t table_width, double scale,
                   double softcap, int64_t window) {
  if (kDim > 0) head_dim = kDim;  // a compile-time size: the loops over it unroll
  const WorkItems work(num_seqs, num_kv_heads, context_lens);
  const int64_t kv_per_item = work.kv_per_item, items_per_seq = work.items_per_seq;
  const int64_t items = static_cast<int64_t>(work.order.size());
  std::atomic<int64_t> next{0};
  const int64_t group = num_heads / num_kv_heads;
  const int64_t heads = kv_per_item * group;  // query heads of one item
  const int64_t row_stride = num_kv_heads * head_dim;  // one position in a block
  const float fscale = static_cast<float>(scale);
  const float fcap = static_cast<float>(softcap);
  // Without a softcap the scale folds into the queries.
  const float qscale = fcap > 0.0f ? 1.0f : fscale;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    // Per thread: the item's state and one block's scores.
    ItemState state(heads, head_dim);
    std::vector<float>& qf = state.qf;
    std::vector<float>& acc = state.acc;
    std::vector<float>& run_max = state.run_max;
    std::vector<float>& run_sum = state.run_sum;
    std::vector<float> scores(heads * block_size);
    for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
      const int64_t item = work.order[i];
      const int64_t n = item / items_per_seq, kv0 = (item % items_per_seq) * kv_per_item;
      const int64_t h0 = kv0 * group;  // first query head of the item
      const int64_t len = context_lens[n];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      state.start(q, n * num_heads + h0, qscale);
      for (int64_t b = lo / block_size; b * block_size < len; ++b) {
        const int64_t block = static_cast<int64_t>(block_tables[n * table_width + b]);
        const int64_t t0 = std::max<int64_t>(lo - b * block_size, 0);
        const int64_t t1 = std::min<int64_t>(len - b * block_size, block_size);
        const scalar_t* kb = k_cache + block * block_size * row_stride + kv0 * head_dim;
        const scalar_t* vb = v_cache + block * block_size * row_stride + kv0 * head_dim;
        for (int64_t t = t0; t < t1; ++t) {
          for (int64_t h = 0; h < heads; ++h) {
            const scalar_t* kr = kb + t * row_stride + (h / group) * head_dim;
            const float* qh = qf.data() + h * head_dim;
            float s = dot<scalar_t, kDim>(qh, kr, head_dim);
            if (fcap > 0.0f) s = fcap * std::tanh(s * fscale / fcap);
            scores[h * block_size + t] = s;
          }
        }
        // Scores -> weights (exp relative to the new running max); old sums rescaled.
        for (int64_t h = 0; h < heads; ++h) {
          float* sh = scores.data() + h * block_size;
          float block_max = run_max[h];
          for (int64_t t = t0; t < t1; ++t) block_max = std::max(block_max, sh[t]);
          const float rescale = run_max[h] == kNegInf ? 0.0f
                                                      : exp_scalar(run_max[h] - block_max);
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = t0; t < t1; ++t) {
            const float p = exp_scalar(sh[t] - block_max);
            sh[t] = p;
            sum += p;
          }
          run_sum[h] = run_sum[h] * rescale + sum;
          run_max[h] = block_max;
          if (rescale != 1.0f) {
            float* ah = acc.data() + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ah[d] *= rescale;
          }
        }
        for (int64_t t = t0; t < t1; ++t) {
          for (int64_t h = 0; h < heads; ++h) {
            const scalar_t* vr = vb + t * row_stride + (h / group) * head_dim;
            const float p = scores[h * block_size + t];
            float* ah = acc.data() + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * to_float(vr[d]);
          }
        }
      }
      state.finish(out, lse, n * num_heads + h0);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> paged_decode_attention(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
    double softcap, int64_t window) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q [N, H, D], caches [blocks, bs, Hkv, D]");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "paged_decode_attention: q and the caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: caches must be contiguous");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0,
              "paged_decode_attention: head_dim mismatch or H not a multiple of Hkv");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                  context_lens.numel() == num_seqs,
              "paged_decode_attention: block_tables [N, W] and context_lens [N]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong, "context_lens must be int64");
  const at::Tensor qc = q.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  const int64_t width = tables.size(1);
  const int64_t* lens_ptr = lens.data_ptr<int64_t>();
  for (int64_t n = 0; n < num_seqs; ++n) {
    TORCH_CHECK(lens_ptr[n] >= 0 && lens_ptr[n] <= width * block_size,
                "paged_decode_attention: a context is longer than its block table");
  }
  at::Tensor out = at::empty_like(qc);
  at::Tensor lse = at::empty({num_seqs, num_heads}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    auto run = [&](auto* table_ptr) {
      using index_t = std::remove_const_t<std::remove_pointer_t<decltype(table_ptr)>>;
      if constexpr (std::is_same_v<scalar_t, float> ||
                    std::is_same_v<scalar_t, c10::BFloat16>) {
        auto fast = head_dim == 32    ? &decode_kernel_vec<scalar_t, index_t, 32 / kW>
                    : head_dim == 64  ? &decode_kernel_vec<scalar_t, index_t, 64 / kW>
                    : head_dim == 128 ? &decode_kernel_vec<scalar_t, index_t, 128 / kW>
                                      : nullptr;
        if (fast != nullptr) {
          fast(qc.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
               v_cache.data_ptr<scalar_t>(), table_ptr, lens_ptr, out.data_ptr<scalar_t>(),
               lse.data_ptr<float>(), num_seqs, num_heads, num_kv_heads, block_size, width,
               scale, softcap, window);
          return;
        }
      }
      auto kernel = head_dim == 64    ? &decode_kernel<scalar_t, index_t, 64>
                    : head_dim == 128 ? &decode_kernel<scalar_t, index_t, 128>
                                      : &decode_kernel<scalar_t, index_t, 0>;
      kernel(qc.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                              v_cache.data_ptr<scalar_t>(), table_ptr, lens_ptr,
                              out.data_ptr<scalar_t>(), lse.data_ptr<float>(), num_seqs,
                              num_heads, num_kv_heads, head_dim, block_size, width, scale,
                              softcap, window);
    };
    if (tables.scalar_type() == at::kInt) {
      run(tables.data_ptr<int32_t>());
    } else {
      TORCH_CHECK(tables.scalar_type() == at::kLong, "block_tables must be int32 or int64");
      run(tables.data_ptr<int64_t>());
    }
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(loragate, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, float softcap, int window) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(loragate, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
