// W4A16 (weight_quant_matmul): y[M, N] = x[M, K] W[K, N] (+ bias), W 4-bit in LMDeploy's AWQ
// gemm packing (dlinfer/vendor/w4_layouts.py): qweight int32 [K, N/8], column 8j + kOrder[i] at
// bits 4i..4i+3 of word j; W[k, c] = (q - z[k / g, c]) * s[k / g, c]; or the column_tiled layout
// int32 [ceil(N/128), K, 16], the same words with each 128-column tile contiguous over K.
//
// The weight is dequantised in registers, never stored as floats. A thread
// owns tiles of 128 columns (16 words); per k it loads the tile's 16 words once (64 bytes: the
// canonical layout reads them K times with a stride of N/2 bytes, the column_tiled one as one
// stream) and splits them into 8 vectors of 16 lanes, vector i holding columns 8w + kOrder[i].
// Per group: acc = fma(x[k], float(q - z), acc) for k in order (q - z exact in float), then
// y = fma(acc, s, y) per group, in float32; bias added, one rounding to x's dtype. Every lane
// does that arithmetic in that order on every path (AVX-512, portable), so both layouts give
// identical bits. All rows share each decoded nibble (3-8 rows: in four passes of two nibbles).
// At one row the decode, not the memory, is the bound (one core decodes ~23 GB/s of packed weight
// from L2): the group's zero points and scales are vector loads and gathers, and everything a
// tile reads next (its rows 64 ahead, the next tile's first rows, the next group's scales) is
// prefetched, so the stream does not stall between tiles and groups.
//
// Beyond kMaxRowsW4 rows: `w4_dequantise_tiles` gives a float32 block of tiles for a GEMM (the
// caller, weight_quant.py, walks N in blocks: never the whole float weight). Measured on one core
// of the Zen 4 VM, w4_matmul beats that path 2-3x at every M from 1 to 512 (docs/benchmarks.md):
// 8 rows share each decoded nibble, and the FMAs run from registers like a GEMM micro-kernel's.
#include "common.h"

#include <ATen/ops/zeros.h>
#include <cmath>
#include <utility>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace dlinfer_cpu {
namespace {

constexpr int kOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};
constexpr int64_t kTileWords = 16;
constexpr int64_t kTileCols = 8 * kTileWords;
constexpr int64_t kMaxRowsW4 = 4096;  // w4_matmul's limit (weight_quant.py uses the dequantise + BLAS path beyond)
constexpr int64_t kRowBlock = 8;    // rows sharing one decode of the weight
constexpr int64_t kPrefetchRows = 64;  // 4 KB ahead in a tile: 8 rows was ~6% slower on bench_cpu_ops' 49152x576 matrix (2 pairs), equal at the layers' sizes

struct Packed {
  const int32_t* q;
  int64_t K, words;  // words = N / 8
  bool tiled;
  int64_t tiled_rows;  // tiles * K: the column_tiled tensor's 16-word rows
  // The tile's 16 words at row k (canonical: row k of the tile's column band).
  inline const int32_t* row(int64_t t, int64_t k) const {
    return tiled ? q + (t * K + k) * kTileWords : q + k * words + t * kTileWords;
  }
  // Prefetching ahead of rows k0..k1 of tile t: the first address, kPrefetchRows rows on, and
  // the step per row. column_tiled tiles follow each other in memory, so near a tile's end that
  // is the next tile's first rows (measured: a decode step's 120 SmolLM2 GEMVs 2.2 -> 1.93 ms
  // against stopping at the tile's last row). A range that would run past the tensor (canonical:
  // past the tile's last row) stays on its last row instead (step 0): a pointer step per row, as
  // a clamp per row cost ~6% of those GEMVs' time.
  inline std::pair<const int32_t*, int64_t> ahead(int64_t t, int64_t k0, int64_t k1) const {
    const int64_t stride = tiled ? kTileWords : words;
    const bool inside = tiled ? t * K + k1 + kPrefetchRows <= tiled_rows : k1 + kPrefetchRows <= K;
    if (inside) return {row(t, k0 + kPrefetchRows), stride};
    return {tiled ? q + (tiled_rows - 1) * kTileWords : row(t, K - 1), 0};
  }
  inline int32_t word(int64_t k, int64_t j) const {
    return tiled ? q[((j / kTileWords) * K + k) * kTileWords + j % kTileWords] : q[k * words + j];
  }
};

template <typename T>
struct Problem {
  const float* x;  // [M, K] float32, dense
  Packed w;
  const T* scale;         // [G, N]
  const int32_t* zeros;   // [G, N / 8] or null (zero point 8)
  const float* bias;      // [N] or null
  float* y;               // [M, N] float32
  int64_t M, K, N, g;
};

// The 8 x 16 zero points (lane order i * 16 + w) and scales of group gi in tile t; zero past N.
// Lane (i, w) is column 8 * (16t + w) + kOrder[i]: zero point nibble i of offset word 16t + w.
#if defined(CPU_CAPABILITY_AVX512)
// Vectorised (the scalar loop cost ~25% of a decode step's GEMV time on SmolLM2's shapes): the
// tile's zero-point words are one masked load, split like the weight's words; its 128 scales are
// widened into a zero-padded float row, then gathered 16 lanes at a time (stride 8).
template <typename T>
void group_params(const Problem<T>& p, int64_t t, int64_t gi, int nwords, int32_t* z, float* s) {
  const __mmask16 mask = static_cast<__mmask16>((1u << nwords) - 1u);
  const __m512i zw = p.zeros ? _mm512_maskz_loadu_epi32(mask, p.zeros + gi * p.w.words + t * kTileWords)
                             : _mm512_maskz_mov_epi32(mask, _mm512_set1_epi32(static_cast<int32_t>(0x88888888u)));
  alignas(64) float row[kTileCols];
  const int ncols = 8 * nwords;
  const T* src = p.scale + gi * p.N + 8 * t * kTileWords;
  for (int c = 0; c < kTileCols; c += kLanes) {
    if (c + kLanes <= ncols) {
      load_vec(src + c).store(row + c);
    } else {
      for (int l = c; l < c + kLanes; ++l) row[l] = l < ncols ? static_cast<float>(src[l]) : 0.f;
    }
  }
  const __m512i stride8 = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(8));
  for (int i = 0; i < 8; ++i) {
    const __m512i zi = _mm512_and_si512(_mm512_srli_epi32(zw, 4 * i), _mm512_set1_epi32(15));
    _mm512_storeu_si512(z + i * kTileWords, zi);
    const __m512i idx = _mm512_add_epi32(stride8, _mm512_set1_epi32(kOrder[i]));
    _mm512_storeu_ps(s + i * kTileWords, _mm512_i32gather_ps(idx, row, 4));
  }
}

// Group gi's scales and zero points of tile t into the cache, a group ahead: each is a row of its
// own (N scales apart), which the hardware prefetcher does not follow (measured: the 120 GEMVs of
// a SmolLM2 decode step 2.5 -> 2.2 ms).
template <typename T>
inline __attribute__((always_inline)) void prefetch_group_params(const Problem<T>& p, int64_t t, int64_t gi, int nwords) {
  const char* sn = reinterpret_cast<const char*>(p.scale + gi * p.N + 8 * t * kTileWords);
  for (int64_t b = 0; b < 8 * nwords * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(sn + b, _MM_HINT_T0);
  if (p.zeros) _mm_prefetch(reinterpret_cast<const char*>(p.zeros + gi * p.w.words + t * kTileWords), _MM_HINT_T0);
}
#else
template <typename T>
void group_params(const Problem<T>& p, int64_t t, int64_t gi, int nwords, int32_t* z, float* s) {
  for (int w = 0; w < kTileWords; ++w) {
    const int64_t j = t * kTileWords + w;
    const int32_t zw = w < nwords && p.zeros ? p.zeros[gi * p.w.words + j] : 0;
    for (int i = 0; i < 8; ++i) {
      const bool in = w < nwords;
      z[i * kTileWords + w] = !in ? 0 : p.zeros ? (zw >> (4 * i)) & 15 : 8;
      s[i * kTileWords + w] = in ? static_cast<float>(p.scale[gi * p.N + 8 * j + kOrder[i]]) : 0.f;
    }
  }
}
#endif

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
// MR rows x NI nibbles of accumulators: NI = 8 for 1-2 rows (one pass), NI = 2 for 3-8 rows (four
// passes over the group's words, from L1/L2, each nibble decoded once for all the rows).
constexpr int kShift[8] = {0, 4, 8, 12, 16, 0, 4, 8};  // 4i' of nibble i

template <int I, int J, int MR, int NI>
inline void nibble(const __m512i lo, const __m512i hi, const __m512i magic, const __m512* zf, const __m512* xb,
                   __m512 (&acc)[MR][NI]) {
  // (src & mask) | magic: ternary-logic truth table 0xEA = (A & B) | C
  const __m512i bits = _mm512_ternarylogic_epi32(I < 5 ? lo : hi, _mm512_set1_epi32(15 << kShift[I]), magic, 0xEA);
  const __m512 d = _mm512_sub_ps(_mm512_castsi512_ps(bits), zf[J]);
  for (int m = 0; m < MR; ++m) acc[m][J] = _mm512_fmadd_ps(xb[m], d, acc[m][J]);
}

template <int MR, int I0, int NI>
inline void group_pass(const Packed& w, const float* const* xr, int64_t t, int64_t k0, int64_t k1, __mmask16 mask,
                       const int32_t* zs, const float* ss, float* ybuf) {
  __m512 acc[MR][NI];
  __m512 zf[NI];  // 2^23 + z * 2^(4i')
  const __m512i magic = _mm512_set1_epi32(0x4B000000);
  for (int j = 0; j < NI; ++j) {
    const __m512i z = _mm512_sllv_epi32(_mm512_loadu_si512(zs + (I0 + j) * kTileWords),
                                        _mm512_set1_epi32(kShift[I0 + j]));
    zf[j] = _mm512_castsi512_ps(_mm512_or_si512(z, magic));
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NI; ++j) acc[m][j] = _mm512_setzero_ps();
  auto [pf, pf_step] = w.ahead(t, k0, k1);
  for (int64_t k = k0; k < k1; ++k, pf += pf_step) {
    if (I0 == 0) _mm_prefetch(reinterpret_cast<const char*>(pf), _MM_HINT_T0);
    const __m512i lo = _mm512_maskz_loadu_epi32(mask, w.row(t, k));
    const __m512i hi = _mm512_srli_epi32(lo, 20);
    __m512 xb[MR];
    for (int m = 0; m < MR; ++m) xb[m] = _mm512_set1_ps(xr[m][k]);
    [&]<int... J>(std::integer_sequence<int, J...>) {
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
inline void group_rows(const Packed& w, const float* const* xr, int64_t t, int64_t k0, int64_t k1, __mmask16 mask,
                       const int32_t* zs, const float* ss, float* ybuf) {
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
#else
// Portable: the same per-lane arithmetic, lane by lane (std::fma is the fused multiply-add).
template <int MR>
inline void group_rows(const Packed& w, const float* const* xr, int64_t t,
                       int64_t k0, int64_t k1, int nwords, const int32_t* zs, const float* ss, float* ybuf) {
  float acc[MR][kTileCols] = {};
  for (int64_t k = k0; k < k1; ++k) {
    const int32_t* words = w.row(t, k);
    for (int wd = 0; wd < nwords; ++wd) {
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
#endif

// Rows m0..m0+MR-1 of tile t: every group, then the tile's columns of y (+ bias).
template <typename T, int MR>
void tile_rows(const Problem<T>& p, int64_t t, int64_t m0) {
  const int nwords = static_cast<int>(std::min<int64_t>(kTileWords, p.w.words - t * kTileWords));
  alignas(64) float ybuf[MR * kTileCols] = {};
  alignas(64) int32_t zs[kTileCols];
  alignas(64) float ss[kTileCols];
  const float* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = p.x + (m0 + m) * p.K;
  for (int64_t gi = 0; gi < p.K / p.g; ++gi) {
    group_params(p, t, gi, nwords, zs, ss);
#if defined(CPU_CAPABILITY_AVX512)
    if (gi + 1 < p.K / p.g) prefetch_group_params(p, t, gi + 1, nwords);
    const __mmask16 mask = static_cast<__mmask16>((1u << nwords) - 1u);
    group_rows<MR>(p.w, xr, t, gi * p.g, (gi + 1) * p.g, mask, zs, ss, ybuf);
#else
    group_rows<MR>(p.w, xr, t, gi * p.g, (gi + 1) * p.g, nwords, zs, ss, ybuf);
#endif
  }
  for (int m = 0; m < MR; ++m) {
    float* yr = p.y + (m0 + m) * p.N;
    for (int w = 0; w < nwords; ++w) {
      for (int i = 0; i < 8; ++i) {
        const int64_t c = 8 * (t * kTileWords + w) + kOrder[i];
        const float v = ybuf[m * kTileCols + i * kTileWords + w];
        yr[c] = p.bias ? v + p.bias[c] : v;
      }
    }
  }
}

template <typename T>
void run_rows(const Problem<T>& p) {
  const int64_t tiles = (p.w.words + kTileWords - 1) / kTileWords;
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max(grain_for(tiles, p.K * p.N / 2), (tiles + threads - 1) / threads);
  at::parallel_for(0, tiles, grain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      for (int64_t m = 0; m < p.M; m += kRowBlock) {  // up to 8 rows through one decode of the tile
        switch (std::min(kRowBlock, p.M - m)) {
          case 1: tile_rows<T, 1>(p, t, m); break;
          case 2: tile_rows<T, 2>(p, t, m); break;
          case 3: tile_rows<T, 3>(p, t, m); break;
          case 4: tile_rows<T, 4>(p, t, m); break;
          case 5: tile_rows<T, 5>(p, t, m); break;
          case 6: tile_rows<T, 6>(p, t, m); break;
          case 7: tile_rows<T, 7>(p, t, m); break;
          case 8: tile_rows<T, 8>(p, t, m); break;
        }
      }
    }
  });
}

Packed packed_of(const at::Tensor& qweight, int64_t K, int64_t N) {
  const bool tiled = qweight.dim() == 3;
  TORCH_CHECK(qweight.scalar_type() == at::kInt && qweight.is_contiguous(), "w4: qweight must be dense int32");
  if (tiled) {
    TORCH_CHECK(qweight.size(0) == (N / 8 + kTileWords - 1) / kTileWords && qweight.size(1) == K &&
                    qweight.size(2) == kTileWords, "w4: column_tiled qweight shape");
  } else {
    TORCH_CHECK(qweight.dim() == 2 && qweight.size(0) == K && qweight.size(1) == N / 8, "w4: qweight shape");
  }
  return Packed{qweight.data_ptr<int32_t>(), K, N / 8, tiled, (N / 8 + kTileWords - 1) / kTileWords * K};
}

void check_common(const at::Tensor& scale, const std::optional<at::Tensor>& offset, int64_t K, int64_t g) {
  TORCH_CHECK(g > 0 && K % g == 0, "w4: group size must divide K");
  const int64_t N = scale.size(1);
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == K / g && N % 8 == 0 && scale.is_contiguous(), "w4: scale");
  if (offset.has_value()) {
    TORCH_CHECK(offset->scalar_type() == at::kInt && offset->is_contiguous() && offset->size(0) == K / g &&
                    offset->size(1) == N / 8, "w4: offset");
  }
}

// x [M, K] (M <= kMaxRowsW4), qweight, scale [K/g, N] (x's dtype), offset?, bias? -> [M, N] in x's dtype.
at::Tensor w4_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                              const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& bias,
                              int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) <= kMaxRowsW4, "w4_matmul: x [M <= 4096, K]");
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(1);
  check_common(scale, offset, K, group_size);
  TORCH_CHECK(scale.scalar_type() == x.scalar_type(), "w4_matmul: scale in x's dtype");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor bf;
  if (bias.has_value()) bf = bias->to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const Packed w = packed_of(qweight, K, N);
  AT_DISPATCH_V2(scale.scalar_type(), "w4_matmul", AT_WRAP([&] {
    using T = scalar_t;
    Problem<T> p{xf.data_ptr<float>(), w, scale.data_ptr<T>(),
                 offset.has_value() ? offset->data_ptr<int32_t>() : nullptr,
                 bias.has_value() ? bf.data_ptr<float>() : nullptr, y.data_ptr<float>(), M, K, N, group_size};
    if (M > 0) run_rows(p);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// Tiles t0..t1 of the float32 weight in lane order, [K, (t1 - t0) * 128]: column (t - t0) * 128 +
// i * 16 + w holds W[k, 8 * (16t + w) + kOrder[i]] = float(q - z) * s (zero past N). The caller
// multiplies and puts the output columns back in order (a GEMM does not care about their order;
// a scatter into column order would cost more than the decode).
at::Tensor w4_dequantise_tiles(const at::Tensor& qweight, const at::Tensor& scale,
                               const std::optional<at::Tensor>& offset, int64_t group_size, int64_t t0, int64_t t1) {
  const int64_t N = scale.size(1);
  const int64_t K = qweight.dim() == 3 ? qweight.size(1) : qweight.size(0);
  check_common(scale, offset, K, group_size);
  const int64_t tiles = (N / 8 + kTileWords - 1) / kTileWords;
  TORCH_CHECK(0 <= t0 && t0 <= t1 && t1 <= tiles, "w4_dequantise_tiles: tile range");
  const Packed w = packed_of(qweight, K, N);
  const int64_t width = (t1 - t0) * kTileCols;
  at::Tensor out = at::empty({K, width}, scale.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  AT_DISPATCH_V2(scale.scalar_type(), "w4_dequantise_tiles", AT_WRAP([&] {
    using T = scalar_t;
    const Problem<T> p{nullptr, w, scale.data_ptr<T>(), offset.has_value() ? offset->data_ptr<int32_t>() : nullptr,
                       nullptr, nullptr, 0, K, N, group_size};
    at::parallel_for(t0, t1, 1, [&](int64_t tb, int64_t te) {
      alignas(64) int32_t zs[kTileCols];
      alignas(64) float ss[kTileCols];
      for (int64_t t = tb; t < te; ++t) {
        const int nwords = static_cast<int>(std::min<int64_t>(kTileWords, p.w.words - t * kTileWords));
        for (int64_t gi = 0; gi < K / group_size; ++gi) {
          group_params(p, t, gi, nwords, zs, ss);
          for (int64_t k = gi * group_size; k < (gi + 1) * group_size; ++k) {
            const int32_t* words = w.row(t, k);
            float* row = o + k * width + (t - t0) * kTileCols;
#if defined(CPU_CAPABILITY_AVX512)
            const __m512i v = _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << nwords) - 1u), words);
            for (int i = 0; i < 8; ++i) {
              const __m512i q = _mm512_and_si512(_mm512_srlv_epi32(v, _mm512_set1_epi32(4 * i)), _mm512_set1_epi32(15));
              const __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_loadu_si512(zs + i * kTileWords)));
              _mm512_storeu_ps(row + i * kTileWords, _mm512_mul_ps(d, _mm512_loadu_ps(ss + i * kTileWords)));
            }
#else
            for (int i = 0; i < 8; ++i)
              for (int wd = 0; wd < kTileWords; ++wd) {
                const int32_t q = wd < nwords ? (words[wd] >> (4 * i)) & 15 : 0;
                row[i * kTileWords + wd] = static_cast<float>(q - zs[i * kTileWords + wd]) * ss[i * kTileWords + wd];
              }
#endif
          }
        }
      }
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}

// canonical int32 [K, N/8] -> column_tiled int32 [ceil(N/128), K, 16] (zero words past N).
at::Tensor w4_column_tiled(const at::Tensor& qweight) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kInt, "w4_column_tiled: int32 [K, N/8]");
  const at::Tensor q = qweight.contiguous();
  const int64_t K = q.size(0), words = q.size(1), tiles = (words + kTileWords - 1) / kTileWords;
  at::Tensor out = at::zeros({tiles, K, kTileWords}, q.options());
  const int32_t* src = q.data_ptr<int32_t>();
  int32_t* dst = out.data_ptr<int32_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t n = std::min(kTileWords, words - t * kTileWords);
      for (int64_t k = 0; k < K; ++k)
        std::memcpy(dst + (t * K + k) * kTileWords, src + k * words + t * kTileWords, n * sizeof(int32_t));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dlinfer_cpu, m) {
  m.def("w4_matmul(Tensor x, Tensor qweight, Tensor scale, Tensor? offset, Tensor? bias, int group_size) "
        "-> Tensor");
  m.impl("w4_matmul", c10::DispatchKey::CPU, &w4_matmul);
  m.def("w4_dequantise_tiles(Tensor qweight, Tensor scale, Tensor? offset, int group_size, int t0, int t1) -> Tensor");
  m.impl("w4_dequantise_tiles", c10::DispatchKey::CPU, &w4_dequantise_tiles);
  m.def("w4_column_tiled(Tensor qweight) -> Tensor");
  m.impl("w4_column_tiled", c10::DispatchKey::CPU, &w4_column_tiled);
  m.def("w4_max_rows() -> int", []() -> int64_t { return kMaxRowsW4; });
}

}  // namespace dlinfer_cpu
