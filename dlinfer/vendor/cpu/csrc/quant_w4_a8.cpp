// W4 with 8-bit activations: path 4 of w4_matmul_k_interleaved, the cpu vendor's opt-in for
// weight_quant_matmul (DLINFER_CPU_W4_ACTIVATIONS=int8; dlinfer/vendor/cpu/weight_quant.py). The
// k_interleaved weight (quant_w4_ki.h) against x quantised to signed bytes per row and group, the
// weight's own group: one vpdpbusd a line and row where the digit path spends four, and none of
// path 3's nibble-to-bfloat16 decode (docs/design.md, "W4 with 8-bit activations"); on an AVX2
// build vpmaddubsw + vpmaddwd give vpdpbusd's sums (the AVX2 block below). Path 5 (AVX2 builds,
// DLINFER_CPU_W4_ACTIVATIONS=int16; docs/design.md, "W4 with 16-bit activations") takes x as 16-bit
// integers per row and group (`quantise_group16`, its rule there) and multiplies them by the nibbles
// as int16 pairs, one vpmaddwd per 16 weights (`group_row_int16`).
//
// Arithmetic, per row m and group G of g rows of k (the weight's group):
//   a = max_{k in G} |x[m, k]|; sx = a / 127 and r = 127 / a (float32, each rounded once);
//   d_k = round_half_even(x[m, k] * r) (the float32 product rounded once, then to an integer: |d_k| <= 127,
//   as a * r < 127.5);
//   S = sum_k d_k; acc[c] = sum_k q[k, c] * d_k (vpdpbusd: unsigned nibble times signed byte, int32, exact);
//   D[c] = acc[c] - z[c] * S = sum_k (q[k, c] - z[c]) * d_k, exact, and exact as a float32
//   (|D| <= 15 * 127 * g < 2^21 for g <= 1024);
//   y[c] = fma(float(D), sx * s[c], y[c]) (sx * s rounded once, the fma once), groups in order from 0
//   (or, where run() splits a narrow weight's groups into two halves, each half so, then the halves
//   added: a split that depends on N, K and g only).
// So a row's bits depend on nothing but its own x and the weight: not on M, nor on the rows that
// share its block. An all-zero group adds nothing; a group holding an inf or a NaN has sx = NaN, so
// the row's outputs are NaN (as the digit paths). A group whose largest |x| is below ~2^-121 (where
// r = 127 / a would overflow float32) is quantised in double by the same rule.
// Error against x @ W, for x of normal range (sx itself a normal float32): each d_k * sx is x within
// sx / 2, so |y - x W| <= sum_G (sx / 2) sum_{k in G} |s (q - z)| plus float32's rounding of the
// groups' sum (tests/vendor/cpu/test_cpu_w4_int8_activations.py).
#include "entry_points.h"
#include "quant_w4_ki.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>

namespace dlinfer_cpu {
namespace w4v {
namespace {

// One group's quantisation: sx (the float32 step of its integers) and S (their sum): path 4's bytes,
// path 5's int16 values.
struct GroupInt8 {
  float scale;
  int32_t sum;
};

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// The sum of a vector's 8 int32 lanes (the quantisers' S).
inline int32_t sum8(__m256i v) {
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  return _mm_cvtsi128_si32(s4);
}
#endif

// x[0..g) -> d[0..g) and (sx, S), by the rule above.
GroupInt8 quantise_group(const float* x, int64_t g, int8_t* d) {
  float amax = 0.f;
  const bool finite = group_absmax(x, g, amax);
  if (!finite || amax == 0.f) {
    std::memset(d, 0, static_cast<size_t>(g));
    return {finite ? 0.f : std::numeric_limits<float>::quiet_NaN(), 0};
  }
  const float r = 127.0f / amax;
  int32_t sum = 0;
  int64_t k = 0;
  if (std::isfinite(r)) {
#if defined(CPU_CAPABILITY_AVX512)
    __m512i vsum = _mm512_setzero_si512();
    for (; k + 16 <= g; k += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), _mm512_set1_ps(r)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + k), _mm512_cvtepi32_epi8(q));
      vsum = _mm512_add_epi32(vsum, q);
    }
    sum = _mm512_reduce_add_epi32(vsum);
#elif defined(CPU_CAPABILITY_AVX2)
    __m256i vsum = _mm256_setzero_si256();
    for (; k + 8 <= g; k += 8) {  // |q| <= 127: the saturating packs keep every value
      const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), _mm256_set1_ps(r)));
      const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(d + k), _mm_packs_epi16(q16, q16));
      vsum = _mm256_add_epi32(vsum, q);
    }
    sum = sum8(vsum);
#endif
    for (; k < g; ++k) {
      const float p = x[k] * r;  // rounded once, as the vector product
      const int32_t q = static_cast<int32_t>(std::nearbyint(p));
      d[k] = static_cast<int8_t>(q);
      sum += q;
    }
  } else {  // a below ~2^-121: the same rule in double
    const double rd = 127.0 / static_cast<double>(amax);
    for (; k < g; ++k) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(static_cast<double>(x[k]) * rd));
      d[k] = static_cast<int8_t>(q);
      sum += q;
    }
  }
  return {amax / 127.0f, sum};
}

// Path 5's rule for one group x[0..g) (docs/design.md, "W4 with 16-bit activations"): e = the
// exponent of a = max |x| (frexp: a < 2^e), at least -135; X_k = round_half_even(x_k * 2^(14 - e)),
// |X_k| <= 2^14 (the product is exact: a power of two, in float32 where 2^(14 - e) is one, else in
// double); the step sx = 2^(e - 14) (a float32, exact: at least 2^-149). Every x_k within a factor
// 2^6 of a keeps all of a bfloat16's bits, and no X_k is off by more than half a step: |x_k - X_k
// sx| <= 2^(e - 15) <= a 2^-14. X [g] int16 in pair order (`kPairOrder`), S = sum_k X_k.
//
// Pair order: each block of 8 rows of k is stored as rows 0, 2, 4, 6, 1, 3, 5, 7, so its 32-bit
// words hold the pairs (0, 2), (4, 6), (1, 3), (5, 7): the rows of k whose nibbles a line half's
// 32-bit lane holds in its 16-bit halves at bits 0, 4, 8 and 12 (`group_row_int16`).
constexpr int kPairOrder[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // row j of a block -> its slot

GroupInt8 quantise_group16(const float* x, int64_t g, int16_t* X) {
  float amax = 0.f;
  const bool finite = group_absmax(x, g, amax);
  if (!finite || amax == 0.f) {
    std::memset(X, 0, static_cast<size_t>(g) * sizeof(int16_t));
    return {finite ? 0.f : std::numeric_limits<float>::quiet_NaN(), 0};
  }
  int e = 0;
  std::frexp(amax, &e);
  e = std::max(e, -135);
  int32_t sum = 0;
  const auto put = [&](int64_t k, int32_t v) {
    X[(k & ~int64_t{7}) + kPairOrder[k & 7]] = static_cast<int16_t>(v);
    sum += v;
  };
  int64_t k = 0;
  if (e >= -113) {  // 2^(14 - e) <= 2^127: a float32
    const float r = std::ldexp(1.0f, 14 - e);
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
    const __m256i pairs = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m256i vsum = _mm256_setzero_si256();
    for (; k + 8 <= g; k += 8) {  // cvtps2dq: round half to even in the default mode, as nearbyint
      const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), _mm256_set1_ps(r)));
      const __m256i p = _mm256_permutevar8x32_epi32(q, pairs);  // |q| <= 2^14: the pack keeps every value
      _mm_storeu_si128(reinterpret_cast<__m128i*>(X + k),
                       _mm_packs_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1)));
      vsum = _mm256_add_epi32(vsum, q);
    }
    sum = sum8(vsum);
#endif
    for (; k < g; ++k) put(k, static_cast<int32_t>(std::nearbyint(x[k] * r)));
  } else {
    const double r = std::ldexp(1.0, 14 - e);
    for (; k < g; ++k) put(k, static_cast<int32_t>(std::nearbyint(static_cast<double>(x[k]) * r)));
  }
  return {std::ldexp(1.0f, e - 14), sum};
}

// The activations of one call: DIG bytes a value (DIG = 1, path 4: d [M, K] signed bytes; DIG = 2,
// path 5: [M, K] int16 in pair order, from d), and per (m, group) (sx, S). One allocation.
struct Int8Rows {
  int64_t G;  // groups a row
  std::unique_ptr<char[]> buffer;
  int8_t* d;
  GroupInt8* groups;  // [M, G]
  const GroupInt8& group(int64_t m, int64_t gi) const { return groups[m * G + gi]; }
};

template <int DIG>
Int8Rows quantise_rows(const float* x, int64_t M, int64_t K, int64_t g) {
  const int64_t G = K / g;
  const size_t byte_count = static_cast<size_t>((M * DIG * K + 63) / 64 * 64);
  Int8Rows out{G, std::unique_ptr<char[]>(new char[byte_count + M * G * sizeof(GroupInt8)]), nullptr, nullptr};
  out.d = reinterpret_cast<int8_t*>(out.buffer.get());
  out.groups = reinterpret_cast<GroupInt8*>(out.buffer.get() + byte_count);
  at::parallel_for(0, M, grain_for(M, M * K * 4), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t gi = 0; gi < G; ++gi) {
        const float* xg = x + m * K + gi * g;
        int8_t* d = out.d + DIG * (m * K + gi * g);
        out.groups[m * G + gi] =
            DIG == 1 ? quantise_group(xg, g, d) : quantise_group16(xg, g, reinterpret_cast<int16_t*>(d));
      }
  });
  return out;
}

#if defined(CPU_CAPABILITY_AVX512)
// Rows m0..m0+MR-1 of tile t in group gi, all four 16-column vectors, into out(m) + 16 v (y += the
// group's part; the first group stores it); LEAD: the first block of rows, which prefetches the
// stream (a template argument, so the loop has no branch). Each line is decoded once (3
// instructions) for the MR rows. Each row and vector keeps A int32 accumulators: with A = 2 the low and the high nibbles
// (rows k..k+3 and k+4..k+7 of each line) go to their own, so at one row no vpdpbusd waits on the
// one before it; they are added at the group's end (integers: the same sum in any order, so A
// changes no bit). MR x 4 x A accumulators: at most 16.
template <int MR, int A, bool LEAD, typename S, typename Out>
kVnniTarget inline void group_rows_int8(const Layout& w, const Int8Rows& a, int64_t t, int64_t m0, int64_t gi,
                                        bool first, Out out) {
  constexpr int VB = kVecs;
  const int64_t per = w.g / kBlockK, K = w.K;
  const __m512i low = _mm512_set1_epi8(15);
  const uint8_t* const end = w.end() - kLineBytes;
  const uint8_t* const lines = w.block(t, gi) + w.param_bytes;
  __m512i acc[MR][VB][A];
  for (int r = 0; r < MR; ++r)
    for (int u = 0; u < VB; ++u)
      for (int i = 0; i < A; ++i) acc[r][u][i] = _mm512_setzero_si512();
  for (int64_t b = 0; b < per; ++b) {
    const uint8_t* const row_of_lines = lines + b * kVecs * kLineBytes;
    if (LEAD)  // the whole stream kPrefetchBytes on (past the tensor's end: its last line)
      for (int u = 0; u < kVecs; ++u) _mm_prefetch(ahead(row_of_lines, kPrefetchBytes + u * kLineBytes, end), _MM_HINT_T1);
    const int8_t* const xk = a.d + m0 * K + kBlockK * (gi * per + b);
    __m512i x03[MR], x47[MR];  // row r's bytes k..k+3 and k+4..k+7 in every 32-bit lane
    for (int r = 0; r < MR; ++r) {
      x03[r] = _mm512_set1_epi32(four_bytes(xk + r * K));
      x47[r] = _mm512_set1_epi32(four_bytes(xk + r * K + 4));
    }
    for (int u = 0; u < VB; ++u) {
      const __m512i bytes = _mm512_loadu_si512(row_of_lines + u * kLineBytes);
      const __m512i lo = _mm512_and_si512(bytes, low);                        // rows k..k+3
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);  // rows k+4..k+7
      for (int r = 0; r < MR; ++r) {
        acc[r][u][0] = _mm512_dpbusd_epi32(acc[r][u][0], lo, x03[r]);
        acc[r][u][A - 1] = _mm512_dpbusd_epi32(acc[r][u][A - 1], hi, x47[r]);
      }
    }
  }
  for (int v = 0; v < VB; ++v) {
    if (v >= w.vectors(t)) break;
    const __m512i z = zero_vec(w, t, gi, v);
    const __m512 s = scales_vec<S>(w, t, gi, v);
    for (int r = 0; r < MR; ++r) {
      const GroupInt8& q = a.group(m0 + r, gi);
      const __m512i sum = A == 2 ? _mm512_add_epi32(acc[r][v][0], acc[r][v][A - 1]) : acc[r][v][0];
      const __m512i D = _mm512_sub_epi32(sum, _mm512_mullo_epi32(z, _mm512_set1_epi32(q.sum)));
      float* y = out(m0 + r) + 16 * v;
      const __m512 prev = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y);
      _mm512_storeu_ps(y, _mm512_fmadd_ps(_mm512_cvtepi32_ps(D), _mm512_mul_ps(_mm512_set1_ps(q.scale), s), prev));
    }
  }
}

// Rows m0..m0+rows-1 (rows 1..4) of tile t in group gi, all four 16-column vectors at a time (each
// row's bytes broadcast once a line): 16, 12, 16 or 8 accumulators.
template <bool LEAD, typename S, typename Out>
kVnniTarget inline void block_int8(const Layout& w, const Int8Rows& a, int64_t t, int64_t m0, int64_t rows, int64_t gi,
                                   bool first, Out out) {
  switch (rows) {
    case 4:
      return group_rows_int8<4, 1, LEAD, S>(w, a, t, m0, gi, first, out);
    case 3:
      return group_rows_int8<3, 1, LEAD, S>(w, a, t, m0, gi, first, out);
    case 2:
      return group_rows_int8<2, 2, LEAD, S>(w, a, t, m0, gi, first, out);
    default:
      return group_rows_int8<1, 2, LEAD, S>(w, a, t, m0, gi, first, out);
  }
}

#define DLINFER_INT8_TARGET kVnniTarget
#elif defined(CPU_CAPABILITY_AVX2)
// AVX2 (no VNNI): vpdpbusd's four products a lane as vpmaddubsw (unsigned nibble times signed
// byte, adjacent pairs summed in int16: |pair| <= 2 * 15 * 128, never saturating) on the low and
// the high nibbles, the two int16 sums added (|sum| <= 7680), then vpmaddwd by 1 into int32: the
// same exact integer acc as the VNNI path, so the same D and the same float32 steps after it (the
// same bits). A line's 16 lanes are two 8-lane halves.
#define DLINFER_INT8_TARGET

// A line half (32 bytes: 8 columns x 8 rows of k, two nibbles a byte) as its low nibbles (rows
// k..k+3) and its high ones (rows k+4..k+7), each a byte.
struct Nibbles {
  __m256i lo, hi;
};

inline Nibbles nibbles(const uint8_t* half) {
  const __m256i low = _mm256_set1_epi8(15);
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(half));
  return {_mm256_and_si256(bytes, low), _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low)};
}

// The half's 8 int32 sums against one row's bytes k..k+3 (x03) and k+4..k+7 (x47), each broadcast
// to every 32-bit lane.
inline __m256i nibble_sums(Nibbles n, __m256i x03, __m256i x47) {
  const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(n.lo, x03), _mm256_maddubs_epi16(n.hi, x47));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

// Columns c..c+7 of tile t in group gi: the zero points (as int32) and the scales (as float32).
inline __m256i zeros8(const Layout& w, int64_t t, int64_t gi, int c) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.zeros(t, gi) + c)));
}

template <typename S>
inline __m256 scales8(const Layout& w, int64_t t, int64_t gi, int c) {
  const S* src = w.scales<S>(t, gi) + c;
  if constexpr (std::is_same_v<S, float>) {
    return _mm256_loadu_ps(src);
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  }
}

// The group's part of 8 outputs of one row (the epilogue of the rule above): y (+)= float(acc -
// z * S) * (sx * s); `first`: the first group of the range stores instead of adding.
inline void add_group8(__m256i acc, __m256i z, __m256 s, const GroupInt8& q, bool first, float* y) {
  const __m256i D = _mm256_sub_epi32(acc, _mm256_mullo_epi32(z, _mm256_set1_epi32(q.sum)));
  const __m256 prev = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y);
  _mm256_storeu_ps(y, _mm256_fmadd_ps(_mm256_cvtepi32_ps(D), _mm256_mul_ps(_mm256_set1_ps(q.scale), s), prev));
}

// The epilogue of one row's group (group_row_int8, group_row_int16): acc[2 v + h] holds the sums of
// line half h of vector v, columns 16 v + 8 h .. + 7.
template <typename S, typename Out>
inline void add_group_row(const Layout& w, const GroupInt8& q, int64_t t, int64_t m, int64_t gi, bool first,
                          const __m256i* acc, Out out) {
  for (int v = 0; v < w.vectors(t); ++v)
    for (int h = 0; h < 2; ++h) {
      const int c = 16 * v + 8 * h;
      add_group8(acc[2 * v + h], zeros8(w, t, gi, c), scales8<S>(w, t, gi, c), q, first, out(m) + c);
    }
}

// One row (m0) of tile t in group gi: the four vectors' eight accumulators fit in registers, so the
// group's lines are read in memory order (the stream's prefetch pattern, as the VNNI path). They
// are eight named variables, line half u of a 256-byte row of lines in a<u> (vector u / 2, half
// u % 2), not an array: GCC unrolls a loop only after deciding what stays in registers, and an
// array indexed in the loop stayed on the stack, a load and a store a line half (seen in the
// compiled loop on the Zen 3 EPYC; docs/notes/cpu-ops.md, "Accumulators on the stack").
template <bool LEAD, typename S, typename Out>
inline void group_row_int8(const Layout& w, const Int8Rows& a, int64_t t, int64_t m0, int64_t gi, bool first,
                           Out out) {
  const int64_t per = w.g / kBlockK;
  const uint8_t* const end = w.end() - kLineBytes;
  const uint8_t* const lines = w.block(t, gi) + w.param_bytes;
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t b = 0; b < per; ++b) {
    const uint8_t* const row_of_lines = lines + b * kVecs * kLineBytes;
    if (LEAD)
      for (int u = 0; u < kVecs; ++u) _mm_prefetch(ahead(row_of_lines, kPrefetchBytes + u * kLineBytes, end), _MM_HINT_T1);
    const int8_t* const xk = a.d + m0 * w.K + kBlockK * (gi * per + b);
    const __m256i x03 = _mm256_set1_epi32(four_bytes(xk)), x47 = _mm256_set1_epi32(four_bytes(xk + 4));
    const auto half = [&](__m256i& acc, int u) __attribute__((always_inline)) {
      acc = _mm256_add_epi32(acc, nibble_sums(nibbles(row_of_lines + 32 * u), x03, x47));
    };
    half(a0, 0), half(a1, 1), half(a2, 2), half(a3, 3), half(a4, 4), half(a5, 5), half(a6, 6), half(a7, 7);
  }
  const __m256i acc[2 * kVecs] = {a0, a1, a2, a3, a4, a5, a6, a7};
  add_group_row<S>(w, a.group(m0, gi), t, m0, gi, first, acc, out);
}

// Path 5, row m of x (its int16 values in pair order) of tile t in group gi, the lines in memory
// order as group_row_int8. A line half's 32-bit lane (one column, rows k..k+7) holds in each 16-bit
// half two bytes, (k | k+4 << 4) and (k+1 | k+5 << 4) in the low one: masked with 15 after shifts
// by 0, 4, 8 and 12 bits, the lane's two halves are the nibbles of rows (k, k+2), (k+4, k+6),
// (k+1, k+3), (k+5, k+7), the pairs x's words hold, so vpmaddwd gives q_k X_k + q_k' X_k' (exact:
// at most 2 x 15 x 2^14) and the int32 sums are path 4's integer acc for 16-bit X (|acc| <= 15 x
// 2^14 x g < 2^31 for g <= 1024). Four vpmaddwd per 64 weights, where two bytes a value cost four
// vpmaddubsw and two vpmaddwd (docs/notes/cpu-ops.md, "Path 5 on int16 pairs").
template <bool LEAD, typename S, typename Out>
inline void group_row_int16(const Layout& w, const Int8Rows& a, int64_t t, int64_t m, int64_t gi, bool first,
                            Out out) {
  const int64_t per = w.g / kBlockK;
  const uint8_t* const end = w.end() - kLineBytes;
  const uint8_t* const lines = w.block(t, gi) + w.param_bytes;
  const int8_t* const words = a.d + 2 * (m * w.K + gi * w.g);
  const __m256i low = _mm256_set1_epi16(15);
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;  // as group_row_int8's
  for (int64_t b = 0; b < per; ++b) {
    const uint8_t* const row_of_lines = lines + b * kVecs * kLineBytes;
    if (LEAD)
      for (int u = 0; u < kVecs; ++u) _mm_prefetch(ahead(row_of_lines, kPrefetchBytes + u * kLineBytes, end), _MM_HINT_T1);
    const int8_t* const xb = words + 2 * kBlockK * b;  // rows (0, 2), (4, 6), (1, 3), (5, 7): 4 bytes each
    const __m256i x02 = _mm256_set1_epi32(four_bytes(xb)), x46 = _mm256_set1_epi32(four_bytes(xb + 4));
    const __m256i x13 = _mm256_set1_epi32(four_bytes(xb + 8)), x57 = _mm256_set1_epi32(four_bytes(xb + 12));
    const auto half = [&](__m256i& acc, int u) __attribute__((always_inline)) {  // one add after another: fewer live registers
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_of_lines + 32 * u));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_and_si256(v, low), x02));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), x46));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 8), low), x13));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_srli_epi16(v, 12), x57));
    };
    half(a0, 0), half(a1, 1), half(a2, 2), half(a3, 3), half(a4, 4), half(a5, 5), half(a6, 6), half(a7, 7);
  }
  const __m256i acc[2 * kVecs] = {a0, a1, a2, a3, a4, a5, a6, a7};
  add_group_row<S>(w, a.group(m, gi), t, m, gi, first, acc, out);
}

// MR (2..4) rows of tile t in group gi, vector by vector over the group's lines (its 4 KB stays in
// L1 across the four vectors): MR rows x 2 halves of int32 accumulators.
template <int MR, bool LEAD, typename S, typename Out>
inline void group_rows_int8(const Layout& w, const Int8Rows& a, int64_t t, int64_t m0, int64_t gi, bool first,
                            Out out) {
  const int64_t per = w.g / kBlockK, K = w.K;
  const uint8_t* const end = w.end() - kLineBytes;
  const uint8_t* const lines = w.block(t, gi) + w.param_bytes;
  for (int v = 0; v < w.vectors(t); ++v) {
    __m256i acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t b = 0; b < per; ++b) {
      const uint8_t* const line = lines + (b * kVecs + v) * kLineBytes;
      if (LEAD && v == 0)  // the whole stream kPrefetchBytes on, as the VNNI path
        for (int u = 0; u < kVecs; ++u) _mm_prefetch(ahead(line, kPrefetchBytes + u * kLineBytes, end), _MM_HINT_T1);
      const int8_t* const xk = a.d + m0 * K + kBlockK * (gi * per + b);
      __m256i x03[MR], x47[MR];
      for (int r = 0; r < MR; ++r) {
        x03[r] = _mm256_set1_epi32(four_bytes(xk + r * K));
        x47[r] = _mm256_set1_epi32(four_bytes(xk + r * K + 4));
      }
      for (int h = 0; h < 2; ++h) {  // each half decoded once for the MR rows
        const Nibbles n = nibbles(line + 32 * h);
        for (int r = 0; r < MR; ++r) acc[r][h] = _mm256_add_epi32(acc[r][h], nibble_sums(n, x03[r], x47[r]));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const int c = 16 * v + 8 * h;
      const __m256i z = zeros8(w, t, gi, c);
      const __m256 s = scales8<S>(w, t, gi, c);
      for (int r = 0; r < MR; ++r) add_group8(acc[r][h], z, s, a.group(m0 + r, gi), first, out(m0 + r) + c);
    }
  }
}

// Rows m0..m0+rows-1 (rows 1..4) of tile t in group gi, as the VNNI path's block_int8.
template <bool LEAD, typename S, typename Out>
inline void block_int8(const Layout& w, const Int8Rows& a, int64_t t, int64_t m0, int64_t rows, int64_t gi, bool first,
                       Out out) {
  switch (rows) {
    case 4:
      return group_rows_int8<4, LEAD, S>(w, a, t, m0, gi, first, out);
    case 3:
      return group_rows_int8<3, LEAD, S>(w, a, t, m0, gi, first, out);
    case 2:
      return group_rows_int8<2, LEAD, S>(w, a, t, m0, gi, first, out);
    default:
      return group_row_int8<LEAD, S>(w, a, t, m0, gi, first, out);
  }
}

// Path 5: rows 0..M-1 of tile t over groups g0..g1, group by group, one row at a time (its lines in
// memory order: on the Zen 3 EPYC, 2 threads, the 1B shapes' four linears from memory, the first
// form of path 5 (x as two rows of bytes) took 0.57-0.63 of column_tiled's float kernel's time at
// one row this way against 0.92-1.07 vector by vector as group_rows_int8 reads its rows; four rows
// 0.66-0.67 against 0.72 in blocks of two rows of x); the first row prefetches the stream.
template <typename S, typename Out>
inline void tile_int16(const Layout& w, const Int8Rows& a, int64_t t, int64_t M, int64_t g0, int64_t g1, Out out) {
  for (int64_t gi = g0; gi < g1; ++gi) {
    group_row_int16<true, S>(w, a, t, 0, gi, gi == g0, out);
    for (int64_t m = 1; m < M; ++m) group_row_int16<false, S>(w, a, t, m, gi, gi == g0, out);
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// Rows 0..M-1 of tile t over groups g0..g1, group by group (the group's lines stay in L1 while
// every block of up to 4 rows reads them); the first block prefetches the stream.
template <typename S, typename Out>
DLINFER_INT8_TARGET void tile_int8(const Layout& w, const Int8Rows& a, int64_t t, int64_t M, int64_t g0, int64_t g1, Out out) {
  if (M <= 0) return;  // (the op returns before calling for M = 0)
  for (int64_t gi = g0; gi < g1; ++gi) {
    block_int8<true, S>(w, a, t, 0, std::min<int64_t>(4, M), gi, gi == g0, out);
    for (int64_t m0 = 4; m0 < M; m0 += 4) block_int8<false, S>(w, a, t, m0, std::min<int64_t>(4, M - m0), gi, gi == g0, out);
  }
}
#undef DLINFER_INT8_TARGET
#endif

}  // namespace

bool int8_path_here() {
#if defined(CPU_CAPABILITY_AVX512)
  return vnni_here();
#elif defined(CPU_CAPABILITY_AVX2)
  return true;
#else
  return false;
#endif
}

template <typename S>
void run_int8(const Layout& w, const float* x, int64_t M, const float* bias, float* y) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const Int8Rows a = quantise_rows<1>(x, M, w.K, w.g);
  run(w, M, bias, y, [&](int64_t t, int64_t g0, int64_t g1, auto row) { tile_int8<S>(w, a, t, M, g0, g1, row); });
#else
  (void)w, (void)x, (void)M, (void)bias, (void)y;
  TORCH_CHECK(false, "w4_matmul_k_interleaved: path 4 (8-bit activations) needs AVX-512 VNNI or AVX2");
#endif
}

template void run_int8<at::Half>(const Layout&, const float*, int64_t, const float*, float*);
template void run_int8<float>(const Layout&, const float*, int64_t, const float*, float*);

bool int16_path_here() {
#if defined(CPU_CAPABILITY_AVX2)
  return true;
#else
  return false;
#endif
}

template <typename S>
void run_int16(const Layout& w, const float* x, int64_t M, const float* bias, float* y) {
#if defined(CPU_CAPABILITY_AVX2)
  const Int8Rows a = quantise_rows<2>(x, M, w.K, w.g);
  run(w, M, bias, y, [&](int64_t t, int64_t g0, int64_t g1, auto row) { tile_int16<S>(w, a, t, M, g0, g1, row); });
#else
  (void)w, (void)x, (void)M, (void)bias, (void)y;
  TORCH_CHECK(false, "w4_matmul_k_interleaved: path 5 (16-bit activations) runs on AVX2 builds only");
#endif
}

template void run_int16<at::Half>(const Layout&, const float*, int64_t, const float*, float*);
template void run_int16<float>(const Layout&, const float*, int64_t, const float*, float*);

}  // namespace w4v
}  // namespace dlinfer_cpu
