// W4A16 (weight_quant_matmul) as exact integer dot products: the k_interleaved layout and its
// kernel, the cpu vendor's path on CPUs with AVX-512 VNNI (vpdpbusd, one row) and AMX-INT8
// (tdpbssd, more rows), with a portable loop elsewhere, and for bfloat16 x on CPUs with
// AVX512-BF16 and no AMX a path of float32 sums (path 3, below the AMX one). Layout: dlinfer/vendor/w4_layouts.py;
// contract: docs/ops.md (the table's weight_quant_matmul row); design: docs/design.md, "W4A16 as integer dot
// products".
//
// Why: the float32 register kernel (quant_w4.cpp) is bound by its decode at one row, 3 vector
// instructions per 16 weights. Here, at one row, 128 weights take 3 decode instructions and 8
// vpdpbusd; from two rows on, AMX takes 4 rows x 4 digit planes a tile instruction (vpdpbusd
// alone would be slower there than the float32 kernel, which shares each decode among 8 rows; so
// without AMX the cpu vendor makes this layout by default only for bfloat16 models, which take
// path 3: weight_quant.py, docs/benchmarks.md).
//
// Arithmetic, per row m and group G of g rows of k (g % 8 == 0):
//   e = the exponent of max_{k in G} |x[m, k]| (frexp: max < 2^e); every x[m, k] of the group is
//   X_k = round_half_even(x * 2^(30 - e)), an integer with |X_k| <= 2^30, exact for every element
//   within a factor 2^6 of the group's largest (their bits stop above 2^(e - 30)), else off by at
//   most 2^(e - 31). X_k = ((d0 * 256 + d1) * 256 + d2) * 256 + d3 with int8 digits d_j in
//   [-128, 127] (d3, d2, d1: balanced base-256 digits; d0 = the rest, |d0| <= 65).
//   acc_j[c] = sum_{k in G} q[k, c] * d_j[k] (vpdpbusd: unsigned nibble times signed digit, int32:
//   exact), D01 = acc_0 * 256 + acc_1 - z * S01, D23 = acc_2 * 256 + acc_3 - z * S23 with
//   S01 = sum_k (d0 * 256 + d1), S23 = sum_k (d2 * 256 + d3): exact int32 (|D01| < 2^19 g),
//   so D01 * 2^16 + D23 = sum_k (q - z) * X_k exactly. In float32: f = fma(float(D01), 2^16,
//   float(D23)) (at most three roundings), then y = fma(f, 2^(e - 30) * s, y) (the product with a
//   power of two is exact barring underflow below 2^-126, so one rounding), groups in order. f
//   stays below 2^45, and the fma rounds once, so nothing overflows before y itself would.
// The digit paths (portable, VNNI, AMX) compute the same exact integers and then exactly this
// epilogue, so they give the same bits; a row's bits do not depend on M or on which of them ran
// (path 3 has its own bits, also independent of M), and the split
// of a tile's groups into two halves depends on N, K and g only (as in quant_w4.cpp).
// Non-finite x: the group's factor is NaN, so the row's outputs are NaN (an inf in x gives NaN,
// where a float32 sum gives +-inf or NaN).
#include "entry_points.h"
#include "quant_w4_ki.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <cpuid.h>  // amx_here: the CPU's AMX flags, and Linux's grant of the tile state
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

namespace dlinfer_cpu {
namespace w4v {

// One group of g values (g % 8 == 0) into digits d[0..3][0..g) and (factor, S01, S23). The
// scaling by 2^(30 - e) is exact in float32 (a power of two, results below 2^30), and the rounding
// to an integer is cvtps2dq's round-half-even (the portable path: nearbyint in the default mode).
struct GroupSplit {
  float factor;
  int32_t s01, s23;
};

inline void digits_of(int32_t X, int8_t* dig) {
  for (int j = 3; j >= 1; --j) {
    dig[j] = static_cast<int8_t>(X);  // the low byte as signed: X mod 256 in [-128, 127]
    X = (X - dig[j]) >> 8;            // exact
  }
  dig[0] = static_cast<int8_t>(X);
}

GroupSplit split_group(const float* x, int64_t g, int8_t* const* d) {
  float amax = 0.f;
  const bool finite = group_absmax(x, g, amax);
  if (!finite || amax == 0.f) {
    for (int j = 0; j < 4; ++j) std::memset(d[j], 0, g);
    return {finite ? 0.f : std::numeric_limits<float>::quiet_NaN(), 0, 0};
  }
  int e = 0;
  std::frexp(amax, &e);  // amax < 2^e
  int32_t s01 = 0, s23 = 0;
  int64_t k = 0;
  if (e >= -90) {  // 2^(30 - e) is a float32 and every scaled value an exact one
    const float up = std::ldexp(1.0f, 30 - e);
#if defined(CPU_CAPABILITY_AVX512)
    __m512i v01 = _mm512_setzero_si512(), v23 = _mm512_setzero_si512();
    for (; k + 16 <= g; k += 16) {
      __m512i X = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), _mm512_set1_ps(up)));
      __m512i dj[4];
      for (int j = 3; j >= 1; --j) {
        dj[j] = _mm512_srai_epi32(_mm512_slli_epi32(X, 24), 24);
        X = _mm512_srai_epi32(_mm512_sub_epi32(X, dj[j]), 8);
      }
      dj[0] = X;
      for (int j = 0; j < 4; ++j) _mm_storeu_si128(reinterpret_cast<__m128i*>(d[j] + k), _mm512_cvtepi32_epi8(dj[j]));
      v01 = _mm512_add_epi32(v01, _mm512_add_epi32(_mm512_slli_epi32(dj[0], 8), dj[1]));
      v23 = _mm512_add_epi32(v23, _mm512_add_epi32(_mm512_slli_epi32(dj[2], 8), dj[3]));
    }
    s01 = _mm512_reduce_add_epi32(v01);
    s23 = _mm512_reduce_add_epi32(v23);
#endif
    for (; k < g; ++k) {
      int8_t dig[4];
      digits_of(static_cast<int32_t>(std::nearbyint(x[k] * up)), dig);
      for (int j = 0; j < 4; ++j) d[j][k] = dig[j];
      s01 += dig[0] * 256 + dig[1];
      s23 += dig[2] * 256 + dig[3];
    }
  } else {  // tiny values: the same integers through double
    for (; k < g; ++k) {
      int8_t dig[4];
      digits_of(static_cast<int32_t>(std::nearbyint(std::ldexp(static_cast<double>(x[k]), 30 - e))), dig);
      for (int j = 0; j < 4; ++j) d[j][k] = dig[j];
      s01 += dig[0] * 256 + dig[1];
      s23 += dig[2] * 256 + dig[3];
    }
  }
  return {std::ldexp(1.0f, e - 30), s01, s23};
}

// The activations of one call as digits: d[m][j][k] (int8), per (m, group) the factor 2^(e - 30)
// (0 for an all-zero group, NaN for a non-finite one) and S01, S23. One allocation.
struct Digits {
  int64_t M, K, G, g;
  std::unique_ptr<char[]> buffer;
  int8_t* d;
  GroupSplit* groups;  // [M, G]
  const int8_t* digits(int64_t m, int j) const { return d + (m * 4 + j) * K; }
  const GroupSplit& group(int64_t m, int64_t gi) const { return groups[m * G + gi]; }
};

// The digit rows are padded with zeros to a multiple of 4 rows of x: the AMX path loads 4 rows at a
// time, so a last block of 1-3 rows needs no tile configuration of its own.
Digits split_activations(const float* x, int64_t M, int64_t K, int64_t g) {
  const int64_t G = K / g, padded = (M + 3) / 4 * 4;
  const size_t digit_bytes = static_cast<size_t>((padded * 4 * K + 63) / 64 * 64);
  Digits out{M, K, G, g, std::unique_ptr<char[]>(new char[digit_bytes + M * G * sizeof(GroupSplit)]), nullptr, nullptr};
  out.d = reinterpret_cast<int8_t*>(out.buffer.get());
  out.groups = reinterpret_cast<GroupSplit*>(out.buffer.get() + digit_bytes);
  std::memset(out.d + M * 4 * K, 0, static_cast<size_t>((padded - M) * 4 * K));
  at::parallel_for(0, M, grain_for(M, M * K * 4), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t gi = 0; gi < G; ++gi) {
        int8_t* d[4];
        for (int j = 0; j < 4; ++j) d[j] = out.d + (m * 4 + j) * K + gi * g;
        out.groups[m * G + gi] = split_group(x + m * K + gi * g, g, d);
      }
  });
  return out;
}

// S: the scales' type inside the blocks (at::Half or float).
template <typename S>
struct Problem {
  Layout w;
  const Digits* a;
};

// The group epilogue of one 16-column vector (portable and vector paths alike, lane by lane):
// y += (fma(float(D01), 2^16, float(D23)) * factor) * s.
inline float epilogue_lane(int32_t a0, int32_t a1, int32_t a2, int32_t a3, int32_t z, int32_t s01, int32_t s23,
                           float factor, float s, float y) {
  const int32_t d01 = a0 * 256 + a1 - z * s01;
  const int32_t d23 = a2 * 256 + a3 - z * s23;
  const float f = std::fma(static_cast<float>(d01), 65536.0f, static_cast<float>(d23));
  return std::fma(f, factor * s, y);
}

// Portable: row m of tile t over groups g0..g1 into lanes[64] (columns 64t..64t+63).
template <typename S>
void tile_row_portable(const Problem<S>& p, int64_t t, int64_t m, int64_t g0, int64_t g1, float* lanes) {
  const int64_t g = p.a->g;
  for (int v = 0; v < kVecs; ++v) {
    float y[16] = {};
    for (int64_t gi = g0; gi < g1; ++gi) {
      int32_t acc[4][16] = {};
      for (int64_t kb = gi * g / kBlockK; kb < (gi + 1) * g / kBlockK; ++kb) {
        const uint8_t* line = p.w.line(t, kb, v);
        for (int l = 0; l < 16; ++l)
          for (int r = 0; r < 8; ++r) {
            const int32_t q = r < 4 ? line[4 * l + r] & 15 : line[4 * l + r - 4] >> 4;
            for (int j = 0; j < 4; ++j) acc[j][l] += q * p.a->digits(m, j)[kb * kBlockK + r];
          }
      }
      const uint8_t* z = p.w.zeros(t, gi) + 16 * v;
      const S* s = p.w.template scales<S>(t, gi) + 16 * v;
      const GroupSplit& gs = p.a->group(m, gi);
      for (int l = 0; l < 16; ++l)
        y[l] = epilogue_lane(acc[0][l], acc[1][l], acc[2][l], acc[3][l], z[l], gs.s01, gs.s23, gs.factor,
                             static_cast<float>(s[l]), y[l]);
    }
    std::memcpy(lanes + 16 * v, y, sizeof(y));
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The group epilogue of one 16-column vector from its four int32 sums with the zero point already
// subtracted (a1 and a3 carry it: D01 = a0 * 256 + a1, D23 = a2 * 256 + a3) and its scales s: the
// arithmetic of epilogue_lane, 16 lanes at a time; returns the new y.
kVnniTarget inline __m512 epilogue_vec(__m512 s, float factor, __m512i a0, __m512i a1, __m512i a2, __m512i a3,
                                       __m512 y) {
  const __m512i d01 = _mm512_add_epi32(_mm512_slli_epi32(a0, 8), a1);
  const __m512i d23 = _mm512_add_epi32(_mm512_slli_epi32(a2, 8), a3);
  const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d01), _mm512_set1_ps(65536.0f), _mm512_cvtepi32_ps(d23));
  return _mm512_fmadd_ps(f, _mm512_mul_ps(_mm512_set1_ps(factor), s), y);
}

template <typename S>
kVnniTarget void tile_row_vnni(const Problem<S>& p, int64_t t, int64_t m, int64_t g0, int64_t g1, float* lanes) {
  const int64_t g = p.a->g, per = g / kBlockK;
  const __m512i low = _mm512_set1_epi8(15);
  const int8_t* dj[4];
  for (int j = 0; j < 4; ++j) dj[j] = p.a->digits(m, j);
  __m512 y[kVecs];
  for (int v = 0; v < kVecs; ++v) y[v] = _mm512_setzero_ps();
  const uint8_t* const end = p.w.end() - kLineBytes;
  for (int64_t gi = g0; gi < g1; ++gi) {
    __m512i acc[4][kVecs];
    for (int j = 0; j < 4; ++j)
      for (int v = 0; v < kVecs; ++v) acc[j][v] = _mm512_setzero_si512();
    const uint8_t* const lines = p.w.block(t, gi) + p.w.param_bytes;
    for (int64_t b = 0; b < per; ++b) {
      const uint8_t* line = lines + b * kVecs * kLineBytes;
      const int64_t kb = gi * per + b;
      for (int v = 0; v < kVecs; ++v)  // the stream kPrefetchBytes on (past the tensor's end: its last line)
        _mm_prefetch(ahead(line, kPrefetchBytes + v * kLineBytes, end), _MM_HINT_T1);
      __m512i lo[kVecs], hi[kVecs];
      for (int v = 0; v < kVecs; ++v) {
        const __m512i bytes = _mm512_loadu_si512(line + v * kLineBytes);
        lo[v] = _mm512_and_si512(bytes, low);
        hi[v] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
      }
      for (int j = 0; j < 4; ++j) {
        const __m512i a_lo = _mm512_set1_epi32(four_bytes(dj[j] + kBlockK * kb));
        const __m512i a_hi = _mm512_set1_epi32(four_bytes(dj[j] + kBlockK * kb + 4));
        for (int v = 0; v < kVecs; ++v) {
          acc[j][v] = _mm512_dpbusd_epi32(acc[j][v], lo[v], a_lo);
          acc[j][v] = _mm512_dpbusd_epi32(acc[j][v], hi[v], a_hi);
        }
      }
    }
    const GroupSplit& gs = p.a->group(m, gi);
    for (int v = 0; v < kVecs; ++v) {
      if (v >= p.w.vectors(t)) break;
      const __m512i z = zero_vec(p.w, t, gi, v);  // the zero point, subtracted in int32
      const __m512i a1 = _mm512_sub_epi32(acc[1][v], _mm512_mullo_epi32(z, _mm512_set1_epi32(gs.s01)));
      const __m512i a3 = _mm512_sub_epi32(acc[3][v], _mm512_mullo_epi32(z, _mm512_set1_epi32(gs.s23)));
      y[v] = epilogue_vec(scales_vec<S>(p.w, t, gi, v), gs.factor, acc[0][v], a1, acc[2][v], a3, y[v]);
    }
  }
  for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(lanes + 16 * v, y[v]);
}

bool vnni_here() {
  static const bool yes = __builtin_cpu_supports("avx512vnni");
  return yes;
}

// ---- AMX (tdpbssd): up to 4 rows x 4 digit planes against 64 rows of k x 16 columns a tile
// instruction. The integer sums are the VNNI path's zero-corrected sums, exactly, and the
// epilogue is epilogue_vec in the same group order, so every path gives the same bits.
#define kAmxTarget __attribute__((target("avx512f,avx512bw,avx512vnni,avx512dq,fma,amx-tile,amx-int8")))

bool amx_here() {
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1u) || !((d >> 25) & 1u)) return false;
    // Linux hands the tile state out on request, once per process (ARCH_REQ_XCOMP_PERM, XTILEDATA)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return yes;
}

// The k rows one tile instruction takes for group size g: 64, or g itself below 64; 0: none fits.
inline int64_t amx_chunk(int64_t g) { return g % 64 == 0 ? 64 : g < 64 ? g : 0; }

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0: A, the digits of `mr` rows (row 4 m + j: row m's plane j), kc bytes; tmm1: B, kc/4 rows of
// 64 bytes (4 rows of k x 16 columns each); tmm2..5: C, the int32 sums of the tile's 4 vectors.
kAmxTarget inline void amx_configure(int mr, int64_t kc) {
  TileConfig cfg;
  cfg.rows[0] = static_cast<uint8_t>(4 * mr);
  cfg.colsb[0] = static_cast<uint16_t>(kc);
  cfg.rows[1] = static_cast<uint8_t>(kc / 4);
  cfg.colsb[1] = 64;
  for (int v = 0; v < kVecs; ++v) {
    cfg.rows[2 + v] = static_cast<uint8_t>(4 * mr);
    cfg.colsb[2 + v] = 64;
  }
  _tile_loadconfig(&cfg);
}

// B for vector v of rows k0..k0+kc of tile t into b [kc/4][64], as the signed bytes q - z (z: the
// lane's zero point in each of its 4 bytes): line (k/8, v)'s low nibbles are rows k..k+3 (B row
// k/4), its high nibbles rows k+4..k+7 (the next B row). With the zero point in B, the tile sums
// are the VNNI path's corrected sums (acc_j - z * S_j), the same integers.
kAmxTarget inline void amx_unpack(const Layout& w, int64_t t, int64_t k0, int64_t kc, int v, __m512i zb, uint8_t* b,
                                  const uint8_t* end) {
  const __m512i low = _mm512_set1_epi8(15);
  const uint8_t* const first = w.line(t, k0 / kBlockK, v);  // rows k0..k0+kc lie in one group: lines 256 bytes apart
  for (int64_t kb = k0 / kBlockK; kb < (k0 + kc) / kBlockK; ++kb) {
    const uint8_t* line = first + (kb - k0 / kBlockK) * kVecs * kLineBytes;
    if (v == 0)
      for (int u = 0; u < kVecs; ++u)
        _mm_prefetch(ahead(line, kPrefetchBytes + u * kLineBytes, end), _MM_HINT_T1);
    const __m512i bytes = _mm512_loadu_si512(line);
    uint8_t* row = b + (kb - k0 / kBlockK) * 2 * kLineBytes;
    _mm512_store_si512(row, _mm512_sub_epi8(_mm512_and_si512(bytes, low), zb));
    _mm512_store_si512(row + kLineBytes, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), low), zb));
  }
}

// Rows 0..M-1 of tile t over groups g0..g1, into out(m) + 0..63 (row m's 64 lanes; y += per group).
template <typename S, typename Out>
kAmxTarget void tile_rows_amx(const Problem<S>& p, int64_t t, int64_t M, int64_t g0, int64_t g1, Out out) {
  const int64_t g = p.a->g, kc = amx_chunk(g), K = p.w.K;
  const int64_t chunks = g / kc;
  alignas(64) uint8_t b[16][kVecs][16 * 64];  // a group's B tiles: [chunk][vector] (g <= 1024: 16 chunks)
  alignas(64) int32_t c[kVecs][16][16];
  const uint8_t* const end = p.w.end() - kLineBytes;
  amx_configure(static_cast<int>(std::min<int64_t>(4, M)), kc);  // 4 rows a block (the digits are padded)
  const int vecs = p.w.vectors(t);
  for (int64_t gi = g0; gi < g1; ++gi) {
    __m512 sc[kVecs];  // the group's scales, shared by the rows
    for (int v = 0; v < kVecs; ++v) {
      const __m512i zb = zero_bytes(p.w, t, gi, v);  // 0 past N, as the weight's zero padding there
      for (int64_t ch = 0; ch < chunks; ++ch) amx_unpack(p.w, t, gi * g + ch * kc, kc, v, zb, b[ch][v], end);
      if (v < vecs) sc[v] = scales_vec<S>(p.w, t, gi, v);
    }
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int mr = static_cast<int>(std::min<int64_t>(4, M - m0));  // rows of the block to keep
      _tile_zero(2);
      _tile_zero(3);
      _tile_zero(4);
      _tile_zero(5);
      for (int64_t ch = 0; ch < chunks; ++ch) {
        _tile_loadd(0, p.a->digits(m0, 0) + gi * g + ch * kc, K);  // rows (m0 + r / 4, plane r % 4): stride K
        _tile_loadd(1, b[ch][0], 64);
        _tile_dpbssd(2, 0, 1);
        _tile_loadd(1, b[ch][1], 64);
        _tile_dpbssd(3, 0, 1);
        _tile_loadd(1, b[ch][2], 64);
        _tile_dpbssd(4, 0, 1);
        _tile_loadd(1, b[ch][3], 64);
        _tile_dpbssd(5, 0, 1);
      }
      _tile_stored(2, c[0], 64);
      _tile_stored(3, c[1], 64);
      _tile_stored(4, c[2], 64);
      _tile_stored(5, c[3], 64);
      for (int v = 0; v < vecs; ++v) {
        for (int r = 0; r < mr; ++r) {
          float* y = out(m0 + r) + 16 * v;
          const __m512 prev = gi == g0 ? _mm512_setzero_ps() : _mm512_loadu_ps(y);
          _mm512_storeu_ps(y, epilogue_vec(sc[v], p.a->group(m0 + r, gi).factor, _mm512_load_si512(c[v][4 * r]),
                                           _mm512_load_si512(c[v][4 * r + 1]), _mm512_load_si512(c[v][4 * r + 2]),
                                           _mm512_load_si512(c[v][4 * r + 3]), prev));
        }
      }
    }
  }
  _tile_release();  // lanes past N are left unwritten: nothing reads them
}

// ---- bfloat16 activations on AVX512-BF16 (vdpbf16ps): no digits. Each line's nibbles become the
// signed words q - z (the zero point subtracted in bytes, then a 32-entry table from the low 5
// bits to bfloat16: small integers are exact), and vdpbf16ps multiplies them by x's own bfloat16
// values: every product exact in float32, summed in float32 (vdpbf16ps: round to nearest even,
// subnormal inputs and results flushed to zero). One decode of 13 instructions serves up to 4
// rows, and a 64-byte line costs a row 4 vdpbf16ps (32 products each) where the digit paths spend
// 8 vpdpbusd: without AMX those are what bind from two rows on (docs/notes/w4a16-kernels.md).
// Per row, group and 16-column vector the sums go into 2 accumulators (columns 4L, 4L + 1 and
// 4L + 2, 4L + 3 of each 128-bit lane L, both nibble planes in turn: the same sequence at every
// M), whose lane pairs are added at the group's end, then y = fma(sum, s, y), groups in order: a
// row's bits depend neither on M nor on which rows share its block. They are not the digit paths'
// bits: the float32 sums round, subnormal x and partial results are flushed to zero, and partial
// sums past float32's range give inf or NaN where the digit paths may still be finite (|x| above
// ~2^128 / (15 g)) (bound: docs/design.md, "W4A16 as integer dot products";
// tests/vendor/cpu/test_cpu_w4_k_interleaved.py).
#define kBf16Target __attribute__((target("avx512f,avx512bw,avx512vnni,avx512dq,avx512bf16,fma")))

bool bf16_dot_here() {
  static const bool yes = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512dq");
  return yes;
}

// word i: the bfloat16 bits of i read as a signed 5-bit number (i - 32 from 16 on), for q - z in
// [-15, 15] (exact: at most 4 significant bits); the path-3 tests' random weights use every entry
// but -16's.
alignas(64) constexpr uint16_t kBf16OfNibbleDifference[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,   // 0 .. 7
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,   // 8 .. 15
    0xC180, 0xC170, 0xC160, 0xC150, 0xC140, 0xC130, 0xC120, 0xC110,   // -16 .. -9
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80};  // -8 .. -1

struct Bf16Problem {
  Layout w;
  const uint16_t* x;  // [M, K] bfloat16 bits, rows K apart
};

// Rows m0..m0+MR-1 of tile t in group gi, vectors v0..v0+VB-1 (MR x VB x 2 accumulators, at most 16),
// into out(m) + 16 v (y += the group's part; the first group stores it). Lanes past N are left
// unwritten.
template <int MR, int VB, typename S, typename Out>
kBf16Target inline void group_rows_bf16(const Bf16Problem& p, int64_t t, int64_t m0, int v0, int64_t gi, bool first,
                                        Out out) {
  const int64_t g = p.w.g, per = g / kBlockK, K = p.w.K;
  const __m512i low = _mm512_set1_epi8(15), zero = _mm512_setzero_si512();
  const __m512i table = _mm512_load_si512(kBf16OfNibbleDifference);
  const uint8_t* const end = p.w.end() - kLineBytes;
  const uint8_t* const lines = p.w.block(t, gi) + p.w.param_bytes;
  __m512i zb[VB];  // each lane's zero point in its 4 bytes
  for (int u = 0; u < VB; ++u) zb[u] = zero_bytes(p.w, t, gi, v0 + u);
  __m512 acc[MR][VB][2];
  for (int r = 0; r < MR; ++r)
    for (int u = 0; u < VB; ++u)
      for (int a = 0; a < 2; ++a) acc[r][u][a] = _mm512_setzero_ps();
  for (int64_t b = 0; b < per; ++b) {
    const uint8_t* const row_of_lines = lines + b * kVecs * kLineBytes;
    if (v0 == 0 && m0 == 0)  // the whole stream kPrefetchBytes on, as tile_row_vnni (past the tensor's end: its last line)
      for (int u = 0; u < kVecs; ++u)
        _mm_prefetch(ahead(row_of_lines, kPrefetchBytes + u * kLineBytes, end), _MM_HINT_T1);
    const uint16_t* const xk = p.x + m0 * K + kBlockK * (gi * per + b);
    for (int u = 0; u < VB; ++u) {
      const __m512i bytes = _mm512_loadu_si512(row_of_lines + (v0 + u) * kLineBytes);
      const __m512i lo = _mm512_sub_epi8(_mm512_and_si512(bytes, low), zb[u]);                        // rows k..k+3
      const __m512i hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), low), zb[u]);  // k+4..k+7
      // per 128-bit lane L (columns 4L..4L+3): unpacklo gives columns 4L, 4L+1 (4 rows each), unpackhi 4L+2, 4L+3
      const __m512bh w[4] = {(__m512bh)_mm512_permutexvar_epi16(_mm512_unpacklo_epi8(lo, zero), table),
                             (__m512bh)_mm512_permutexvar_epi16(_mm512_unpackhi_epi8(lo, zero), table),
                             (__m512bh)_mm512_permutexvar_epi16(_mm512_unpacklo_epi8(hi, zero), table),
                             (__m512bh)_mm512_permutexvar_epi16(_mm512_unpackhi_epi8(hi, zero), table)};
      for (int r = 0; r < MR; ++r) {  // x[m, k..k+3] and x[m, k+4..k+7] in every 64-bit lane (broadcast loads)
        int64_t x03, x47;
        std::memcpy(&x03, xk + r * K, sizeof(x03));
        std::memcpy(&x47, xk + r * K + 4, sizeof(x47));
        const __m512bh a03 = (__m512bh)_mm512_set1_epi64(x03), a47 = (__m512bh)_mm512_set1_epi64(x47);
        acc[r][u][0] = _mm512_dpbf16_ps(acc[r][u][0], w[0], a03);
        acc[r][u][1] = _mm512_dpbf16_ps(acc[r][u][1], w[1], a03);
        acc[r][u][0] = _mm512_dpbf16_ps(acc[r][u][0], w[2], a47);
        acc[r][u][1] = _mm512_dpbf16_ps(acc[r][u][1], w[3], a47);
      }
    }
  }
  for (int u = 0; u < VB; ++u) {
    const int v = v0 + u;
    if (v >= p.w.vectors(t)) break;
    const __m512 s = scales_vec<S>(p.w, t, gi, v);
    for (int r = 0; r < MR; ++r) {
      // lane pairs: (column, rows k, k+1) and (column, rows k+2, k+3); columns 4L, 4L+1 | 4L+2, 4L+3
      const __m512 a = acc[r][u][0], c = acc[r][u][1];
      const __m512 sum = _mm512_add_ps(_mm512_shuffle_ps(a, c, 0x88), _mm512_shuffle_ps(a, c, 0xDD));
      float* y = out(m0 + r) + 16 * v;
      _mm512_storeu_ps(y, _mm512_fmadd_ps(sum, s, first ? _mm512_setzero_ps() : _mm512_loadu_ps(y)));
    }
  }
}

// Rows 0..M-1 of tile t over groups g0..g1, group by group (the group's lines stay in L1 while
// every row block reads them): blocks of 4 rows (one 16-column vector at a time), then 3, then 2
// (two vectors at a time) or 1 (all four): 16, 12, 16 or 8 accumulators.
template <typename S, typename Out>
kBf16Target void tile_bf16(const Bf16Problem& p, int64_t t, int64_t M, int64_t g0, int64_t g1, Out out) {
  for (int64_t gi = g0; gi < g1; ++gi)
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      switch (std::min<int64_t>(4, M - m0)) {
        case 4:
          for (int v = 0; v < kVecs; v += 2) group_rows_bf16<4, 2, S>(p, t, m0, v, gi, gi == g0, out);
          break;
        case 3:
          for (int v = 0; v < kVecs; v += 2) group_rows_bf16<3, 2, S>(p, t, m0, v, gi, gi == g0, out);
          break;
        case 2:
          group_rows_bf16<2, 4, S>(p, t, m0, 0, gi, gi == g0, out);
          break;
        default:
          group_rows_bf16<1, 4, S>(p, t, m0, 0, gi, gi == g0, out);
      }
    }
}

#else
bool vnni_here() { return false; }
bool amx_here() { return false; }
bool bf16_dot_here() { return false; }
inline int64_t amx_chunk(int64_t) { return 0; }
#endif

template <typename S>
void tile_row(const Problem<S>& p, int64_t t, int64_t m, int64_t g0, int64_t g1, float* lanes, bool vnni) {
#if defined(CPU_CAPABILITY_AVX512)
  if (vnni) return tile_row_vnni(p, t, m, g0, g1, lanes);
#endif
  tile_row_portable(p, t, m, g0, g1, lanes);
}

// The digit paths (0-2) over x as float32 rows.
template <typename S>
void run_digits(const Layout& w, const Digits& digits, int64_t M, const float* bias, float* y, int64_t path) {
  const Problem<S> p{w, &digits};
  run(w, M, bias, y, [&](int64_t t, int64_t g0, int64_t g1, auto row) {
#if defined(CPU_CAPABILITY_AVX512)
    if (path == kAmx) return tile_rows_amx(p, t, M, g0, g1, row);
#endif
    for (int64_t m = 0; m < M; ++m) tile_row(p, t, m, g0, g1, row(m), path == kVnni);
  });
}

// Path 3 over x's bfloat16 bits.
template <typename S>
void run_bf16(const Layout& w, const uint16_t* x, int64_t M, const float* bias, float* y) {
#if defined(CPU_CAPABILITY_AVX512)
  const Bf16Problem p{w, x};
  run(w, M, bias, y, [&](int64_t t, int64_t g0, int64_t g1, auto row) { tile_bf16<S>(p, t, M, g0, g1, row); });
#else
  (void)w, (void)x, (void)M, (void)bias, (void)y;
  TORCH_CHECK(false, "w4_matmul_k_interleaved: path 3 needs AVX-512");
#endif
}

// Whether bfloat16 row m (K values) holds an infinity or a NaN (exponent bits all ones).
inline bool non_finite_bf16(const uint16_t* row, int64_t K) {
  bool bad = false;
  for (int64_t k = 0; k < K; ++k) bad |= (row[k] & 0x7f80) == 0x7f80;
  return bad;
}

}  // namespace w4v

// canonical int32 [K, N/8], scale [K/g, N], offset int32 [K/g, N/8]? -> k_interleaved uint8
// [ceil(N/64), K/g, B] (dlinfer/vendor/w4_layouts.py: scales as float16 where each is a float16
// value, else float32; zero points a byte each, 8 without offsets; zero past N).
at::Tensor w4_k_interleaved(const at::Tensor& qweight, const at::Tensor& scale_in, const std::optional<at::Tensor>& offset_in,
                            int64_t group_size) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kInt, "w4_k_interleaved: qweight int32 [K, N/8]");
  const at::Tensor q = qweight.contiguous();
  const int64_t K = q.size(0), N = q.size(1) * 8, tiles = w4v::num_tiles(N), g = group_size > 0 ? group_size : K;
  TORCH_CHECK(K % w4v::kBlockK == 0 && g % w4v::kBlockK == 0, "w4_k_interleaved: K and the group size must be multiples of 8, got K = ",
              K, ", g = ", g);
  TORCH_CHECK(scale_in.scalar_type() == at::kFloat || scale_in.scalar_type() == at::kBFloat16 || scale_in.scalar_type() == at::kHalf,
              "w4_k_interleaved: scale float32, bfloat16 or float16");
  const at::Tensor scale = scale_in.contiguous();
  const std::optional<at::Tensor> offset = offset_in.has_value() ? std::optional<at::Tensor>(offset_in->contiguous()) : std::nullopt;
  w4::check_common(scale, offset, K, g);
  TORCH_CHECK(scale.size(1) == N, "w4_k_interleaved: scale [K/g, N] with N = 8 x qweight's columns");
  const at::Tensor half = scale.to(at::kHalf);
  const at::Tensor s = scale.scalar_type() == at::kHalf || half.to(scale.scalar_type()).equal(scale) ? half : scale.to(at::kFloat);
  const int64_t sb = s.element_size(), G = K / g, B = w4v::block_bytes_of(g, sb), pb = w4v::param_bytes_of(sb);
  at::Tensor out = zeros_tensor({tiles, G, B}, q.options().dtype(at::kByte));
  const uint32_t* src = reinterpret_cast<const uint32_t*>(q.data_ptr<int32_t>());
  const uint8_t* sbytes = reinterpret_cast<const uint8_t*>(s.data_ptr());
  const uint32_t* zsrc = offset.has_value() ? reinterpret_cast<const uint32_t*>(offset->data_ptr<int32_t>()) : nullptr;
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t words = N / 8;
  at::parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t gi = 0; gi < G; ++gi) {
        uint8_t* blk = dst + (t * G + gi) * B;
        const int64_t c1 = std::min(N, w4v::kCols * (t + 1));
        for (int64_t c = w4v::kCols * t; c < c1; ++c) {
          const int64_t l = c - w4v::kCols * t;
          std::memcpy(blk + l * sb, sbytes + (gi * N + c) * sb, sb);
          blk[w4v::kCols * sb + l] = zsrc ? static_cast<uint8_t>((zsrc[gi * words + c / 8] >> (4 * w4::kNibbleOf[c % 8])) & 15u) : 8;
          for (int64_t k = gi * g; k < (gi + 1) * g; ++k) {
            const uint8_t v = (src[k * words + c / 8] >> (4 * w4::kNibbleOf[c % 8])) & 15u;
            uint8_t* byte = blk + pb + (((k - gi * g) / w4v::kBlockK) * w4v::kVecs + l / 16) * w4v::kLineBytes + 4 * (l % 16) + k % 4;
            *byte |= (k % 8 < 4) ? v : static_cast<uint8_t>(v << 4);
          }
        }
      }
  });
  return out;
}

namespace {
int64_t best_path(bool bf16_x, int64_t M, int64_t group_size) {
  // bfloat16 x on a CPU without AMX: path 3 at every M (docs/benchmarks.md; weight_quant.py's
  // layout_for makes the layout by the same rule); with AMX: one row on VNNI (measured faster than
  // a tile instruction's 4-row A at M = 1), more on AMX where the group fits its tiles
  if (bf16_x && !w4v::amx_here() && w4v::bf16_dot_here()) return w4v::kBf16;
  if (w4v::amx_here() && w4v::amx_chunk(group_size) > 0) return M == 1 ? w4v::kVnni : w4v::kAmx;
  return w4v::vnni_here() ? w4v::kVnni : w4v::kPortable;
}
}  // namespace

// x [M, K], qweight k_interleaved [ceil(N/64), K/g, B], scale [K/g, N] (x's dtype or float16),
// offset?, bias? -> [M, N] in x's dtype. The kernel reads the scales and zero points the blocks
// hold (the hook made them from these scale and offset, which are checked for shape only). path: -1
// the best this CPU runs with x at its own precision (`best_path`), or 0 portable, 1 VNNI, 2 AMX
// (the same bits), 3 bfloat16 x on AVX512-BF16 (its own bits), 4 x quantised to 8 bits per row and
// group on AVX-512 VNNI or AVX2, 5 x as 16-bit integers per row and group on AVX2 builds
// (quant_w4_a8.cpp; only when asked for); an error where the path cannot run.
at::Tensor w4_matmul_k_interleaved(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale_in,
                                   const std::optional<at::Tensor>& offset_in, const std::optional<at::Tensor>& bias,
                                   int64_t group_size, int64_t path) {
  TORCH_CHECK(qweight.dim() == 3 && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "w4_matmul_k_interleaved: qweight uint8 [ceil(N/64), K/g, B], contiguous");
  TORCH_CHECK(x.dim() == 2, "w4_matmul_k_interleaved: x [M, K]");
  const at::Tensor scale = scale_in.contiguous();
  const std::optional<at::Tensor> offset = offset_in.has_value() ? std::optional<at::Tensor>(offset_in->contiguous()) : std::nullopt;
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(1);
  w4::check_common(scale, offset, K, group_size);
  TORCH_CHECK(group_size % w4v::kBlockK == 0 && group_size <= w4v::kMaxGroup,
              "w4_matmul_k_interleaved: group size a multiple of 8, at most 1024");
  const int64_t B = qweight.size(2);
  const int64_t sb = w4v::scale_bytes_of(B, group_size);
  TORCH_CHECK(qweight.size(0) == w4v::num_tiles(N) && qweight.size(1) * group_size == K && sb != 0,
              "w4_matmul_k_interleaved: qweight [ceil(N/64), K/g, B] with B = ", w4v::block_bytes_of(group_size, 2), " or ",
              w4v::block_bytes_of(group_size, 4), " at g = ", group_size, ", got ", qweight.sizes());
  TORCH_CHECK(scale.scalar_type() == x.scalar_type() || scale.scalar_type() == at::kHalf,
              "w4_matmul_k_interleaved: scale in x's dtype or float16");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N), "w4_matmul_k_interleaved: bias [N]");
  TORCH_CHECK(path >= -1 && path <= w4v::kInt16, "w4_matmul_k_interleaved: path -1 (best), 0, 1, 2, 3, 4 or 5, got ",
              path);
  TORCH_CHECK(path != w4v::kVnni || w4v::vnni_here(), "w4_matmul_k_interleaved: path 1 (VNNI): this CPU (or this build) has no AVX-512 VNNI");
  TORCH_CHECK(path != w4v::kInt8 || w4v::int8_path_here(),
              "w4_matmul_k_interleaved: path 4 (8-bit activations): this CPU has no AVX-512 VNNI (nor is this an AVX2 build)");
  TORCH_CHECK(path != w4v::kInt16 || w4v::int16_path_here(),
              "w4_matmul_k_interleaved: path 5 (16-bit activations) runs on AVX2 builds only (this one: no AVX2, or "
              "AVX-512, where it is not written yet)");
  TORCH_CHECK(path != w4v::kAmx || (w4v::amx_here() && w4v::amx_chunk(group_size) > 0),
              "w4_matmul_k_interleaved: path 2 (AMX) cannot run here: it needs AMX-INT8 (with the tile state granted) "
              "and a group size g with g % 64 == 0 or g < 64, got g = ", group_size);
  const bool bf16_x = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(path != w4v::kBf16 || (bf16_x && w4v::bf16_dot_here()),
              "w4_matmul_k_interleaved: path 3 needs bfloat16 x (got ", x.scalar_type(), ") and a CPU with AVX512-BF16");
  at::Tensor bf;
  if (bias.has_value()) bf = bias->scalar_type() == at::kFloat ? bias->contiguous() : bias->to(at::kFloat).contiguous();
  w4::ResultRows y(x, M, N);
  if (M > 0 && N > 0) {
    const int64_t use = path != -1 ? path : best_path(bf16_x, M, group_size);
    const w4v::Layout w{qweight.data_ptr<uint8_t>(), K, N, group_size, K / group_size, sb, w4v::param_bytes_of(sb), B};
    const float* bias_ptr = bias.has_value() ? bf.data_ptr<float>() : nullptr;
    const auto run_path = [&](auto scale_type) {  // S: the scales' type inside the blocks
      using S = decltype(scale_type);
      if (use == w4v::kBf16) {
        const at::Tensor xc = x.contiguous();
        const uint16_t* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
        w4v::run_bf16<S>(w, xb, M, bias_ptr, y.data());
        // as the digit paths: a row with an infinity or a NaN gives NaN everywhere
        for (int64_t m = 0; m < M; ++m)
          if (w4v::non_finite_bf16(xb + m * K, K))
            std::fill(y.data() + m * N, y.data() + (m + 1) * N, std::numeric_limits<float>::quiet_NaN());
      } else {
        std::unique_ptr<float[]> x_own;
        at::Tensor x_keep;
        const float* xf = w4::float_rows(x, x_own, x_keep);
        if (use == w4v::kInt8) {
          w4v::run_int8<S>(w, xf, M, bias_ptr, y.data());
        } else if (use == w4v::kInt16) {
          w4v::run_int16<S>(w, xf, M, bias_ptr, y.data());
        } else {
          w4v::run_digits<S>(w, w4v::split_activations(xf, M, K, group_size), M, bias_ptr, y.data(), use);
        }
      }
    };
    if (sb == 2) {
      run_path(at::Half{});
    } else {
      run_path(float{});
    }
  }
  return y.result();
}

bool w4_vnni_available() { return w4v::vnni_here(); }
bool w4_int8_activations_available() { return w4v::int8_path_here(); }
bool w4_int16_activations_available() { return w4v::int16_path_here(); }
bool w4_amx_available() { return w4v::amx_here(); }
bool w4_bf16_dot_available() { return w4v::bf16_dot_here(); }

}  // namespace dlinfer_cpu
