// W4A16 (weight_quant_matmul): y[M, N] = x[M, K] W[K, N] (+ bias), W 4-bit in LMDeploy's AWQ
// gemm packing (dlinfer/vendor/w4_layouts.py): qweight int32 [K, N/8], column 8j + kOrder[i] at
// bits 4i..4i+3 of word j; W[k, c] = (q - z[k / g, c]) * s[k / g, c]; or the column_tiled layout
// int32 [ceil(N/128), K, 16], the same words with each 128-column tile contiguous over K.
//
// Few rows (decode): the weight is dequantised in registers, never stored as floats. A thread
// owns tiles of 128 columns (16 words); per k it loads the tile's 16 words once (64 bytes: the
// canonical layout reads them K times with a stride of N/2 bytes, the column_tiled one as one
// stream) and splits them into 8 vectors of 16 lanes, vector i holding columns 8w + kOrder[i].
// Per group: acc = fma(x[k], float(q - z), acc) for k in order (q - z exact in float), then
// y = fma(acc, s, y) per group, in float32; bias added, one rounding to x's dtype. Every lane
// does that arithmetic in that order on every path (AVX-512, portable), so both layouts give
// identical bits. Rows go kRowBlock at a time through the tile (the later passes read it from L2).
//
// Many rows (prefill): `w4_dequantise` gives a float32 block of columns for a GEMM (the caller,
// kernels.py, walks N in blocks: never the whole float weight).
#include "common.h"

#include <ATen/ops/zeros.h>
#include <cmath>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace dlinfer_cpu {
namespace {

constexpr int kOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};
constexpr int64_t kTileWords = 16;
constexpr int64_t kTileCols = 8 * kTileWords;
constexpr int64_t kMaxRowsW4 = 8;  // the few-rows kernel's limit (kernels.py uses the GEMM beyond)
constexpr int kRowBlock = 2;       // rows sharing one decode of the weight
constexpr int64_t kPrefetchRows = 8;

struct Packed {
  const int32_t* q;
  int64_t K, words;  // words = N / 8
  bool tiled;
  // The tile's 16 words at row k (canonical: row k of the tile's column band).
  inline const int32_t* row(int64_t t, int64_t k) const {
    return tiled ? q + (t * K + k) * kTileWords : q + k * words + t * kTileWords;
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

// The 8 x 16 zero points (lane order i * 16 + w) and scales of group gi in tile t.
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

#if defined(CPU_CAPABILITY_AVX512)
// acc[m][i] over rows k0..k1 of tile t, then ybuf[m][i] = fma(acc, s, ybuf).
template <int MR>
inline void group_rows(const Packed& w, const float* const* xr, int64_t t,
                       int64_t k0, int64_t k1, __mmask16 mask, const int32_t* zs, const float* ss, float* ybuf) {
  __m512 acc[MR][8];
  __m512i z[8];
  for (int i = 0; i < 8; ++i) z[i] = _mm512_loadu_si512(zs + i * kTileWords);
  for (int m = 0; m < MR; ++m)
    for (int i = 0; i < 8; ++i) acc[m][i] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi32(15);
  for (int64_t k = k0; k < k1; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(w.row(t, std::min(k + kPrefetchRows, w.K - 1))), _MM_HINT_T0);
    const __m512i words = _mm512_maskz_loadu_epi32(mask, w.row(t, k));
    __m512 xb[MR];
    for (int m = 0; m < MR; ++m) xb[m] = _mm512_set1_ps(xr[m][k]);
#define DLINFER_W4_NIBBLE(I)                                                                           \
  {                                                                                                   \
    const __m512i q = _mm512_and_si512(_mm512_srli_epi32(words, 4 * (I)), nib);                        \
    const __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(q, z[I]));                                    \
    for (int m = 0; m < MR; ++m) acc[m][I] = _mm512_fmadd_ps(xb[m], d, acc[m][I]);                     \
  }
    DLINFER_W4_NIBBLE(0) DLINFER_W4_NIBBLE(1) DLINFER_W4_NIBBLE(2) DLINFER_W4_NIBBLE(3)
    DLINFER_W4_NIBBLE(4) DLINFER_W4_NIBBLE(5) DLINFER_W4_NIBBLE(6) DLINFER_W4_NIBBLE(7)
#undef DLINFER_W4_NIBBLE
  }
  for (int m = 0; m < MR; ++m) {
    for (int i = 0; i < 8; ++i) {
      float* yb = ybuf + m * kTileCols + i * kTileWords;
      _mm512_storeu_ps(yb, _mm512_fmadd_ps(acc[m][i], _mm512_loadu_ps(ss + i * kTileWords), _mm512_loadu_ps(yb)));
    }
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
void run_few_rows(const Problem<T>& p) {
  const int64_t tiles = (p.w.words + kTileWords - 1) / kTileWords;
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max(grain_for(tiles, p.K * p.N / 2), (tiles + threads - 1) / threads);
  at::parallel_for(0, tiles, grain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      int64_t m = 0;
      for (; m + kRowBlock <= p.M; m += kRowBlock) tile_rows<T, kRowBlock>(p, t, m);
      for (; m < p.M; ++m) tile_rows<T, 1>(p, t, m);
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
  return Packed{qweight.data_ptr<int32_t>(), K, N / 8, tiled};
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
at::Tensor w4_matmul_few_rows(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                              const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& bias,
                              int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) <= kMaxRowsW4, "w4_matmul_few_rows: x [M <= 8, K]");
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(1);
  check_common(scale, offset, K, group_size);
  TORCH_CHECK(scale.scalar_type() == x.scalar_type(), "w4_matmul_few_rows: scale in x's dtype");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor bf;
  if (bias.has_value()) bf = bias->to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const Packed w = packed_of(qweight, K, N);
  AT_DISPATCH_V2(scale.scalar_type(), "w4_matmul_few_rows", AT_WRAP([&] {
    using T = scalar_t;
    Problem<T> p{xf.data_ptr<float>(), w, scale.data_ptr<T>(),
                 offset.has_value() ? offset->data_ptr<int32_t>() : nullptr,
                 bias.has_value() ? bf.data_ptr<float>() : nullptr, y.data_ptr<float>(), M, K, N, group_size};
    if (M > 0) run_few_rows(p);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// Columns c0..c1 (multiples of 8) of the float32 weight: [K, c1 - c0], W[k, c] = float(q - z) * s.
at::Tensor w4_dequantise(const at::Tensor& qweight, const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                         int64_t group_size, int64_t c0, int64_t c1) {
  const int64_t N = scale.size(1);
  const int64_t K = qweight.dim() == 3 ? qweight.size(1) : qweight.size(0);
  check_common(scale, offset, K, group_size);
  TORCH_CHECK(0 <= c0 && c0 <= c1 && c1 <= N && c0 % 8 == 0 && c1 % 8 == 0, "w4_dequantise: column range");
  const Packed w = packed_of(qweight, K, N);
  at::Tensor out = at::empty({K, c1 - c0}, scale.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const int32_t* zeros = offset.has_value() ? offset->data_ptr<int32_t>() : nullptr;
  const int64_t g = group_size, width = c1 - c0;
  AT_DISPATCH_V2(scale.scalar_type(), "w4_dequantise", AT_WRAP([&] {
    const scalar_t* s = scale.data_ptr<scalar_t>();
    at::parallel_for(0, K, grain_for(K, K * width), [&](int64_t kb, int64_t ke) {
      for (int64_t k = kb; k < ke; ++k) {
        const int64_t gi = k / g;
        float* row = o + k * width;
        for (int64_t j = c0 / 8; j < c1 / 8; ++j) {
          const int32_t v = w.word(k, j);
          const int32_t zw = zeros ? zeros[gi * (N / 8) + j] : 0;
          for (int i = 0; i < 8; ++i) {
            const int64_t c = 8 * j + kOrder[i];
            const int32_t z = zeros ? (zw >> (4 * i)) & 15 : 8;
            row[c - c0] = static_cast<float>(((v >> (4 * i)) & 15) - z) * static_cast<float>(s[gi * N + c]);
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
  m.def("w4_matmul_few_rows(Tensor x, Tensor qweight, Tensor scale, Tensor? offset, Tensor? bias, int group_size) "
        "-> Tensor");
  m.impl("w4_matmul_few_rows", c10::DispatchKey::CPU, &w4_matmul_few_rows);
  m.def("w4_dequantise(Tensor qweight, Tensor scale, Tensor? offset, int group_size, int c0, int c1) -> Tensor");
  m.impl("w4_dequantise", c10::DispatchKey::CPU, &w4_dequantise);
  m.def("w4_column_tiled(Tensor qweight) -> Tensor");
  m.impl("w4_column_tiled", c10::DispatchKey::CPU, &w4_column_tiled);
  m.def("w4_max_few_rows() -> int", []() -> int64_t { return kMaxRowsW4; });
}

}  // namespace dlinfer_cpu
