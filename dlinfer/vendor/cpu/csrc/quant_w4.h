// W4A16's packed layouts and per-group parameters, shared by the register kernel
// (quant_w4.cpp) and the dequantise / repack helpers (quant_w4_tiles.cpp). The layouts are
// dlinfer/vendor/w4_layouts.py's: canonical int32 [K, N/8] (LMDeploy's AWQ gemm packing, column
// 8j + kOrder[i] at bits 4i..4i+3 of word j) and column_tiled int32 [ceil(N/128), K, 16] (column
// 128t + 16i + w at bits 4i..4i+3 of word w of tile t).
//
// The kernels work on a tile's 16 words split into 8 vectors of 16 lanes, vector i holding nibble
// i: lane i * 16 + w is nibble i of the tile's word w. Which column that is depends on the layout
// (lane_column): column_tiled puts the tile's columns in lane order, so its scales are contiguous
// loads; canonical interleaves them.
#pragma once

#include "common.h"

#include <cmath>
#include <memory>
#include <optional>
#include <utility>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace dlinfer_cpu {
namespace w4 {

inline constexpr int kOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};
// canonical: column 8j + r is nibble kNibbleOf[r] of word j (the inverse of kOrder)
inline constexpr int kNibbleOf[8] = {0, 4, 1, 5, 2, 6, 3, 7};
constexpr int64_t kTileWords = 16;
constexpr int64_t kTileCols = 8 * kTileWords;
// w4_matmul's limit: beyond it weight_quant.py multiplies float32 tiles of the weight by BLAS
// (w4_dequantise_tiles). AVX-512: 4096 (on one core of the Zen 5 VM, SmolLM2 shapes, the register
// kernel was 1.9-3x faster than that path from 64 to 512 rows; not measured on 2 threads or past
// 512). AVX2: 128, as its blocks of 4 rows decode the weight M / 4 times: on the Zen 3 EPYC (2
// threads, 1B shapes, both paths alternated in one process) register / BLAS time was 0.08-0.94 up
// to 64 rows, 0.71-1.25 at 128, 0.97-1.40 at 192 and 1.01-1.59 from 256 to 1024
// (docs/notes/cpu-ops.md, "AVX2: what bounds W4A16"). Portable builds: 1, as their lane loop
// costs the same per row at every M (a portable build on the Zen 3 EPYC, 2 threads, 1B shapes:
// ~25 ms a row for a 2048 x 8192 weight; register / BLAS time 0.82-1.78 at one row, 1.33-1.93 at
// two, 5-64 from 4 to 256 rows; docs/notes/cpu-ops.md, "The portable build's switch").
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kMaxRowsW4 = 4096;
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kMaxRowsW4 = 128;
#else
constexpr int64_t kMaxRowsW4 = 1;
#endif
// Rows sharing one decode of the weight. AVX2: 4, its 16 registers hold 4 rows x 2 nibbles of
// accumulators with the broadcast x beside them; at 8 rows (x 1 nibble) they spilled, and two
// blocks of 4 (the tile decoded twice, its second pass from L2) took 0.96 against 1.7-2.2 ms for
// x [8, 2048] @ [2048, 1024] on one core of the Zen 3 EPYC.
#if defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kRowBlock = 4;
// The lanes of an 8-word half row that hold words, as a vpmaskmovd mask: the first n (none for
// n <= 0, all for n >= 8).
inline __m256i first_words8(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#else
constexpr int64_t kRowBlock = 8;
#endif
constexpr int64_t kPrefetchRows = 64;  // 4 KB ahead in a tile: 8 rows was ~6% slower on bench_cpu_ops' 49152x576 matrix (2 pairs), equal at the layers' sizes

// 128-column tiles of N = 8 * words output columns (the last one may be partial).
inline int64_t num_tiles(int64_t words) { return (words + kTileWords - 1) / kTileWords; }

struct Packed {
  const int32_t* q;
  int64_t K, words;  // words = N / 8
  bool tiled;
  inline int64_t tiles() const { return num_tiles(words); }
  // Words of tile t that hold columns (16, or fewer in the last tile).
  inline int tile_words(int64_t t) const { return static_cast<int>(std::min<int64_t>(kTileWords, words - t * kTileWords)); }
  // Words of tile t's rows that hold nibbles: column_tiled rows are 16 words, zero-padded (a partial
  // tile's columns spread over all of them); canonical rows have tile_words(t).
  inline int row_words(int64_t t) const { return tiled ? static_cast<int>(kTileWords) : tile_words(t); }
  // The output column of lane i * 16 + w (nibble i of word w) of tile t.
  inline int64_t lane_column(int64_t t, int i, int w) const {
    return tiled ? kTileCols * t + kTileWords * i + w : 8 * (t * kTileWords + w) + kOrder[i];
  }
  // The tile's 16 words at row k (canonical: row k of the tile's column band). row and ahead are
  // inlined by force: in a scratch build whose group_rows<4> had grown (a second copy of its
  // passes), GCC called row through the PLT on every k of one copy, each call spilling and
  // reloading the pass's 8 accumulators around a vzeroupper: that copy ran at 0.45-0.49x the other,
  // same source and bits (AVX2, Zen 3, 4 rows). Left to GCC, ahead stayed such a call too.
  inline __attribute__((always_inline)) const int32_t* row(int64_t t, int64_t k) const {
    return tiled ? q + (t * K + k) * kTileWords : q + k * words + t * kTileWords;
  }
  // Prefetching ahead of rows k0..k1 of tile t: the first address, kPrefetchRows rows on, and
  // the step per row. column_tiled tiles follow each other in memory, so near a tile's end that
  // is the next tile's first rows (measured: a decode step's 120 SmolLM2 GEMVs 2.2 -> 1.93 ms
  // against stopping at the tile's last row). A range that would run past the tensor (canonical:
  // past the tile's last row) stays on its last row instead (step 0): a pointer step per row, as
  // a clamp per row cost ~6% of those GEMVs' time.
  inline __attribute__((always_inline)) std::pair<const int32_t*, int64_t> ahead(int64_t t, int64_t k0,
                                                                                  int64_t k1) const {
    const int64_t stride = tiled ? kTileWords : words;
    const bool inside = tiled ? t * K + k1 + kPrefetchRows <= tiles() * K : k1 + kPrefetchRows <= K;
    if (inside) return {row(t, k0 + kPrefetchRows), stride};
    return {tiled ? q + (tiles() * K - 1) * kTileWords : row(t, K - 1), 0};
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

// The 8 x 16 zero points and scales of group gi in tile t, in lane order (lane i * 16 + w: column
// w.lane_column(t, i, w)); zero past N. Zero points are nibble kNibbleOf[c % 8] of offset word c / 8.
#if defined(CPU_CAPABILITY_AVX512)
// Vectorised (a scalar loop cost ~25% of a decode step's GEMV time on SmolLM2's shapes): the
// tile's 16 zero-point words are one masked load. column_tiled: lane i * 16 + w is column 16i + w,
// nibble kNibbleOf[w % 8] of word 2i + w / 8 (a lane permute and a variable shift), and the 16
// scales of nibble i are contiguous (one load; ~14% of a decode step's 120 GEMVs at group 64,
// ~19% at group 32, against the gathers below). canonical: the zero points are the words' nibbles
// in place; the 128 scales are widened into a zero-padded float row, then gathered (stride 8).
// column_tiled lane w of nibble i's vector: its zero point's word (2i + this) and nibble shift.
alignas(64) inline constexpr int32_t kWordOfLane[16] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
alignas(64) inline constexpr int32_t kShiftOfLane[16] = {0, 16, 4, 20, 8, 24, 12, 28, 0, 16, 4, 20, 8, 24, 12, 28};

// The tile's 16 zero-point words of group gi (zero past N; every nibble 8 without offsets).
template <typename T>
inline __m512i zero_words(const Problem<T>& p, int64_t t, int64_t gi, int nwords) {
  const __mmask16 mask = static_cast<__mmask16>((1u << nwords) - 1u);
  return p.zeros ? _mm512_maskz_loadu_epi32(mask, p.zeros + gi * p.w.words + t * kTileWords)
                 : _mm512_maskz_mov_epi32(mask, _mm512_set1_epi32(static_cast<int32_t>(0x88888888u)));
}

// column_tiled: the zero points of nibble i's 16 lanes (lane w: the tile's column 16i + w) from
// the tile's zero-point words zw.
inline __m512i tiled_zero_points(__m512i zw, int i) {
  const __m512i word = _mm512_add_epi32(_mm512_load_si512(kWordOfLane), _mm512_set1_epi32(2 * i));
  return _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(word, zw), _mm512_load_si512(kShiftOfLane)),
                          _mm512_set1_epi32(15));
}

// 16 scales from src[c] on as float32, zero from src[ncols] on.
template <typename T>
inline __m512 scales16(const T* src, int c, int ncols) {
  if (c + kLanes <= ncols) return load_vec(src + c);
  alignas(64) float part[kLanes];
  for (int l = 0; l < kLanes; ++l) part[l] = c + l < ncols ? static_cast<float>(src[c + l]) : 0.f;
  return _mm512_load_ps(part);
}

template <typename T>
void group_params(const Problem<T>& p, int64_t t, int64_t gi, int nwords, int32_t* z, float* s) {
  const __m512i zw = zero_words(p, t, gi, nwords);
  const int ncols = 8 * nwords;
  const T* src = p.scale + gi * p.N + kTileCols * t;
  if (p.w.tiled) {
    for (int i = 0; i < 8; ++i) {
      _mm512_storeu_si512(z + i * kTileWords, tiled_zero_points(zw, i));
      _mm512_storeu_ps(s + i * kTileWords, scales16(src, i * kTileWords, ncols));
    }
    return;
  }
  alignas(64) float row[kTileCols];
  for (int c = 0; c < kTileCols; c += kLanes) _mm512_store_ps(row + c, scales16(src, c, ncols));
  const __m512i stride8 = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(8));
  for (int i = 0; i < 8; ++i) {
    _mm512_storeu_si512(z + i * kTileWords, _mm512_and_si512(_mm512_srli_epi32(zw, 4 * i), _mm512_set1_epi32(15)));
    const __m512i idx = _mm512_add_epi32(stride8, _mm512_set1_epi32(kOrder[i]));
    _mm512_storeu_ps(s + i * kTileWords, _mm512_i32gather_ps(idx, row, 4));
  }
}

#elif defined(CPU_CAPABILITY_AVX2)
// AVX2: the same values in 8-lane vectors (the scalar loop below is ~20 operations a lane, 128
// lanes a group: on a Zen 3 EPYC it cost as much as the group's decode at one row). The zero
// points are integer nibbles and the scales exact widenings, so nothing rounds differently.
// column_tiled: the half h of nibble i (lanes i * 16 + 8h ..) takes its zero points from word
// 2i + h, nibble kNibbleOf[w % 8] of it (shift kShiftOfLane8[w % 8]), its scales from 8
// contiguous columns; canonical: nibble i of the words in place, the scales gathered (stride 8)
// from the group's row of the tile widened to float32.
alignas(32) inline constexpr int32_t kShiftOfLane8[8] = {0, 16, 4, 20, 8, 24, 12, 28};

// 8 scales from src[c] on as float32, zero from src[ncols] on (c and ncols are multiples of 8).
template <typename T>
inline __m256 scales8(const T* src, int c, int ncols) {
  return c < ncols ? static_cast<__m256>(load_vec(src + c)) : _mm256_setzero_ps();
}

template <typename T>
void group_params(const Problem<T>& p, int64_t t, int64_t gi, int nwords, int32_t* z, float* s) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  alignas(32) int32_t zw[kTileWords];  // the tile's zero-point words, zero past N
  for (int h = 0; h < 2; ++h) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nwords - 8 * h), lane);
    const __m256i words = p.zeros ? _mm256_maskload_epi32(p.zeros + gi * p.w.words + t * kTileWords + 8 * h, mask)
                                  : _mm256_and_si256(mask, _mm256_set1_epi32(static_cast<int32_t>(0x88888888u)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(zw + 8 * h), words);
  }
  const int ncols = 8 * nwords;
  const T* src = p.scale + gi * p.N + kTileCols * t;
  const __m256i fifteen = _mm256_set1_epi32(15);
  if (p.w.tiled) {
    const __m256i shifts = _mm256_load_si256(reinterpret_cast<const __m256i*>(kShiftOfLane8));
    for (int i = 0; i < 8; ++i) {
      for (int h = 0; h < 2; ++h) {
        const int at = i * kTileWords + 8 * h;
        const __m256i zp = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(zw[2 * i + h]), shifts), fifteen);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(z + at), zp);
        _mm256_storeu_ps(s + at, scales8(src, at, ncols));
      }
    }
    return;
  }
  alignas(32) float row[kTileCols];
  for (int c = 0; c < kTileCols; c += kLanes) _mm256_store_ps(row + c, scales8(src, c, ncols));
  for (int i = 0; i < 8; ++i) {
    for (int h = 0; h < 2; ++h) {
      const int at = i * kTileWords + 8 * h;
      const __m256i words = _mm256_load_si256(reinterpret_cast<const __m256i*>(zw + 8 * h));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(z + at), _mm256_and_si256(_mm256_srli_epi32(words, 4 * i), fifteen));
      const __m256i idx = _mm256_add_epi32(_mm256_slli_epi32(_mm256_add_epi32(lane, _mm256_set1_epi32(8 * h)), 3),
                                           _mm256_set1_epi32(kOrder[i]));
      _mm256_storeu_ps(s + at, _mm256_i32gather_ps(row, idx, 4));
    }
  }
}
#else
template <typename T>
void group_params(const Problem<T>& p, int64_t t, int64_t gi, int nwords, int32_t* z, float* s) {
  for (int i = 0; i < 8; ++i) {
    for (int w = 0; w < kTileWords; ++w) {
      const int64_t c = p.w.lane_column(t, i, w);
      const bool in = c < p.N;
      const int32_t zw = in && p.zeros ? p.zeros[gi * p.w.words + c / 8] : 0;
      z[i * kTileWords + w] = !in ? 0 : p.zeros ? (zw >> (4 * kNibbleOf[c % 8])) & 15 : 8;
      s[i * kTileWords + w] = in ? static_cast<float>(p.scale[gi * p.N + c]) : 0.f;
    }
  }
}
#endif

// Group gi's scales and zero points of tile t into the cache, a group ahead: each is a row of its
// own (N scales apart), which the hardware prefetcher does not follow (measured: the 120 GEMVs of
// a SmolLM2 decode step 2.5 -> 2.2 ms). __builtin_prefetch(.., 0, 3): prefetcht0 on x86.
template <typename T>
inline __attribute__((always_inline)) void prefetch_group_params(const Problem<T>& p, int64_t t, int64_t gi, int nwords) {
  const char* sn = reinterpret_cast<const char*>(p.scale + gi * p.N + 8 * t * kTileWords);
  for (int64_t b = 0; b < 8 * nwords * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(sn + b, 0, 3);
  if (p.zeros) __builtin_prefetch(p.zeros + gi * p.w.words + t * kTileWords, 0, 3);
}

inline Packed packed_of(const at::Tensor& qweight, int64_t K, int64_t N) {
  const bool tiled = qweight.dim() == 3;
  TORCH_CHECK(qweight.scalar_type() == at::kInt && qweight.is_contiguous(), "w4: qweight must be dense int32");
  if (tiled) {
    TORCH_CHECK(qweight.size(0) == num_tiles(N / 8) && qweight.size(1) == K &&
                    qweight.size(2) == kTileWords, "w4: column_tiled qweight shape");
  } else {
    TORCH_CHECK(qweight.dim() == 2 && qweight.size(0) == K && qweight.size(1) == N / 8, "w4: qweight shape");
  }
  return Packed{qweight.data_ptr<int32_t>(), K, N / 8, tiled};
}

// The weight's tensors as the kernels read them, dense (copied only when one is not): the vendor's
// Python wrapper then makes no call of its own before the kernel's.
struct DenseWeights {
  at::Tensor qweight, scale;
  std::optional<at::Tensor> offset;
};

inline DenseWeights dense_weights(const at::Tensor& qweight, const at::Tensor& scale,
                                  const std::optional<at::Tensor>& offset) {
  return {qweight.contiguous(), scale.contiguous(),
          offset.has_value() ? std::optional<at::Tensor>(offset->contiguous()) : std::nullopt};
}

inline void check_common(const at::Tensor& scale, const std::optional<at::Tensor>& offset, int64_t K, int64_t g) {
  TORCH_CHECK(g > 0 && K % g == 0, "w4: group size must divide K");
  TORCH_CHECK(scale.dim() == 2, "w4: scale [K/g, N]");
  const int64_t N = scale.size(1);
  TORCH_CHECK(scale.size(0) == K / g && N % 8 == 0 && scale.is_contiguous(), "w4: scale");
  if (offset.has_value()) {
    TORCH_CHECK(offset->scalar_type() == at::kInt && offset->dim() == 2 && offset->is_contiguous() &&
                    offset->size(0) == K / g && offset->size(1) == N / 8, "w4: offset");
  }
}

// The activations and the result in the caller's dtype without a dispatcher call where none is
// needed: a Tensor::to costs about a microsecond and a half at decode sizes, and a bfloat16 call
// made two of them, 3 of the 9-11 us of SmolLM2's 576 x 576 W4A16 GEMV (Zen 5 VM, hot).
//
// x [M, K] as dense float32 rows: x's own data when float32 and dense; a dense bfloat16 / float16
// x widened (exactly, common.h's to_float) into `own`; anything else through Tensor::to into `keep`.
inline bool is_16bit(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf; }

inline const float* float_rows(const at::Tensor& x, std::unique_ptr<float[]>& own, at::Tensor& keep) {
  if (x.is_contiguous() && x.scalar_type() == at::kFloat) return x.data_ptr<float>();
  if (!x.is_contiguous() || !is_16bit(x)) {
    keep = x.to(at::kFloat).contiguous();
    return keep.data_ptr<float>();
  }
  const int64_t n = x.numel();
  own.reset(new float[std::max<int64_t>(n, 1)]);
  if (x.scalar_type() == at::kBFloat16) {
    to_float(x.data_ptr<c10::BFloat16>(), own.get(), n);
  } else {
    to_float(x.data_ptr<c10::Half>(), own.get(), n);
  }
  return own.get();
}

// Where a kernel writes its float32 [M, N] result, and that result in x's dtype: a float32 tensor
// returned as it is (float32 x), else a buffer rounded once into a new tensor of x's dtype (round
// to nearest even, common.h's from_float, as Tensor::to; in parallel from 64K values on).
class ResultRows {
 public:
  ResultRows(const at::Tensor& x, int64_t M, int64_t N) : M_(M), N_(N), x_(x) {
    if (is_16bit(x)) {
      own_.reset(new float[std::max<int64_t>(M * N, 1)]);
      data_ = own_.get();
    } else {
      y_ = empty_tensor({M, N}, x.options().dtype(at::kFloat));
      data_ = y_.data_ptr<float>();
    }
  }
  float* data() const { return data_; }
  at::Tensor result() {
    if (!own_) return x_.scalar_type() == at::kFloat ? y_ : y_.to(x_.scalar_type());
    at::Tensor out = empty_tensor({M_, N_}, x_.options());
    const bool bf16 = x_.scalar_type() == at::kBFloat16;
    at::parallel_for(0, M_ * N_, 1 << 16, [&](int64_t b, int64_t e) {
      if (bf16) {
        from_float(data_ + b, out.data_ptr<c10::BFloat16>() + b, e - b);
      } else {
        from_float(data_ + b, out.data_ptr<c10::Half>() + b, e - b);
      }
    });
    return out;
  }

 private:
  int64_t M_, N_;
  at::Tensor x_, y_;
  std::unique_ptr<float[]> own_;
  float* data_ = nullptr;
};

}  // namespace w4
}  // namespace dlinfer_cpu
