// The per-block math of paged decode attention (attention.cpp): one block of BS cached keys and
// values against the G query heads that share a kv head, all float32, register-tiled so that
// each piece of a K or V row is loaded once for up to four heads.
//
// Rows are read in place as `R`, the cache's dtype: float, bf16 / fp16 or int8_t (the int8 cache:
// attention.cpp applies the scales and zeros around it); each 16-wide piece is widened to float32
// in registers by load_row, never copied.
#pragma once

#include "common.h"

#include <cmath>
#include <utility>

namespace dlinfer_cpu {

// kLanes values of a row as float32 (n < kLanes: the first n, the rest zero).
inline Vec load_row(const float* p) { return Vec::loadu(p); }
inline Vec load_row(const float* p, int64_t n) { return Vec::loadu(p, n); }
inline Vec load_row(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  float tmp[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(p[i]);
  return Vec::loadu(tmp);
#endif
}
inline Vec load_row(const c10::BFloat16* p) { return load_vec(p); }
inline Vec load_row(const c10::BFloat16* p, int64_t n) { return load_part(p, n); }
inline Vec load_row(const c10::Half* p) { return load_vec(p); }
inline Vec load_row(const c10::Half* p, int64_t n) { return load_part(p, n); }
inline Vec load_row(const int8_t* p, int64_t n) {
  float tmp[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) tmp[i] = static_cast<float>(p[i]);
  return Vec::loadu(tmp);
}

// The next block's K and V rows, requested into L2 while this block is computed: that block sits
// wherever the block table says, out of the hardware prefetcher's reach, and without this the
// kernel alternates between waiting for memory and computing. One key's rows per key of this
// block, so the requests stay spread out instead of flooding the miss queue at block start
// (measured on the 2-core test VM, 67 MB of K/V, variants interleaved in one process: 10-11 GB/s
// without prefetch, 14-16 GB/s with all of the next block requested at block start, 15-18 GB/s
// spread out like this).
struct Prefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t k_stride = 0, v_stride = 0, k_bytes = 0, v_bytes = 0, n = 0;  // strides in bytes
  inline void rows(int64_t p0, int64_t p1) const {
    for (int64_t p = p0; p < std::min(p1, n); ++p) {
      for (int64_t b = 0; b < k_bytes; b += 64) __builtin_prefetch(k + p * k_stride + b, 0, 1);
      for (int64_t b = 0; b < v_bytes; b += 64) __builtin_prefetch(v + p * v_stride + b, 0, 1);
    }
  }
};

inline float reduce_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// scores[h][p..p+3] = q_h . k_{p..p+3} for HG (<= 4) heads: each 16-wide piece of a key row is
// loaded once for all HG heads, and the 4 x HG accumulators (16 at most) stay in registers.
template <int HG, typename R>
inline void scores_tile(const float* q, int64_t D, const R* k0, int64_t ldk, float* scores, int64_t lds) {
  Vec acc[HG][4];
  for (int h = 0; h < HG; ++h)
    for (int r = 0; r < 4; ++r) acc[h][r] = Vec(0.f);
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    Vec kv[4];
    for (int r = 0; r < 4; ++r) kv[r] = load_row(k0 + r * ldk + d);
    for (int h = 0; h < HG; ++h) {
      const Vec qv = Vec::loadu(q + h * D + d);
      for (int r = 0; r < 4; ++r) acc[h][r] = at::vec::fmadd(qv, kv[r], acc[h][r]);
    }
  }
  if (d < D) {  // D tail: partial vectors (missing lanes load as zero)
    const int64_t rem = D - d;
    for (int h = 0; h < HG; ++h) {
      const Vec qv = Vec::loadu(q + h * D + d, rem);
      for (int r = 0; r < 4; ++r) acc[h][r] = at::vec::fmadd(qv, load_row(k0 + r * ldk + d, rem), acc[h][r]);
    }
  }
  for (int h = 0; h < HG; ++h)
    for (int r = 0; r < 4; ++r) scores[h * lds + r] = reduce_sum(acc[h][r]);
}

// sum(a[i] * b[i]) over n values, b read as float32 in registers.
template <typename R>
inline float dot_row(const float* a, const R* b, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = at::vec::fmadd(Vec::loadu(a + i), load_row(b + i), acc);
  if (i < n) acc = at::vec::fmadd(Vec::loadu(a + i, n - i), load_row(b + i, n - i), acc);
  return reduce_sum(acc);
}

// scores[g][p] = q_g . k_p for the G query heads of one kv head over a block's n keys.
template <typename R>
inline void block_scores(const float* q, int64_t G, int64_t D, const R* k, int64_t ldk, int64_t n,
                         float* scores, int64_t lds, const Prefetch& ahead) {
  int64_t p = 0;
  for (; p + 4 <= n; p += 4) {
    ahead.rows(p, p + 4);
    const R* k0 = k + p * ldk;
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) scores_tile<4>(q + g * D, D, k0, ldk, scores + g * lds + p, lds);
    switch (G - g) {
      case 3: scores_tile<3>(q + g * D, D, k0, ldk, scores + g * lds + p, lds); break;
      case 2: scores_tile<2>(q + g * D, D, k0, ldk, scores + g * lds + p, lds); break;
      case 1: scores_tile<1>(q + g * D, D, k0, ldk, scores + g * lds + p, lds); break;
    }
  }
  ahead.rows(p, ahead.n);
  for (; p < n; ++p)
    for (int64_t g = 0; g < G; ++g) scores[g * lds + p] = dot_row(q + g * D, k + p * ldk, D);
}

// acc_h[0:NV*16] += sum_p w_h[p] v_p[0:NV*16] for HG (<= 4) heads: each piece of a value row is
// loaded once for all HG heads; the HG x NV accumulators (16 at most) stay in registers.
template <int HG, int NV, typename R>
inline void values_tile(const float* w, int64_t ldw, const R* v, int64_t ldv, int64_t n, float* acc,
                        int64_t ld_acc) {
  Vec a[HG][NV];
  for (int h = 0; h < HG; ++h)
    for (int i = 0; i < NV; ++i) a[h][i] = Vec::loadu(acc + h * ld_acc + i * kLanes);
  for (int64_t p = 0; p < n; ++p) {
    Vec vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = load_row(v + p * ldv + i * kLanes);
    for (int h = 0; h < HG; ++h) {
      const Vec wp(w[h * ldw + p]);
      for (int i = 0; i < NV; ++i) a[h][i] = at::vec::fmadd(wp, vv[i], a[h][i]);
    }
  }
  for (int h = 0; h < HG; ++h)
    for (int i = 0; i < NV; ++i) a[h][i].store(acc + h * ld_acc + i * kLanes);
}

template <int HG, typename R>
inline void values_heads(const float* w, int64_t ldw, const R* v, int64_t ldv, int64_t n, int64_t Dv,
                         float* acc) {
  int64_t d = 0;
  for (; d + 4 * kLanes <= Dv; d += 4 * kLanes) values_tile<HG, 4, R>(w, ldw, v + d, ldv, n, acc + d, Dv);
  switch ((Dv - d) / kLanes) {
    case 3: values_tile<HG, 3, R>(w, ldw, v + d, ldv, n, acc + d, Dv); break;
    case 2: values_tile<HG, 2, R>(w, ldw, v + d, ldv, n, acc + d, Dv); break;
    case 1: values_tile<HG, 1, R>(w, ldw, v + d, ldv, n, acc + d, Dv); break;
  }
  d += (Dv - d) / kLanes * kLanes;
  for (; d < Dv; ++d)  // Dv tail
    for (int h = 0; h < HG; ++h)
      for (int64_t p = 0; p < n; ++p) acc[h * Dv + d] += w[h * ldw + p] * static_cast<float>(v[p * ldv + d]);
}

// acc_g[0:Dv] += sum_p w_g[p] v_p[0:Dv] for the G query heads of one kv head (w rows ldw apart).
template <typename R>
inline void block_values(const float* w, int64_t ldw, int64_t G, const R* v, int64_t ldv, int64_t n,
                         int64_t Dv, float* acc) {
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) values_heads<4, R>(w + g * ldw, ldw, v, ldv, n, Dv, acc + g * Dv);
  switch (G - g) {
    case 3: values_heads<3, R>(w + g * ldw, ldw, v, ldv, n, Dv, acc + g * Dv); break;
    case 2: values_heads<2, R>(w + g * ldw, ldw, v, ldv, n, Dv, acc + g * Dv); break;
    case 1: values_heads<1, R>(w + g * ldw, ldw, v, ldv, n, Dv, acc + g * Dv); break;
  }
}

// Softmax bookkeeping of one block for one head: scores s[0:n] become e^(s - m'), and m, l and
// acc (Dv) are updated for the new maximum m'.
inline void online_softmax(float* s, int64_t n, float& m, float& l, float* acc, int64_t Dv) {
  float bmax = -std::numeric_limits<float>::infinity();
  {
    int64_t p = 0;
    if (n >= kLanes) {
      Vec vmax = Vec::loadu(s);
      for (p = kLanes; p + kLanes <= n; p += kLanes) vmax = at::vec::maximum(vmax, Vec::loadu(s + p));
      bmax = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmax);
    }
    for (; p < n; ++p) bmax = std::max(bmax, s[p]);
  }
  const float m_new = std::max(m, bmax);
  const float corr = std::exp(m - m_new);  // 0 for the first block (m = -inf)
  const Vec vm(m_new);
  Vec vsum(0.f);
  int64_t p = 0;
  for (; p + kLanes <= n; p += kLanes) {
    const Vec e = (Vec::loadu(s + p) - vm).exp();
    e.store(s + p);
    vsum = vsum + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum);
  for (; p < n; ++p) {
    s[p] = std::exp(s[p] - m_new);
    sum += s[p];
  }
  l = l * corr + sum;
  m = m_new;
  if (corr != 1.f) scale(corr, acc, Dv);
}

}  // namespace dlinfer_cpu
