// W4A16 (weight_quant_matmul): y[M, N] = x[M, K] W[K, N] (+ bias), W 4-bit in LMDeploy's AWQ
// gemm packing (dlinfer/vendor/w4_layouts.py): qweight int32 [K, N/8], column 8j + kOrder[i] at
// bits 4i..4i+3 of word j; W[k, c] = (q - z[k / g, c]) * s[k / g, c]; or the column_tiled layout
// int32 [ceil(N/128), K, 16], each 128-column tile contiguous over K, its columns in nibble order.
//
// The weight is dequantised in registers, never stored as floats. A thread
// owns tiles of 128 columns (16 words); per k it loads the tile's 16 words once (64 bytes: the
// canonical layout reads them K times with a stride of N/2 bytes, the column_tiled one as one
// stream) and splits them into 8 vectors of 16 lanes, vector i holding nibble i of each word
// (column_tiled: the tile's columns 16i..16i+15; canonical: columns 8w + kOrder[i]).
// Per group: acc = fma(x[k], float(q - z), acc) for k in order (q - z exact in float), then
// y = fma(acc, s, y) per group, in float32 (few-tile shapes: over each half of the groups, the
// two halves then added; see run_rows); bias added, one rounding to x's dtype. Every lane
// does that arithmetic in that order on every path (AVX-512, AVX2, portable), so both layouts give
// identical bits (the vector paths' power-of-two scaling barring float32 overflow past |x| ~ 1e32
// or subnormal sums: there the vector and portable builds could differ). All rows share each
// decoded nibble (AVX-512, 3-8 rows: in four passes of two nibbles; AVX2: see its passes below).
// At one row the decode, not the memory, is the bound (one core decodes ~23 GB/s of packed weight
// from L2): the group's zero points and scales are vector loads (column_tiled: its columns in
// nibble order, so a group's 16 scales per nibble are contiguous; canonical: gathers), one row of a
// column_tiled tile keeps its outputs, zero points and scales in registers (tile_row1_tiled), and
// everything a tile reads next (its rows 64 ahead, the next tile's first rows, the next group's scales) is
// prefetched, so the stream does not stall between tiles and groups.
//
// Beyond kMaxRowsW4 rows: `w4_dequantise_tiles` (quant_w4_tiles.cpp) gives float32 tiles for a GEMM (the
// caller, weight_quant.py, walks N in blocks: never the whole float weight). Measured on one core
// of the Zen 5 VM, w4_matmul beats that path 1.9-3x from 64 to 512 rows (docs/notes/w4a16-kernels.md):
// on AVX-512 8 rows share each decoded nibble, and the FMAs run from registers like a GEMM
// micro-kernel's. AVX2 builds switch at 128 rows (quant_w4.h: their blocks of 4 rows decode the
// weight M / 4 times).
#include "entry_points.h"
#include "quant_w4.h"

#include <memory>

namespace dlinfer_cpu {
namespace {

using namespace w4;

constexpr int kShift[8] = {0, 4, 8, 12, 16, 0, 4, 8};  // 4i' of nibble i (the vector paths' decode, below)

// The decode loops are inlined by force: left to its heuristics, GCC inlined them for some
// (scale dtype, rows) instantiations and not others, and the calls that stayed spilled the
// accumulators: 576 x 3072 at 8 rows took 63 us with float32 scales and 160 us with float16 ones.
#define kAlwaysInline inline __attribute__((always_inline))

// The same per-lane arithmetic, lane by lane (std::fma is the fused multiply-add): the portable
// path. (AVX2 took it at two rows until its passes kept their accumulators in registers.)
template <int MR>
inline void group_rows_lanes(const Packed& w, const float* const* xr, int64_t t,
                       int64_t k0, int64_t k1, int rwords, const int32_t* zs, const float* ss, float* ybuf) {
  float acc[MR][kTileCols] = {};
  for (int64_t k = k0; k < k1; ++k) {
    const int32_t* words = w.row(t, k);
    for (int wd = 0; wd < rwords; ++wd) {
      const int32_t v = words[wd];
      for (int i = 0; i < 8; ++i) {
        const float d = static_cast<float>(((v >> (4 * i)) & 15) - zs[i * kTileWords + wd]);
        for (int m = 0; m < MR; ++m) acc[m][i * kTileWords + wd] = std::fma(xr[m][k], d, acc[m][i * kTileWords + wd]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int l = 0; l < kTileCols; ++l) ybuf[m * kTileCols + l] = std::fma(acc[m][l], ss[l], ybuf[m * kTileCols + l]);
}

#if defined(CPU_CAPABILITY_AVX512)
// acc[m][i] over rows k0..k1 of tile t, then ybuf[m][i] = fma(acc, s, ybuf).
//
// The decode takes 3 instructions per nibble and no int -> float conversion: a nibble masked in
// place (bits 4i'..4i'+3, i' = i for i < 5, i - 5 after one shift by 20 for i >= 5) OR 0x4B000000
// is the float 2^23 + q * 2^(4i'), exactly; minus 2^23 + z * 2^(4i') it is (q - z) * 2^(4i'),
// exactly. So acc[i] accumulates 2^(4i') times the plain sum, every rounding scaled by the same
// power of two, and the exact multiply by 2^-(4i') at the group's end gives the plain sum's bits
// (the portable path's; barring float32 overflow past |x| ~ 1e32 or subnormal sums).
//
// MR rows x NI nibbles of accumulators: NI = 8 for 1 row (one pass), 4 for 2 rows (two), 2 for 3-8 rows (four
// passes over the group's words, from L1/L2, each nibble decoded once for all the rows).

// Zero points z of nibble i (16 lanes) as the float 2^23 + z * 2^(4i') that nibble() subtracts.
kAlwaysInline __m512 magic_zero(const __m512i z, int i, const __m512i magic) {
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_sllv_epi32(z, _mm512_set1_epi32(kShift[i])), magic));
}

template <int I, int J, int MR, int NI>
kAlwaysInline void nibble(const __m512i lo, const __m512i hi, const __m512i magic, const __m512* zf, const __m512* xb,
                   __m512 (&acc)[MR][NI]) {
  // (src & mask) | magic: ternary-logic truth table 0xEA = (A & B) | C
  const __m512i bits = _mm512_ternarylogic_epi32(I < 5 ? lo : hi, _mm512_set1_epi32(15 << kShift[I]), magic, 0xEA);
  const __m512 d = _mm512_sub_ps(_mm512_castsi512_ps(bits), zf[J]);
  for (int m = 0; m < MR; ++m) acc[m][J] = _mm512_fmadd_ps(xb[m], d, acc[m][J]);
}

template <int MR, int I0, int NI>
kAlwaysInline void group_pass(const Packed& w, const float* const* xr, int64_t t, int64_t k0, int64_t k1,
                              __mmask16 mask, const int32_t* zs, const float* ss, float* ybuf) {
  __m512 acc[MR][NI];
  __m512 zf[NI];  // 2^23 + z * 2^(4i')
  const __m512i magic = _mm512_set1_epi32(0x4B000000);
  for (int j = 0; j < NI; ++j) zf[j] = magic_zero(_mm512_loadu_si512(zs + (I0 + j) * kTileWords), I0 + j, magic);
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NI; ++j) acc[m][j] = _mm512_setzero_ps();
  auto [pf, pf_step] = w.ahead(t, k0, k1);
  for (int64_t k = k0; k < k1; ++k, pf += pf_step) {
    if (I0 == 0) _mm_prefetch(reinterpret_cast<const char*>(pf), _MM_HINT_T0);
    const __m512i lo = _mm512_maskz_loadu_epi32(mask, w.row(t, k));
    const __m512i hi = _mm512_srli_epi32(lo, 20);
    __m512 xb[MR];
    for (int m = 0; m < MR; ++m) xb[m] = _mm512_set1_ps(xr[m][k]);
    [&]<int... J>(std::integer_sequence<int, J...>) __attribute__((always_inline)) {
      (nibble<I0 + J, J, MR, NI>(lo, hi, magic, zf, xb, acc), ...);
    }(std::make_integer_sequence<int, NI>{});
  }
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < NI; ++j) {
      float* yb = ybuf + m * kTileCols + (I0 + j) * kTileWords;
      const __m512 a = _mm512_mul_ps(acc[m][j], _mm512_set1_ps(1.0f / static_cast<float>(1 << kShift[I0 + j])));
      _mm512_storeu_ps(yb, _mm512_fmadd_ps(a, _mm512_loadu_ps(ss + (I0 + j) * kTileWords), _mm512_loadu_ps(yb)));
    }
  }
}

template <int MR>
kAlwaysInline void group_rows(const Packed& w, const float* const* xr, int64_t t, int64_t k0, int64_t k1,
                              __mmask16 mask, const int32_t* zs, const float* ss, float* ybuf) {
  if constexpr (MR == 1) {
    group_pass<MR, 0, 8>(w, xr, t, k0, k1, mask, zs, ss, ybuf);
  } else if constexpr (MR == 2) {
    group_pass<MR, 0, 4>(w, xr, t, k0, k1, mask, zs, ss, ybuf);
    group_pass<MR, 4, 4>(w, xr, t, k0, k1, mask, zs, ss, ybuf);
  } else {
    group_pass<MR, 0, 2>(w, xr, t, k0, k1, mask, zs, ss, ybuf);
    group_pass<MR, 2, 2>(w, xr, t, k0, k1, mask, zs, ss, ybuf);
    group_pass<MR, 4, 2>(w, xr, t, k0, k1, mask, zs, ss, ybuf);
    group_pass<MR, 6, 2>(w, xr, t, k0, k1, mask, zs, ss, ybuf);
  }
}
// One row of a column_tiled tile over groups g0..g1 into lanes[128] (the decode of one token): the
// arithmetic of group_params + group_pass<1, 0, 8>, in the same order (same bits), with the tile's
// outputs, zero points and scales kept in registers from group to group instead of going through
// the zs / ss / ybuf arrays. NI: the nibbles decoded, 8, or 4 for a last tile of at most 64
// columns (column_tiled holds them in nibbles 0-3; the lanes of the others are zero columns, never
// stored): SmolLM2's N = 576 and 960 end in such a tile.
template <typename T, int NI>
void tile_row1_tiled_n(const Problem<T>& p, const float* x, int64_t t, int64_t g0, int64_t g1, float* lanes) {
  const int nwords = p.w.tile_words(t), ncols = 8 * nwords;
  const __m512i magic = _mm512_set1_epi32(0x4B000000);
  __m512 y[8];
  for (int i = 0; i < 8; ++i) y[i] = _mm512_setzero_ps();
  for (int64_t gi = g0; gi < g1; ++gi) {
    if (gi + 1 < g1) prefetch_group_params(p, t, gi + 1, nwords);
    const __m512i zw = zero_words(p, t, gi, nwords);
    __m512 zf[NI], acc[1][NI];
    for (int i = 0; i < NI; ++i) {
      zf[i] = magic_zero(tiled_zero_points(zw, i), i, magic);
      acc[0][i] = _mm512_setzero_ps();
    }
    const int64_t k0 = gi * p.g, k1 = k0 + p.g;
    auto [pf, pf_step] = p.w.ahead(t, k0, k1);
    for (int64_t k = k0; k < k1; ++k, pf += pf_step) {
      _mm_prefetch(reinterpret_cast<const char*>(pf), _MM_HINT_T0);
      const __m512i lo = _mm512_loadu_si512(p.w.row(t, k));
      const __m512i hi = _mm512_srli_epi32(lo, 20);
      const __m512 xb[1] = {_mm512_set1_ps(x[k])};
      [&]<int... J>(std::integer_sequence<int, J...>) __attribute__((always_inline)) {
        (nibble<J, J, 1, NI>(lo, hi, magic, zf, xb, acc), ...);
      }(std::make_integer_sequence<int, NI>{});
    }
    const T* src = p.scale + gi * p.N + kTileCols * t;
    for (int i = 0; i < NI; ++i) {
      const __m512 a = _mm512_mul_ps(acc[0][i], _mm512_set1_ps(1.0f / static_cast<float>(1 << kShift[i])));
      y[i] = _mm512_fmadd_ps(a, scales16(src, i * kTileWords, ncols), y[i]);
    }
  }
  for (int i = 0; i < 8; ++i) _mm512_store_ps(lanes + i * kTileWords, y[i]);
}

template <typename T>
void tile_row1_tiled(const Problem<T>& p, const float* x, int64_t t, int64_t g0, int64_t g1, float* lanes) {
  if (p.w.tile_words(t) <= kTileWords / 2) {
    tile_row1_tiled_n<T, 4>(p, x, t, g0, g1, lanes);
  } else {
    tile_row1_tiled_n<T, 8>(p, x, t, g0, g1, lanes);
  }
}
#elif defined(CPU_CAPABILITY_AVX2)
// AVX2: the AVX-512 decode above (the same magic-float arithmetic, so the same bits) in 8-lane
// vectors, without ternary logic (an and, then an or). A tile's row is two halves of 8 words: half
// h holds lanes i * 16 + 8h .. + 7 of every nibble i. A pass keeps MR x NI accumulators of one
// half (AVX2 has 16 vector registers; the zero-point vectors may live in L1): NI = 8 nibbles for
// 1 row, 4 for 2-4 rows (kRowBlock is 4 here); a group takes 2 * 8 / NI passes over its words, the
// later ones from L1. At 3 and 4 rows NI = 4 (12 or 16 sums; at 4, 7 live on the stack) beat
// NI = 2 (each row's word loaded and x broadcast in twice as many passes): 1.12-1.16x at 3 rows,
// 1.04-1.09x at 4 on the 1B shapes' weights from memory, 1.00-1.09x on SmolLM2's at 4; NI = 1 lost
// (0.6-0.8x). Same bits (each lane's sums in the same order over k); docs/notes/cpu-ops.md, "W4A16
// at two to four rows on AVX2".
//
// Two things GCC needs told (seen in the compiled loop on a 2-core Zen 3 EPYC, one thread, hot
// weights; x [M, 2048] @ [2048, 1024], a copy of the pass in a micro-benchmark): every loop over the
// rows and nibbles is unrolled by pragma, so that the accumulator array becomes registers (left
// to itself, GCC kept the array in memory from 2 rows on and stored all MR x NI accumulators to
// the stack on every k: 8 stores an iteration at 4 rows, 1.8 -> 3.4 G 256-bit FMAs a second with
// the pragmas); and a row whose 16 words all hold nibbles (every column_tiled row, a whole
// canonical tile) is a plain load, not a masked one (vpmaskmovd, in that micro-benchmark: 1.8 ->
// 2.0 G FMAs a second at one row, 1.6 -> 2.6 in an 8-row pass).
template <int I, int J, int MR, int NI>
kAlwaysInline void nibble8(const __m256i lo, const __m256i hi, const __m256i magic, const __m256* zf,
                           const __m256* xb, __m256 (&acc)[MR][NI]) {
  const __m256i bits = _mm256_or_si256(_mm256_and_si256(I < 5 ? lo : hi, _mm256_set1_epi32(15 << kShift[I])), magic);
  const __m256 d = _mm256_sub_ps(_mm256_castsi256_ps(bits), zf[J]);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) acc[m][J] = _mm256_fmadd_ps(xb[m], d, acc[m][J]);
}

template <int MR, int I0, int NI, int H, bool FULL>
kAlwaysInline void group_pass8(const Packed& w, const float* const* xr, int64_t t, int64_t k0, int64_t k1,
                               const __m256i mask, const int32_t* zs, const float* ss, float* ybuf) {
  __m256 acc[MR][NI];
  __m256 zf[NI];  // 2^23 + z * 2^(4i')
  const __m256i magic = _mm256_set1_epi32(0x4B000000);
#pragma GCC unroll 8
  for (int j = 0; j < NI; ++j) {
    const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(zs + (I0 + j) * kTileWords + 8 * H));
    zf[j] = _mm256_castsi256_ps(_mm256_or_si256(_mm256_sllv_epi32(z, _mm256_set1_epi32(kShift[I0 + j])), magic));
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NI; ++j) acc[m][j] = _mm256_setzero_ps();
  auto [pf, pf_step] = w.ahead(t, k0, k1);
  for (int64_t k = k0; k < k1; ++k, pf += pf_step) {
    if (I0 == 0 && H == 0) _mm_prefetch(reinterpret_cast<const char*>(pf), _MM_HINT_T0);
    const int32_t* row = w.row(t, k) + 8 * H;
    const __m256i lo = FULL ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)) : _mm256_maskload_epi32(row, mask);
    const __m256i hi = _mm256_srli_epi32(lo, 20);
    __m256 xb[MR];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) xb[m] = _mm256_broadcast_ss(xr[m] + k);
    [&]<int... J>(std::integer_sequence<int, J...>) __attribute__((always_inline)) {
      (nibble8<I0 + J, J, MR, NI>(lo, hi, magic, zf, xb, acc), ...);
    }(std::make_integer_sequence<int, NI>{});
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 8
    for (int j = 0; j < NI; ++j) {
      float* yb = ybuf + m * kTileCols + (I0 + j) * kTileWords + 8 * H;
      const __m256 a = _mm256_mul_ps(acc[m][j], _mm256_set1_ps(1.0f / static_cast<float>(1 << kShift[I0 + j])));
      _mm256_storeu_ps(yb, _mm256_fmadd_ps(a, _mm256_loadu_ps(ss + (I0 + j) * kTileWords + 8 * H), _mm256_loadu_ps(yb)));
    }
  }
}

template <int MR, int NI, int H, bool FULL, int... P>
kAlwaysInline void half_passes(const Packed& w, const float* const* xr, int64_t t, int64_t k0, int64_t k1,
                               const __m256i mask, const int32_t* zs, const float* ss, float* ybuf,
                               std::integer_sequence<int, P...>) {
  (group_pass8<MR, P * NI, NI, H, FULL>(w, xr, t, k0, k1, mask, zs, ss, ybuf), ...);
}

template <int MR>
inline void group_rows(const Packed& w, const float* const* xr, int64_t t,
                       int64_t k0, int64_t k1, int rwords, const int32_t* zs, const float* ss, float* ybuf) {
  constexpr int NI = MR == 1 ? 8 : MR <= 4 ? 4 : 1;  // 5-8 rows: instantiated, never run (kRowBlock)
  constexpr auto passes = std::make_integer_sequence<int, 8 / NI>{};
  if (rwords == kTileWords) {  // plain loads (the mask unused)
    half_passes<MR, NI, 0, true>(w, xr, t, k0, k1, first_words8(8), zs, ss, ybuf, passes);
    half_passes<MR, NI, 1, true>(w, xr, t, k0, k1, first_words8(8), zs, ss, ybuf, passes);
    return;
  }
  half_passes<MR, NI, 0, false>(w, xr, t, k0, k1, first_words8(rwords), zs, ss, ybuf, passes);
  if (rwords > 8)  // a last tile of at most 64 columns has no second half
    half_passes<MR, NI, 1, false>(w, xr, t, k0, k1, first_words8(rwords - 8), zs, ss, ybuf, passes);
}
#else
// Portable: the lane-by-lane loop (group_rows_lanes, above).
template <int MR>
inline void group_rows(const Packed& w, const float* const* xr, int64_t t,
                       int64_t k0, int64_t k1, int rwords, const int32_t* zs, const float* ss, float* ybuf) {
  group_rows_lanes<MR>(w, xr, t, k0, k1, rwords, zs, ss, ybuf);
}
#endif

// Tile t's 128 values in lane order (lane i * 16 + w: column p.w.lane_column(t, i, w)) into a row
// of y in column order, + bias. column_tiled lanes are already in column order: a copy.
template <typename T>
inline void store_tile(const Problem<T>& p, int64_t t, const float* lanes, float* yr) {
  const int nwords = p.w.tile_words(t);
  if (p.w.tiled) {
    const int64_t c0 = kTileCols * t;
    for (int l = 0; l < 8 * nwords; ++l) yr[c0 + l] = p.bias ? lanes[l] + p.bias[c0 + l] : lanes[l];
    return;
  }
  for (int w = 0; w < nwords; ++w) {
    for (int i = 0; i < 8; ++i) {
      const int64_t c = p.w.lane_column(t, i, w);
      const float v = lanes[i * kTileWords + w];
      yr[c] = p.bias ? v + p.bias[c] : v;
    }
  }
}

// Rows m0..m0+MR-1 of tile t over groups g0..g1: into the tile's columns of y (+ bias) when part
// is null, else into part (row m's lanes at part[m * lanes + t * 128 ...], lane order, no bias).
template <typename T, int MR>
void tile_rows(const Problem<T>& p, int64_t t, int64_t m0, int64_t g0, int64_t g1, float* part, int64_t lanes) {
  const int nwords = p.w.tile_words(t);
  alignas(64) float ybuf[MR * kTileCols] = {};
  alignas(64) int32_t zs[kTileCols];
  alignas(64) float ss[kTileCols];
  const float* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = p.x + (m0 + m) * p.K;
#if defined(CPU_CAPABILITY_AVX512)
  if (MR == 1 && p.w.tiled) {
    tile_row1_tiled(p, xr[0], t, g0, g1, ybuf);
  } else {
    const __mmask16 mask = static_cast<__mmask16>((1u << p.w.row_words(t)) - 1u);
    for (int64_t gi = g0; gi < g1; ++gi) {
      group_params(p, t, gi, nwords, zs, ss);
      if (gi + 1 < g1) prefetch_group_params(p, t, gi + 1, nwords);
      group_rows<MR>(p.w, xr, t, gi * p.g, (gi + 1) * p.g, mask, zs, ss, ybuf);
    }
  }
#else
  for (int64_t gi = g0; gi < g1; ++gi) {
    group_params(p, t, gi, nwords, zs, ss);
    if (gi + 1 < g1) prefetch_group_params(p, t, gi + 1, nwords);
    group_rows<MR>(p.w, xr, t, gi * p.g, (gi + 1) * p.g, p.w.row_words(t), zs, ss, ybuf);
  }
#endif
  if (part != nullptr) {
    for (int m = 0; m < MR; ++m) std::memcpy(part + (m0 + m) * lanes + t * kTileCols, ybuf + m * kTileCols, sizeof(ybuf) / MR);
    return;
  }
  for (int m = 0; m < MR; ++m) store_tile(p, t, ybuf + m * kTileCols, p.y + (m0 + m) * p.N);
}

template <typename T>
void tile_rows_any(const Problem<T>& p, int64_t t, int64_t m0, int64_t g0, int64_t g1, float* part, int64_t lanes) {
  switch (std::min(kRowBlock, p.M - m0)) {  // up to kRowBlock rows through one decode of the tile
    case 1: tile_rows<T, 1>(p, t, m0, g0, g1, part, lanes); break;
    case 2: tile_rows<T, 2>(p, t, m0, g0, g1, part, lanes); break;
    case 3: tile_rows<T, 3>(p, t, m0, g0, g1, part, lanes); break;
    case 4: tile_rows<T, 4>(p, t, m0, g0, g1, part, lanes); break;
    case 5: tile_rows<T, 5>(p, t, m0, g0, g1, part, lanes); break;
    case 6: tile_rows<T, 6>(p, t, m0, g0, g1, part, lanes); break;
    case 7: tile_rows<T, 7>(p, t, m0, g0, g1, part, lanes); break;
    case 8: tile_rows<T, 8>(p, t, m0, g0, g1, part, lanes); break;
  }
}

// Fewer than kSplitBelowTiles tiles (N <= 896) and at least two groups: each tile's groups are
// split in two halves, computed as separate work items and added at the end, so that two threads
// share 5 tiles as 2.5 + 2.5 instead of 3 + 2 (the decode is compute-bound: a thread's share is
// its time). The split depends on N, K and g alone, never on the thread count or on M, so every
// thread count, both layouts and every batch size give a row the same bits.
constexpr int64_t kSplitBelowTiles = 8;

template <typename T>
void run_rows(const Problem<T>& p) {
  const int64_t tiles = p.w.tiles();
  const int64_t G = p.K / p.g;
  const int64_t halves = tiles < kSplitBelowTiles && G >= 2 ? 2 : 1;
  const int64_t items = tiles * halves;
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max(grain_for(items, p.K * p.N / 2), (items + threads - 1) / threads);
  if (halves == 1) {
    at::parallel_for(0, tiles, grain, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        for (int64_t m = 0; m < p.M; m += kRowBlock) tile_rows_any(p, t, m, 0, G, nullptr, 0);
    });
    return;
  }
  const int64_t lanes = tiles * kTileCols;
  std::unique_ptr<float[]> buffer(new float[2 * p.M * lanes]);  // [half][M][lanes], every lane written
  float* const part = buffer.get();
  at::parallel_for(0, items, grain, [&](int64_t b, int64_t e) {
    for (int64_t it = b; it < e; ++it) {
      const int64_t t = it / 2, h = it % 2;
      for (int64_t m = 0; m < p.M; m += kRowBlock)
        tile_rows_any(p, t, m, h == 0 ? 0 : G / 2, h == 0 ? G / 2 : G, part + h * p.M * lanes, lanes);
    }
  });
  for (int64_t m = 0; m < p.M; ++m) {  // y = first half + second half (+ bias), in column order
    const float* lo = part + m * lanes;
    const float* hi = lo + p.M * lanes;
    for (int64_t t = 0; t < tiles; ++t) {
      alignas(64) float sum[kTileCols];
      for (int64_t l = 0; l < kTileCols; ++l) sum[l] = lo[t * kTileCols + l] + hi[t * kTileCols + l];
      store_tile(p, t, sum, p.y + m * p.N);
    }
  }
}

}  // namespace

int64_t w4_max_rows() { return w4::kMaxRowsW4; }

// x [M, K] (M <= kMaxRowsW4), qweight, scale [K/g, N] (x's dtype or float16: widened exactly), offset?, bias?
// -> [M, N] in x's dtype.
at::Tensor w4_matmul(const at::Tensor& x, const at::Tensor& qweight_in, const at::Tensor& scale_in,
                     const std::optional<at::Tensor>& offset_in, const std::optional<at::Tensor>& bias,
                     int64_t group_size) {
  const DenseWeights d = dense_weights(qweight_in, scale_in, offset_in);
  const at::Tensor& qweight = d.qweight;
  const at::Tensor& scale = d.scale;
  const std::optional<at::Tensor>& offset = d.offset;
  TORCH_CHECK(x.dim() == 2 && x.size(0) <= kMaxRowsW4, "w4_matmul: x [M, K] with M <= ", kMaxRowsW4, ", got ",
              x.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(1);
  check_common(scale, offset, K, group_size);
  TORCH_CHECK(scale.scalar_type() == x.scalar_type() || scale.scalar_type() == at::kHalf,
              "w4_matmul: scale in x's dtype or float16");
  std::unique_ptr<float[]> x_own;
  at::Tensor x_keep;
  const float* xf = float_rows(x, x_own, x_keep);
  at::Tensor bf;
  if (bias.has_value()) bf = bias->scalar_type() == at::kFloat ? bias->contiguous() : bias->to(at::kFloat).contiguous();
  ResultRows y(x, M, N);
  const Packed w = packed_of(qweight, K, N);
  AT_DISPATCH_V2(scale.scalar_type(), "w4_matmul", AT_WRAP([&] {
    using T = scalar_t;
    Problem<T> p{xf, w, scale.data_ptr<T>(), offset.has_value() ? offset->data_ptr<int32_t>() : nullptr,
                 bias.has_value() ? bf.data_ptr<float>() : nullptr, y.data(), M, K, N, group_size};
    if (M > 0) run_rows(p);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return y.result();
}

}  // namespace dlinfer_cpu
