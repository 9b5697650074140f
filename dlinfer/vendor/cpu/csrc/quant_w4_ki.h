// The k_interleaved layout of W4 weights as the cpu vendor's kernels read it, and what its two
// kernel files share: quant_w4_int.cpp (x at its own precision: the digit paths 0-2 and path 3) and
// quant_w4_a8.cpp (paths 4 and 5: 8-bit and 16-bit integer activations, opt-in). Layout: dlinfer/vendor/w4_layouts.py;
// contract: docs/ops.md (weight_quant_matmul); design: docs/design.md, "W4A16 as integer dot
// products", "W4 with 8-bit activations" and "W4 with 16-bit activations".
#pragma once

#include "quant_w4.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

namespace dlinfer_cpu {
namespace w4v {

constexpr int64_t kCols = 64;       // output columns per tile (4 vectors of 16)
constexpr int kVecs = 4;            // 16-column vectors per tile
constexpr int64_t kLineBytes = 64;  // one 16-column vector's 8 rows of k: 16 lanes x 4 bytes
constexpr int64_t kBlockK = 8;      // rows of k per line
constexpr int64_t kMaxGroup = 1024; // the digit paths' D01 stays inside int32 (quant_w4_int.cpp), path 4's |D| below 2^21, path 5's below 2^28
// Lines this far ahead are prefetched into L2 (_MM_HINT_T1): from memory, one call streaming 3.8 MB
// read at 0.81-0.83 of a float32 sum's rate with T1 against 0.73-0.76 with T0 (at 2-16 KB ahead
// alike) and 0.58 with none (docs/notes/w4a16-kernels.md; why T0 is slower was not measured:
// perhaps its misses hold L1 fill buffers for the whole trip from memory). With the group
// parameters inside the stream, 4 KB stayed best at the 1B shapes (2 KB: step 0.74 of the probe,
// 1 KB: 0.64, 4 KB: 0.80).
constexpr int64_t kPrefetchBytes = 4096;

// The line `bytes` past p, or `last` where that would pass it (the prefetches' target; a min, which
// the compiler selects rather than branches on).
inline const char* ahead(const uint8_t* p, int64_t bytes, const uint8_t* last) {
  return reinterpret_cast<const char*>(p + std::min<int64_t>(bytes, last - p));
}

inline int64_t num_tiles(int64_t n) { return (n + kCols - 1) / kCols; }

// A k_interleaved weight (dlinfer/vendor/w4_layouts.py): per tile t and group gi a block of
// `block_bytes`: the group's 64 scales (S: float16 or float32), its 64 zero points (a byte each),
// then its g/8 x 4 lines. The byte of column c (vector v, lane l = c % 16) and row k (kb = k / 8 over
// K) is byte 4 * l + k % 4 of line(t, kb, v), nibble k % 8 / 4 (low: k % 8 < 4).
struct Layout {
  const uint8_t* q;
  int64_t K, N, g, G;
  int64_t scale_bytes;  // 2 (float16) or 4 (float32)
  int64_t param_bytes;  // scales and zero points, before a group's lines
  int64_t block_bytes;
  inline const uint8_t* block(int64_t t, int64_t gi) const { return q + (t * G + gi) * block_bytes; }
  inline const uint8_t* zeros(int64_t t, int64_t gi) const { return block(t, gi) + kCols * scale_bytes; }
  // S: the scales' type inside the blocks (at::Half or float)
  template <typename S>
  inline const S* scales(int64_t t, int64_t gi) const { return reinterpret_cast<const S*>(block(t, gi)); }
  // tile t's 16-column vectors with a column inside N
  inline int vectors(int64_t t) const { return static_cast<int>(std::min<int64_t>(kVecs, (N - kCols * t + 15) / 16)); }
  // line v of rows 8 kb .. 8 kb + 7 (kb counted over the whole K)
  inline const uint8_t* line(int64_t t, int64_t kb, int v) const {
    const int64_t per = g / kBlockK, gi = kb / per;
    return block(t, gi) + param_bytes + ((kb - gi * per) * kVecs + v) * kLineBytes;
  }
  inline const uint8_t* end() const { return q + num_tiles(N) * G * block_bytes; }
};

inline int64_t param_bytes_of(int64_t scale_bytes) { return kCols * scale_bytes + kCols; }
inline int64_t block_bytes_of(int64_t g, int64_t scale_bytes) { return param_bytes_of(scale_bytes) + g / kBlockK * kVecs * kLineBytes; }
// The bytes of a scale in blocks of B bytes at group size g: 2 (float16) or 4 (float32); 0 when B is neither's.
inline int64_t scale_bytes_of(int64_t block_bytes, int64_t g) {
  return block_bytes == block_bytes_of(g, 2) ? 2 : block_bytes == block_bytes_of(g, 4) ? 4 : 0;
}

constexpr int64_t kSplitBelowTiles = 16;  // 64-column tiles: as quant_w4.cpp's 8 tiles of 128

// The paths: 0-2 give the same bits (the digit paths); 3 (bfloat16 x only) its own; 4 (8-bit
// activations, opt-in: quant_w4_a8.cpp) its own; 5 (16-bit activations, opt-in, AVX2 builds:
// quant_w4_a8.cpp) its own.
enum Path : int64_t { kPortable = 0, kVnni = 1, kAmx = 2, kBf16 = 3, kInt8 = 4, kInt16 = 5 };

// tile(t, g0, g1, row): tile t's 64 columns over groups g0..g1 for every row m into row(m)[0..64).
template <typename Tile>
void run(const Layout& w, int64_t M, const float* bias, float* y, Tile tile) {
  const int64_t N = w.N, tiles = num_tiles(N), G = w.G;
  const int64_t halves = tiles < kSplitBelowTiles && G >= 2 ? 2 : 1;
  const int64_t items = tiles * halves;
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max(grain_for(items, w.K * N / 2), (items + threads - 1) / threads);
  const int64_t width = tiles * kCols;
  // halves == 1: each thread stores its tiles' outputs (+ bias) into y as soon as they are done,
  // from its own cache, rather than the calling thread reading every row back after the region
  // (no difference measured above the noise); halves == 2: the two halves are added after it.
  std::unique_ptr<float[]> part(new float[halves * M * width]);  // [half][M][width]
  at::parallel_for(0, items, grain, [&](int64_t b, int64_t e) {
    for (int64_t it = b; it < e; ++it) {
      const int64_t t = it / halves, h = it % halves;
      const int64_t g0 = h == 0 ? 0 : G / 2, g1 = halves == 1 || h == 1 ? G : G / 2;
      float* const lanes = part.get() + h * M * width + t * kCols;
      tile(t, g0, g1, [&](int64_t m) { return lanes + m * width; });
      if (halves == 1) {
        const int64_t c0 = t * kCols, c1 = std::min(N, c0 + kCols);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t c = c0; c < c1; ++c) y[m * N + c] = bias ? lanes[m * width + c - c0] + bias[c] : lanes[m * width + c - c0];
      }
    }
  });
  if (halves == 1) return;
  for (int64_t m = 0; m < M; ++m) {
    const float* lo = part.get() + m * width;
    const float* hi = lo + M * width;
    float* yr = y + m * N;
    for (int64_t c = 0; c < N; ++c) {
      const float sum = lo[c] + hi[c];
      yr[c] = bias ? sum + bias[c] : sum;
    }
  }
}

// The largest |x[k]| of a group of g values into amax; false where one is an inf or a NaN (amax
// is then meaningless).
inline bool group_absmax(const float* x, int64_t g, float& amax) {
  amax = 0.f;
  bool finite = true;
  int64_t k = 0;
#if defined(CPU_CAPABILITY_AVX512)
  __m512 vmax = _mm512_setzero_ps(), nan_if_not_finite = _mm512_setzero_ps();
  for (; k + 16 <= g; k += 16) {
    const __m512 v = _mm512_loadu_ps(x + k);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
    nan_if_not_finite = _mm512_add_ps(nan_if_not_finite, _mm512_mul_ps(v, _mm512_setzero_ps()));  // inf * 0, NaN * 0: NaN
  }
  amax = _mm512_reduce_max_ps(vmax);
  finite = _mm512_cmp_ps_mask(nan_if_not_finite, nan_if_not_finite, _CMP_UNORD_Q) == 0;
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vmax = _mm256_setzero_ps(), nan_if_not_finite = _mm256_setzero_ps();
  for (; k + 8 <= g; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    vmax = _mm256_max_ps(vmax, _mm256_and_ps(v, magnitude));
    nan_if_not_finite = _mm256_add_ps(nan_if_not_finite, _mm256_mul_ps(v, _mm256_setzero_ps()));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  amax = _mm_cvtss_f32(m4);  // a NaN may land here, but then `finite` is false and amax unused
  finite = _mm256_movemask_ps(_mm256_cmp_ps(nan_if_not_finite, nan_if_not_finite, _CMP_UNORD_Q)) == 0;
#endif
  for (; k < g; ++k) {
    const float a = std::fabs(x[k]);
    finite = finite && std::isfinite(a);
    amax = std::max(amax, a);
  }
  return finite;
}

// Whether this CPU runs the VNNI paths (1, and 4 on an AVX-512 build).
bool vnni_here();
// Whether this build and CPU run path 4 (quant_w4_a8.cpp: VNNI on an AVX-512 build, any AVX2 build).
bool int8_path_here();

// Path 4 (quant_w4_a8.cpp): x [M, K] float32 rows, quantised to 8 bits per row and group, times the
// weight w -> y [M, N] float32 (+ bias [N]?). S: the scales' type inside the blocks (at::Half or float).
template <typename S>
void run_int8(const Layout& w, const float* x, int64_t M, const float* bias, float* y);

// Whether this build runs path 5 (quant_w4_a8.cpp: AVX2 builds; not written for AVX-512 yet).
bool int16_path_here();

// Path 5 (quant_w4_a8.cpp): as run_int8 with x as 16-bit integers per row and group (int16 pairs).
template <typename S>
void run_int16(const Layout& w, const float* x, int64_t M, const float* bias, float* y);

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// Four bytes as one 32-bit lane (vpdpbusd's activation operand; vpmaddubsw's on AVX2; path 5's
// pair of int16 values for vpmaddwd).
inline int32_t four_bytes(const int8_t* d) {
  int32_t v;
  std::memcpy(&v, d, sizeof(v));
  return v;
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
#define kVnniTarget __attribute__((target("avx512f,avx512bw,avx512vnni,avx512dq,fma")))

// Vector v's 16 scales of a group as float32 (zero past N, as the block holds them).
template <typename S>
kVnniTarget inline __m512 scales_vec(const Layout& w, int64_t t, int64_t gi, int v) {
  return w4::scales16(w.scales<S>(t, gi), 16 * v, static_cast<int>(kCols));
}

// Vector v's 16 zero points of a group, int32 (0 past N, as the block holds them).
kVnniTarget inline __m512i zero_vec(const Layout& w, int64_t t, int64_t gi, int v) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.zeros(t, gi) + 16 * v)));
}

// The same, each lane's zero point in all 4 of its bytes (subtracted from the weight bytes).
kVnniTarget inline __m512i zero_bytes(const Layout& w, int64_t t, int64_t gi, int v) {
  return _mm512_mullo_epi32(zero_vec(w, t, gi, v), _mm512_set1_epi32(0x01010101));
}

#endif

}  // namespace w4v
}  // namespace dlinfer_cpu
