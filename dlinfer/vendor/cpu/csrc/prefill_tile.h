// The per-chunk math of the flash-style prefill attention (prefill_attention.cpp): one chunk of n
// keys and values against a tile of query rows, all float32, with the rows laid out along the
// vector lanes so that nothing needs a horizontal reduction:
//
//   qt [D, R]   the tile's queries, transposed (row r = query token i, head g: r = i * G + g),
//               pre-multiplied by the softmax scale; R is a multiple of kRowVec;
//   s  [n, R]   scores, key-major: s[p][r] = qt[:, r] . k_p, then e^(s - m) once masked;
//   acc [R, Dv] the running weighted value sums.
//
// The score product broadcasts one key element against a vector of rows (kKeys keys x kRowVecs
// row vectors of accumulators per register tile); the softmax bookkeeping (max, sum, rescale)
// runs on row vectors; the value product broadcasts one probability against a vector of a
// value row (4 rows x up to 4 vectors of Dv per register tile).
#pragma once

#include "common.h"

#include <cmath>

namespace dlinfer_cpu {
namespace prefill {

#if defined(CPU_CAPABILITY_AVX512)
constexpr int kKeys = 8;  // 8 keys x 2 row vectors: 16 of the 32 zmm registers accumulate
#else
constexpr int kKeys = 4;  // 4 x 2: 8 of the 16 ymm registers
#endif
constexpr int kRowVecs = 2;
constexpr int64_t kRowVec = kRowVecs * kLanes;  // R is padded to a multiple of this

// s[p][0:kRowVec] = sum_d k[p][d] * qt[d][0:kRowVec] for KK keys (rows of k, ldk apart).
template <int KK, typename R>
inline void scores_tile(const float* qt, int64_t ldq, const R* k, int64_t ldk, int64_t D, float* s, int64_t lds) {
  Vec acc[KK][kRowVecs];
  for (int p = 0; p < KK; ++p)
    for (int i = 0; i < kRowVecs; ++i) acc[p][i] = Vec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    Vec qv[kRowVecs];
    for (int i = 0; i < kRowVecs; ++i) qv[i] = Vec::loadu(qt + d * ldq + i * kLanes);
    for (int p = 0; p < KK; ++p) {
      const Vec kv(static_cast<float>(k[p * ldk + d]));
      for (int i = 0; i < kRowVecs; ++i) acc[p][i] = at::vec::fmadd(kv, qv[i], acc[p][i]);
    }
  }
  for (int p = 0; p < KK; ++p)
    for (int i = 0; i < kRowVecs; ++i) acc[p][i].store(s + p * lds + i * kLanes);
}

// s [n, R] = k [n, D] . qt [D, R] (rows R a multiple of kRowVec).
template <typename R>
inline void chunk_scores(const float* qt, int64_t rows, const R* k, int64_t ldk, int64_t n, int64_t D, float* s) {
  for (int64_t r = 0; r < rows; r += kRowVec) {
    int64_t p = 0;
    for (; p + kKeys <= n; p += kKeys) scores_tile<kKeys>(qt + r, rows, k + p * ldk, ldk, D, s + p * rows + r, rows);
    for (; p < n; ++p) scores_tile<1>(qt + r, rows, k + p * ldk, ldk, D, s + p * rows + r, rows);
  }
}

// Row state of the online softmax, one value per tile row (R of each).
struct RowState {
  float* m;      // running max (-inf before the first visible key)
  float* l;      // running sum of e^(s - m)
  float* corr;   // this chunk's rescale factor e^(m_old - m_new)
  const float* pos;    // query position of the row; -1 for a row that sees nothing (padding, not owned)
  const float* slope;  // ALiBi slope of the row's head, or nullptr
  float window = 0.f;   // sliding window W: keys at or before pos - W score -inf (0: none)
  float softcap = 0.f;  // soft cap c: s -> c tanh(s / c) before ALiBi (0: none)
};

// Masks, exponentiates and sums one chunk: keys at positions kpos0 .. kpos0 + n - 1, causal
// (a key after the row's position scores -inf, and with a window W one at or before position - W),
// soft-capped (c tanh(s / c)) when asked, ALiBi bias slope * (key pos - query pos). s becomes
// the unnormalised probabilities e^(s - m_new); m, l move on and corr holds e^(m_old - m_new)
// (0 where the row saw no key before, and m stays -inf, e 0, for a row that sees none yet).
inline void chunk_softmax(float* s, int64_t rows, int64_t n, int64_t kpos0, const RowState& st) {
  const Vec ninf(-std::numeric_limits<float>::infinity()), zero(0.f);
  for (int64_t r = 0; r < rows; r += kLanes) {
    const Vec pos = Vec::loadu(st.pos + r);
    const Vec slope = st.slope ? Vec::loadu(st.slope + r) : zero;
    const Vec cap(st.softcap), inv_cap(st.softcap > 0.f ? 1.f / st.softcap : 0.f);
    const Vec oldest = pos - Vec(st.window);  // keys at or before this are out of the window
    Vec bmax = ninf;
    for (int64_t p = 0; p < n; ++p) {
      const Vec kp(static_cast<float>(kpos0 + p));
      Vec v = Vec::loadu(s + p * rows + r);
      if (st.softcap > 0.f) v = cap * (v * inv_cap).tanh();
      if (st.slope) v = v + slope * (kp - pos);
      v = Vec::blendv(v, ninf, kp > pos);
      if (st.window > 0.f) v = Vec::blendv(v, ninf, kp <= oldest);
      v.store(s + p * rows + r);
      bmax = at::vec::maximum(bmax, v);
    }
    const Vec m_old = Vec::loadu(st.m + r);
    const Vec m_new = at::vec::maximum(m_old, bmax);
    const Vec base = Vec::blendv(m_new, zero, m_new == ninf);  // exp(-inf - base) = 0, never NaN
    Vec sum(0.f);
    for (int64_t p = 0; p < n; ++p) {
      const Vec e = (Vec::loadu(s + p * rows + r) - base).exp();
      e.store(s + p * rows + r);
      sum = sum + e;
    }
    const Vec corr = (m_old - base).exp();
    (Vec::loadu(st.l + r) * corr + sum).store(st.l + r);
    m_new.store(st.m + r);
    corr.store(st.corr + r);
  }
}

// acc[r0 + h][0:NV*kLanes] += sum_p w[p][r0 + h] v_p[0:NV*kLanes] for HG (<= 4) rows.
template <int HG, int NV>
inline void values_tile(const float* w, int64_t ldw, const float* v, int64_t ldv, int64_t n, float* acc,
                        int64_t ld_acc) {
  Vec a[HG][NV];
  for (int h = 0; h < HG; ++h)
    for (int i = 0; i < NV; ++i) a[h][i] = Vec::loadu(acc + h * ld_acc + i * kLanes);
  for (int64_t p = 0; p < n; ++p) {
    Vec vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = Vec::loadu(v + p * ldv + i * kLanes);
    for (int h = 0; h < HG; ++h) {
      const Vec wp(w[p * ldw + h]);
      for (int i = 0; i < NV; ++i) a[h][i] = at::vec::fmadd(wp, vv[i], a[h][i]);
    }
  }
  for (int h = 0; h < HG; ++h)
    for (int i = 0; i < NV; ++i) a[h][i].store(acc + h * ld_acc + i * kLanes);
}

template <int HG>
inline void values_rows(const float* w, int64_t ldw, const float* v, int64_t ldv, int64_t n, int64_t Dv,
                        float* acc) {
  int64_t d = 0;
  for (; d + 4 * kLanes <= Dv; d += 4 * kLanes) values_tile<HG, 4>(w, ldw, v + d, ldv, n, acc + d, Dv);
  switch ((Dv - d) / kLanes) {
    case 3: values_tile<HG, 3>(w, ldw, v + d, ldv, n, acc + d, Dv); break;
    case 2: values_tile<HG, 2>(w, ldw, v + d, ldv, n, acc + d, Dv); break;
    case 1: values_tile<HG, 1>(w, ldw, v + d, ldv, n, acc + d, Dv); break;
  }
  d += (Dv - d) / kLanes * kLanes;
  for (; d < Dv; ++d)  // Dv tail
    for (int h = 0; h < HG; ++h)
      for (int64_t p = 0; p < n; ++p) acc[h * Dv + d] += w[p * ldw + h] * v[p * ldv + d];
}

// acc [R, Dv] = acc * corr (per row) + w^T [R, n] . v [n, Dv]; rows [0, live) only (the rest is
// padding).
inline void chunk_values(const float* w, int64_t rows, int64_t live, const float* corr, const float* v,
                         int64_t ldv, int64_t n, int64_t Dv, float* acc) {
  for (int64_t r = 0; r < live; ++r)
    if (corr[r] != 1.f) scale(corr[r], acc + r * Dv, Dv);
  int64_t r = 0;
  for (; r + 4 <= live; r += 4) values_rows<4>(w + r, rows, v, ldv, n, Dv, acc + r * Dv);
  switch (live - r) {
    case 3: values_rows<3>(w + r, rows, v, ldv, n, Dv, acc + r * Dv); break;
    case 2: values_rows<2>(w + r, rows, v, ldv, n, Dv, acc + r * Dv); break;
    case 1: values_rows<1>(w + r, rows, v, ldv, n, Dv, acc + r * Dv); break;
  }
}

}  // namespace prefill
}  // namespace dlinfer_cpu
