// Cascade attention's per-layer work in one call: many query rows attend to spans of
// consecutive keys read in place (shared prefix blocks, a prefill chunk's own K/V), and
// every row's partial results are merged with their log-sum-exp weights.
//
// Semantics (the torch oracle is engine/cascade_attention.py's flash path):
//   items [I, 6] int64, one row per item: (source, key_start, key_len, rows_offset,
//   num_rows, diag). Its queries are the flat-batch rows rows[rows_offset + i],
//   i in [0, num_rows); query i, head h (kv head j = h / (H / Hkv)) attends to the keys
//   key_start + t, t in [0, key_len), and when diag >= 0 only to t <= i + diag (causal):
//     s_t = scale * q[row, h] . K[key_start + t, j]
//     o   = sum_t softmax(s)_t V[key_start + t, j],   lse = log sum_t exp(s_t)
//   source 0 reads k_cache/v_cache viewed as slots [num_blocks * bs, Hkv, D], source 1
//   k_copy/v_copy likewise (scattered blocks copied out once), source 2 k_step/v_step
//   [T, Hkv, D] (the step's own K/V, rows of the flat batch).
//   prior_out [P, H, D] / prior_lse [P, H]: partials computed elsewhere (the decodes'
//   private tails, by paged_decode_attention).
//   merge_offsets [R + 1], merge_parts [M] int64: output row r merges the partials
//   merge_parts[merge_offsets[r] .. merge_offsets[r + 1]); part p < P is prior p, part
//   p >= P is item query p - P (items' queries numbered in rows order).
//   out[r, h] = sum_p w_p o_p / sum_p w_p with w_p = exp(lse_p - max lse): softmax over the
//   union of the parts' (disjoint) key sets. A row with no part, or whose parts saw no
//   key, is zero.
// Shapes and dtypes: all float32; q [T, H, D] and k_step/v_step [T, Hkv, D] with
// contiguous heads (any row stride); caches and copies contiguous; D = 32, 64, 128 or
// 256. Returns out [R, H, D] float32.
//
// How: work units are (item, kv head, up to kTileFloats / D query vectors), a query vector
// being one (row, head) of the kv head's group, biggest first, handed out dynamically to
// torch's threads. A unit walks its keys kKeys at a time (two vectors' worth: 32 with
// AVX-512, 16 with AVX2): their K rows are transposed once into [D, kKeys] (read in place
// from the cache, L1 afterwards), the scores of the unit's
// query vectors are an outer-product micro-GEMM against them (each vector of K feeds
// several queries' accumulators held in registers), softmax is online per query vector,
// and the weighted V rows are summed into accumulators likewise register-blocked. A causal
// unit stops at the last key its last row may see, so a causal chunk costs half an
// unmasked one (torch's CPU flash kernel computes the masked half too). Then one pass over
// the output rows merges their partials.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "vec_math.h"

namespace {

using loragate_cpu::exp_scalar;
using loragate_cpu::exp_vec;
using loragate_cpu::lane_max;
using loragate_cpu::load_vec;
using loragate_cpu::max_of;
using loragate_cpu::splat;
using loragate_cpu::store_vec;
using loragate_cpu::sum_of;
using loragate_cpu::transpose_tile;
using loragate_cpu::Vec;
using loragate_cpu::where_less;

// The target's vector width in floats (vec_math.h): 16 with AVX-512, 8 with AVX2, 4
// elsewhere. Everything below is written in Vec; head_dim is kChunks vectors.
constexpr int kW = loragate_cpu::kVecWidth;

constexpr int64_t kKeys = 2 * kW;  // keys per tile: two vectors of scores per query
// Query vectors whose accumulators a micro-kernel keeps in registers: the score tile holds
// 2 * kQkRows vectors, the output tile kOutVecs (32 vector registers with AVX-512, 16
// with AVX2 and SSE).
#if defined(__AVX512F__)
constexpr int kQkRows = 8;
constexpr int kOutVecs = 16;
#else
constexpr int kQkRows = 6;
constexpr int kOutVecs = 12;
#endif
// A unit's query vectors times D: its queries and accumulators stay in L1/L2.
constexpr int64_t kTileFloats = 4096;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Item {
  int64_t source, key_start, key_len, rows_offset, num_rows, diag;
};

struct Unit {
  int64_t item, kv, row0, rows, cost;
};

struct Source {
  const float* k;
  const float* v;
  int64_t k_stride, v_stride;  // floats from one slot (row) to the next
  int64_t slots;
};


// kt[d][t] = K[t][d] for the tile's count keys (rows stride floats apart), 0 past them.
template <int kChunks>
inline void transpose_keys(const float* k, int64_t stride, int64_t count, float* kt) {
  for (int64_t t0 = 0; t0 < kKeys; t0 += kW) {
    for (int c = 0; c < kChunks; ++c) {
      Vec r[kW];
      for (int64_t t = 0; t < kW; ++t)
        r[t] = t0 + t < count ? load_vec(k + (t0 + t) * stride + kW * c) : Vec{};
      transpose_tile(r);
      for (int d = 0; d < kW; ++d) store_vec(kt + (kW * c + d) * kKeys + t0, r[d]);
    }
  }
}

// s[i][0:kKeys] = sum_d q[i][d] * kt[d][0:kKeys] for M query vectors (rows of D floats).
template <int M, int kChunks>
inline void score_tile(const float* q, const float* kt, float* s) {
  constexpr int kDim = kW * kChunks;
  Vec lo[M], hi[M];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) lo[i] = hi[i] = Vec{};
  for (int d = 0; d < kDim; ++d) {
    const Vec k0 = load_vec(kt + d * kKeys), k1 = load_vec(kt + d * kKeys + kW);
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      const Vec a = splat(q[i * kDim + d]);
      lo[i] += a * k0;
      hi[i] += a * k1;
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) {
    store_vec(s + i * kKeys, lo[i]);
    store_vec(s + i * kKeys + kW, hi[i]);
  }
}

template <int kChunks, int M = kQkRows>
inline void score_rows(int m, const float* q, const float* kt, float* s) {
  if constexpr (M > 1) {
    if (m < M) return score_rows<kChunks, M - 1>(m, q, kt, s);
  }
  score_tile<M, kChunks>(q, kt, s);
}

// acc[i][0:kC * kW] += sum_t p[i][t] * v[t][0:kC * kW] over count keys, for M query
// vectors (acc rows kDim floats apart, p rows kKeys): one column slice of the output.
template <int M, int kC, int kDim>
inline void value_tile(const float* p, const float* v, int64_t v_stride, int64_t count,
                       float* acc) {
  Vec a[M][kC];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i)
    for (int c = 0; c < kC; ++c) a[i][c] = load_vec(acc + i * kDim + kW * c);
  for (int64_t t = 0; t < count; ++t) {
    const float* vr = v + t * v_stride;
    Vec w[M];
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) w[i] = splat(p[i * kKeys + t]);
#pragma GCC unroll 8
    for (int c = 0; c < kC; ++c) {
      const Vec vv = load_vec(vr + kW * c);
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) a[i][c] += w[i] * vv;
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i)
    for (int c = 0; c < kC; ++c) store_vec(acc + i * kDim + kW * c, a[i][c]);
}

// The output columns a value tile covers at once: at most 4 vectors, so that each V vector
// loaded feeds several query vectors' accumulators (value_block: 3 with AVX2, 4 with
// AVX-512). With all of a 64-float head in one pass, AVX2's 12 accumulators held one query
// vector: a load per FMA, and the value sums ran at load speed.
constexpr int value_chunks(int chunks) { return chunks < 4 ? chunks : 4; }

constexpr int value_block(int chunks) { return kOutVecs / value_chunks(chunks); }  // >= 3

// value_tile over all of D, column slice by column slice, for m <= value_block query vectors.
template <int kChunks, int M = value_block(kChunks)>
inline void value_rows(int m, const float* p, const float* v, int64_t v_stride, int64_t count,
                       float* acc) {
  if constexpr (M > 1) {
    if (m < M) return value_rows<kChunks, M - 1>(m, p, v, v_stride, count, acc);
  }
  constexpr int kC = value_chunks(kChunks);
  for (int c0 = 0; c0 < kChunks; c0 += kC)
    value_tile<M, kC, kW * kChunks>(p, v + kW * c0, v_stride, count, acc + kW * c0);
}

// Per-thread space for one unit.
struct UnitState {
  std::vector<float> q, kt, s, acc, run_max, run_sum;

  UnitState(int64_t vectors, int64_t dim)
      : q(vectors * dim), kt(dim * kKeys), s(vectors * kKeys), acc(vectors * dim),
        run_max(vectors), run_sum(vectors) {}
};

template <int kChunks>
void run_unit(const Unit& unit, const Item& item, const Source& src, const float* q,
              int64_t q_stride, const int64_t* rows, int64_t num_heads, int64_t group,
              float scale, float* part_out, float* part_lse, UnitState& st) {
  constexpr int64_t kDim = kW * kChunks;
  const int64_t vectors = unit.rows * group;
  const int64_t head0 = unit.kv * group;
  for (int64_t v = 0; v < vectors; ++v) {
    const int64_t row = rows[item.rows_offset + unit.row0 + v / group];
    const float* qs = q + row * q_stride + (head0 + v % group) * kDim;
    float* qd = st.q.data() + v * kDim;
    for (int64_t d = 0; d < kDim; ++d) qd[d] = qs[d] * scale;
  }
  std::fill(st.acc.begin(), st.acc.begin() + vectors * kDim, 0.0f);
  std::fill(st.run_max.begin(), st.run_max.begin() + vectors, kNegInf);
  std::fill(st.run_sum.begin(), st.run_sum.begin() + vectors, 0.0f);
  int64_t key_end = item.key_len;
  if (item.diag >= 0) key_end = std::min(key_end, unit.row0 + unit.rows + item.diag);
  const float* kbase = src.k + item.key_start * src.k_stride + unit.kv * kDim;
  const float* vbase = src.v + item.key_start * src.v_stride + unit.kv * kDim;
  Vec iota;  // lane numbers, as floats
  for (int t = 0; t < kW; ++t) iota[t] = static_cast<float>(t);
  float* kt = st.kt.data();
  for (int64_t k0 = 0; k0 < key_end; k0 += kKeys) {
    const int64_t count = std::min(kKeys, key_end - k0);
    // The next tile's K and V rows, requested now: the cache is read once per step, cold,
    // and a tile's compute is too short for the hardware prefetcher to run far enough ahead.
    const int64_t ahead = std::min(kKeys, key_end - k0 - kKeys);
    for (int64_t t = 0; t < ahead; ++t) {
      const int64_t at = k0 + kKeys + t;
      for (int64_t d = 0; d < kDim; d += 16) {  // a 64-byte line holds 16 floats
        __builtin_prefetch(kbase + at * src.k_stride + d);
        __builtin_prefetch(vbase + at * src.v_stride + d);
      }
    }
    transpose_keys<kChunks>(kbase + k0 * src.k_stride, src.k_stride, count, kt);
    for (int64_t v0 = 0; v0 < vectors; v0 += kQkRows) {
      score_rows<kChunks>(static_cast<int>(std::min<int64_t>(kQkRows, vectors - v0)),
                          st.q.data() + v0 * kDim, kt, st.s.data() + v0 * kKeys);
    }
    // Online softmax per query vector: the tile's scores become weights (0 past the keys
    // this query may see), the vector's running sum and accumulator are rescaled.
    for (int64_t v = 0; v < vectors; ++v) {
      float* sv = st.s.data() + v * kKeys;
      int64_t limit = count;
      if (item.diag >= 0) {
        limit = std::clamp<int64_t>(unit.row0 + v / group + item.diag + 1 - k0, 0, count);
      }
      if (limit == 0) {
        std::memset(sv, 0, kKeys * sizeof(float));
        continue;
      }
      const Vec lim = splat(static_cast<float>(limit)), none = splat(kNegInf);
      const Vec s0 = load_vec(sv), s1 = load_vec(sv + kW);
      const Vec m0 = where_less(iota, lim, s0, none);
      const Vec m1 = where_less(iota + static_cast<float>(kW), lim, s1, none);
      const float old = st.run_max[v];
      const float tile_max = std::max(old, max_of(lane_max(m0, m1)));
      const float rescale = old == kNegInf ? 0.0f : exp_scalar(old - tile_max);
      const Vec zero = {};
      const Vec p0 = where_less(iota, lim, exp_vec(s0 - tile_max), zero);
      const Vec p1 = where_less(iota + static_cast<float>(kW), lim, exp_vec(s1 - tile_max), zero);
      store_vec(sv, p0);
      store_vec(sv + kW, p1);
      st.run_sum[v] = st.run_sum[v] * rescale + sum_of(p0 + p1);
      st.run_max[v] = tile_max;
      if (rescale != 1.0f) {
        float* av = st.acc.data() + v * kDim;
        for (int c = 0; c < kChunks; ++c)
          store_vec(av + kW * c, load_vec(av + kW * c) * rescale);
      }
    }
    constexpr int kBlock = value_block(kChunks);
    for (int64_t v0 = 0; v0 < vectors; v0 += kBlock) {
      value_rows<kChunks>(static_cast<int>(std::min<int64_t>(kBlock, vectors - v0)),
                          st.s.data() + v0 * kKeys, vbase + k0 * src.v_stride, src.v_stride,
                          count, st.acc.data() + v0 * kDim);
    }
  }
  for (int64_t v = 0; v < vectors; ++v) {
    const int64_t part = (item.rows_offset + unit.row0 + v / group) * num_heads + head0 + v % group;
    const float total = st.run_sum[v];
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    const float* av = st.acc.data() + v * kDim;
    float* dst = part_out + part * kDim;
    for (int64_t d = 0; d < kDim; ++d) dst[d] = av[d] * inv;
    part_lse[part] = total > 0.0f ? st.run_max[v] + std::log(total) : kNegInf;
  }
}

template <int kChunks>
void run_items(const std::vector<Item>& items, const Source (&sources)[3], const float* q,
               int64_t q_stride, const int64_t* rows, int64_t num_heads, int64_t num_kv_heads,
               float scale, float* part_out, float* part_lse) {
  constexpr int64_t kDim = kW * kChunks;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t rows_per_unit = std::max<int64_t>(1, kTileFloats / kDim / group);
  std::vector<Unit> units;
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
    const Item& it = items[i];
    for (int64_t r0 = 0; r0 < it.num_rows; r0 += rows_per_unit) {
      const int64_t n = std::min(rows_per_unit, it.num_rows - r0);
      const int64_t keys = it.diag >= 0 ? std::min(it.key_len, r0 + n + it.diag) : it.key_len;
      for (int64_t kv = 0; kv < num_kv_heads; ++kv) units.push_back({i, kv, r0, n, keys * n});
    }
  }
  std::stable_sort(units.begin(), units.end(),
                   [](const Unit& a, const Unit& b) { return a.cost > b.cost; });
  const int64_t total = static_cast<int64_t>(units.size());
  const int64_t vectors = rows_per_unit * group;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    UnitState state(vectors, kDim);
    for (int64_t u = next.fetch_add(1); u < total; u = next.fetch_add(1)) {
      const Unit& unit = units[u];
      const Item& item = items[unit.item];
      run_unit<kChunks>(unit, item, sources[item.source], q, q_stride, rows, num_heads, group,
                        scale, part_out, part_lse, state);
    }
  });
}

// out[r] = the partials of row r merged (see the header).
void merge_rows(const int64_t* offsets, const int64_t* parts, int64_t num_rows,
                int64_t num_prior, const float* prior_out, const float* prior_lse,
                const float* item_out, const float* item_lse, int64_t num_heads,
                int64_t head_dim, float* out) {
  at::parallel_for(0, num_rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> weight;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t first = offsets[r], n = offsets[r + 1] - first;
      weight.resize(n);
      for (int64_t h = 0; h < num_heads; ++h) {
        float* dst = out + (r * num_heads + h) * head_dim;
        auto lse_of = [&](int64_t p) {
          return p < num_prior ? prior_lse[p * num_heads + h]
                               : item_lse[(p - num_prior) * num_heads + h];
        };
        auto out_of = [&](int64_t p) {
          return p < num_prior ? prior_out + (p * num_heads + h) * head_dim
                               : item_out + ((p - num_prior) * num_heads + h) * head_dim;
        };
        float peak = kNegInf;
        for (int64_t i = 0; i < n; ++i) peak = std::max(peak, lse_of(parts[first + i]));
        std::fill(dst, dst + head_dim, 0.0f);
        if (peak == kNegInf) continue;
        float total = 0.0f;
        for (int64_t i = 0; i < n; ++i) {
          const float l = lse_of(parts[first + i]);
          weight[i] = l == kNegInf ? 0.0f : exp_scalar(l - peak);
          total += weight[i];
        }
        for (int64_t i = 0; i < n; ++i) {
          if (weight[i] == 0.0f) continue;  // saw no key (or no item): nothing to add
          const float w = weight[i] / total;
          const float* src = out_of(parts[first + i]);
          for (int64_t d = 0; d < head_dim; ++d) dst[d] += w * src[d];
        }
      }
    }
  });
}

Source source_of(const at::Tensor& k, const at::Tensor& v, int64_t num_kv_heads,
                 int64_t head_dim, const char* name) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "span_attention: ", name, " must be float32");
  TORCH_CHECK(k.sizes() == v.sizes(), "span_attention: ", name,
              " keys and values differ in shape");
  if (k.numel() == 0) return {nullptr, nullptr, 0, 0, 0};
  const at::Tensor ks = k.dim() == 4 ? k.view({-1, k.size(2), k.size(3)}) : k;
  const at::Tensor vs = v.dim() == 4 ? v.view({-1, v.size(2), v.size(3)}) : v;
  for (const at::Tensor* x : {&ks, &vs}) {
    TORCH_CHECK(x->dim() == 3 && x->size(1) == num_kv_heads && x->size(2) == head_dim &&
                    x->stride(2) == 1 && x->stride(1) == head_dim,
                "span_attention: ", name, " must be [slots, Hkv, D] with contiguous heads");
  }
  return {ks.data_ptr<float>(), vs.data_ptr<float>(), ks.stride(0), vs.stride(0), ks.size(0)};
}

at::Tensor span_attention(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& k_copy,
                          const at::Tensor& v_copy, const at::Tensor& k_step,
                          const at::Tensor& v_step, const at::Tensor& items,
                          const at::Tensor& rows, const at::Tensor& prior_out,
                          const at::Tensor& prior_lse, const at::Tensor& merge_offsets,
                          const at::Tensor& merge_parts, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3,
              "span_attention: q must be a float32 CPU tensor [T, H, D]");
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == head_dim,
              "span_attention: q's heads must be contiguous");
  TORCH_CHECK(head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256,
              "span_attention: head_dim must be 32, 64, 128 or 256");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4,
              "span_attention: caches must be contiguous [blocks, bs, Hkv, D]");
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "span_attention: H must be a multiple of Hkv");
  TORCH_CHECK(k_copy.numel() == 0 || k_copy.is_contiguous(),
              "span_attention: copies must be contiguous");
  const Source sources[3] = {source_of(k_cache, v_cache, num_kv_heads, head_dim, "caches"),
                             source_of(k_copy, v_copy, num_kv_heads, head_dim, "copies"),
                             source_of(k_step, v_step, num_kv_heads, head_dim, "step K/V")};
  TORCH_CHECK(items.scalar_type() == at::kLong && items.dim() == 2 && items.size(1) == 6,
              "span_attention: items must be int64 [I, 6]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1,
              "span_attention: rows must be int64 [N]");
  const at::Tensor items_c = items.contiguous(), rows_c = rows.contiguous();
  const int64_t num_queries = rows_c.numel();
  const int64_t* rows_ptr = rows_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_queries; ++i) {
    TORCH_CHECK(rows_ptr[i] >= 0 && rows_ptr[i] < num_tokens, "span_attention: a row is out of range");
  }
  std::vector<Item> list(items_c.size(0));
  const int64_t* it = items_c.data_ptr<int64_t>();
  for (size_t i = 0; i < list.size(); ++i, it += 6) {
    list[i] = {it[0], it[1], it[2], it[3], it[4], it[5]};
    const Item& item = list[i];
    TORCH_CHECK(item.source >= 0 && item.source < 3, "span_attention: bad item source");
    TORCH_CHECK(item.key_start >= 0 && item.key_len >= 0 &&
                    item.key_start + item.key_len <= sources[item.source].slots,
                "span_attention: an item's keys are out of range");
    TORCH_CHECK(item.rows_offset >= 0 && item.num_rows >= 0 &&
                    item.rows_offset + item.num_rows <= num_queries,
                "span_attention: an item's rows are out of range");
  }
  TORCH_CHECK(prior_out.scalar_type() == at::kFloat && prior_lse.scalar_type() == at::kFloat,
              "span_attention: prior partials must be float32");
  const int64_t num_prior = prior_out.size(0);
  TORCH_CHECK(prior_out.dim() == 3 && prior_out.size(1) == num_heads &&
                  prior_out.size(2) == head_dim && prior_lse.dim() == 2 &&
                  prior_lse.size(0) == num_prior && prior_lse.size(1) == num_heads,
              "span_attention: prior_out [P, H, D] and prior_lse [P, H]");
  TORCH_CHECK(merge_offsets.scalar_type() == at::kLong && merge_parts.scalar_type() == at::kLong,
              "span_attention: merge_offsets and merge_parts must be int64");
  const at::Tensor offsets = merge_offsets.contiguous(), parts = merge_parts.contiguous();
  const int64_t num_rows = offsets.numel() - 1;
  TORCH_CHECK(num_rows >= 0, "span_attention: merge_offsets needs R + 1 entries");
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* part = parts.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[num_rows] == parts.numel(),
              "span_attention: merge_offsets must run from 0 to the number of parts");
  for (int64_t r = 0; r < num_rows; ++r) {
    TORCH_CHECK(off[r] <= off[r + 1], "span_attention: merge_offsets must not decrease");
  }
  for (int64_t i = 0; i < parts.numel(); ++i) {
    TORCH_CHECK(part[i] >= 0 && part[i] < num_prior + num_queries,
                "span_attention: a merge part is out of range");
  }
  const at::Tensor prior_o = prior_out.contiguous(), prior_l = prior_lse.contiguous();
  at::Tensor item_out = at::empty({num_queries, num_heads, head_dim}, q.options());
  at::Tensor item_lse = at::empty({num_queries, num_heads}, q.options());
  // A query no item covers (the planner never leaves one) has lse -inf: a part naming it
  // weighs nothing and its uninitialized output is never read (merge_rows skips it).
  if (num_queries > 0) item_lse.fill_(kNegInf);
  const float fscale = static_cast<float>(scale);
  const int64_t q_stride = q.stride(0);
  auto run = head_dim == 32    ? &run_items<32 / kW>
             : head_dim == 64  ? &run_items<64 / kW>
             : head_dim == 128 ? &run_items<128 / kW>
                               : &run_items<256 / kW>;
  run(list, sources, q.data_ptr<float>(), q_stride, rows_ptr, num_heads, num_kv_heads, fscale,
      item_out.data_ptr<float>(), item_lse.data_ptr<float>());
  at::Tensor out = at::empty({num_rows, num_heads, head_dim}, q.options());
  merge_rows(off, part, num_rows, num_prior, prior_o.data_ptr<float>(),
             prior_l.data_ptr<float>(), item_out.data_ptr<float>(), item_lse.data_ptr<float>(),
             num_heads, head_dim, out.data_ptr<float>());
  return out;
}

int64_t vector_width() { return kW; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate, m) {
  m.def("vector_width() -> int", &vector_width);  // no tensors: one kernel for every key
  m.def("span_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_copy, "
        "Tensor v_copy, Tensor k_step, Tensor v_step, Tensor items, Tensor rows, "
        "Tensor prior_out, Tensor prior_lse, Tensor merge_offsets, Tensor merge_parts, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(loragate, CPU, m) {
  m.impl("span_attention", &span_attention);
}
