// int8 x int8 -> int32, exact: out[m, n] = sum_k a[m, k] * b[n, k] (b is a weight [N, K]).
//
// At decode sizes this is a matrix-vector product bound by how fast b streams from memory (one
// byte per weight, a quarter of float32's), so the loop shape is linear.cpp's: each b row, once
// loaded, serves every row of a tile of up to kTile rows of a, with a software prefetch ahead in
// the stream. Three paths, chosen at run time (best_int8_path):
//  - VNNI: vpdpbusd multiplies 64 unsigned x signed byte pairs and adds them into 16 int32 lanes.
//    a is made unsigned by a + 128 (a ^ 0x80); the extra 128 * sum_k b[n, k] is accumulated
//    alongside (vpdpbusd of 0x80 bytes with the same b vector) and subtracted once per output.
//    vpdpbusd does not saturate (int32 adds wrap) and the subtraction wraps too, so the result is
//    exact modulo 2**32: exact whenever the true product fits int32.
//  - int16 (kInt16): bytes sign-extended to int16, vpmaddwd (pairs of int16 products, exact in
//    int32): 32 bytes a step on AVX-512BW and on an AVX2 build (whose CPUs have no VNNI: vpmaddubsw's
//    32 products need one operand unsigned and saturate int16 for -128 values, so it is not exact).
//    The AVX2 build widens a to int16 once a call and takes b's bytes as int16 by in-lane shifts,
//    two vpmaddwd a step (tile_avx2).
//  - portable C++ (any build): uint32 wrapping sums, the same exactness.
// From 3 rows of a past 32 KB (K > 32768 / M: the down projections at 1B and 8B shapes), the VNNI
// path walks K in chunks (few_rows_walk.h), so a's chunk stays in L1: at M = 8 and K = 8192 0.35 ->
// 0.66 of the read probe, 8B's down (K = 14336) at M = 4 0.52 -> 0.68 (Zen 5 VM, alternated in one
// process; docs/notes/cpu-ops.md, "x in L1: K in chunks").
// Large M reuses the same kernel over blocks of b rows small enough to stay in L2 while every tile
// of a passes over them.
#include "int8_gemm.h"
#include "few_rows_walk.h"

#include <ATen/ops/_int_mm.h>

#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace dlinfer_cpu {
namespace {

constexpr int kTile = kGemvRows;          // rows of a per pass over a block of b
constexpr int64_t kAlign = 64;            // a rows padded (with zeros) to a multiple of this
constexpr int64_t kBlockBytes = 48 * 1024;  // b rows per block: about this many bytes
constexpr int64_t kMinIntMmK = 16;        // at::_int_mm only from this K on (see int8_matmul_rows)
constexpr int64_t kPrefetch = 8192;       // bytes ahead in a b row: 1.3x the streaming rate of 1 KB (SmolLM2 W8A8, 1 thread, Zen 5); 16 KB no better

// Where value k of a row of a sits in the AVX2 build's int16 pair order (tile_avx2): in its block
// of 32, the even-indexed values first, then the odd ones.
inline int64_t pair_order(int64_t k) { return (k & ~int64_t{31}) + (k & 1) * 16 + ((k & 31) >> 1); }

template <int M>
void tile_portable(const int8_t* a, int64_t lda, const int8_t* b, int64_t K, int64_t n0, int64_t n1, int32_t* out,
                   int64_t ldo) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* br = b + n * K;
    for (int m = 0; m < M; ++m) {
      const int8_t* ar = a + m * lda;
      uint32_t s = 0;
      for (int64_t k = 0; k < K; ++k) s += static_cast<uint32_t>(static_cast<int32_t>(ar[k]) * br[k]);
      out[m * ldo + n] = static_cast<int32_t>(s);
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)

inline int32_t reduce_wrapping(__m512i v) {
  return static_cast<int32_t>(static_cast<uint32_t>(_mm512_reduce_add_epi32(v)));
}

template <int M>
void tile_avx512(const int8_t* a, int64_t lda, const int8_t* b, int64_t K, int64_t n0, int64_t n1, int32_t* out,
                 int64_t ldo) {
  const int64_t kv = K - K % 32;
  const __mmask32 tail = K > kv ? static_cast<__mmask32>((1ULL << (K - kv)) - 1) : 0;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* br = b + n * K;
    __m512i acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_si512();
    for (int64_t k = 0; k < kv; k += 32) {
      __builtin_prefetch(br + k + kPrefetch, 0, 1);
      const __m512i bv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(br + k)));
      for (int m = 0; m < M; ++m) {
        const __m512i av = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + m * lda + k)));
        acc[m] = _mm512_add_epi32(acc[m], _mm512_madd_epi16(av, bv));
      }
    }
    if (tail) {  // b's tail masked to zero; a is padded, so its full load stays inside the buffer
      const __m512i bv = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(tail, br + kv));
      for (int m = 0; m < M; ++m) {
        const __m512i av = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + m * lda + kv)));
        acc[m] = _mm512_add_epi32(acc[m], _mm512_madd_epi16(av, bv));
      }
    }
    for (int m = 0; m < M; ++m) out[m * ldo + n] = reduce_wrapping(acc[m]);
  }
}

// a holds a ^ 0x80 (a + 128 as unsigned bytes). R b rows at a time, walked by few_rows_walk.h:
// whole rows, one or (`rows_side_by_side`: several weight streams set, Intel's default) R parts of
// the band side by side, or from 3 rows of a past 32 KB (Chunked) K in kSegmentBytes chunks with
// the M sums and the correction (acc[M]) of each b row parked between chunks. Integer sums: the
// same values in any order. Two adjacent b rows at a time streamed SmolLM2's weights 1.5-3x slower
// (Zen 5, one thread, M = 1 and 8), so the chunked walk and CPUs with one stream keep one row.
// GCC copies each sum to another register and back around every vpdpbusd here (it does not for
// vdpbf16ps); an asm vpdpbusd without the copies read the same (docs/notes/cpu-ops.md, "One VNNI
// walk"), so the intrinsic stays.
template <int M, int R, bool Chunked>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni(const int8_t* a, int64_t lda, const int8_t* b,
                                                                      int64_t K, int64_t n0, int64_t n1, int32_t* out,
                                                                      int64_t ldo) {
  constexpr int S = M + 1;  // sums a b row: M rows of a and the correction
  const int64_t kv = K - K % 64;
  const __mmask64 tail = K > kv ? static_cast<__mmask64>(~0ULL >> (64 - (K - kv))) : 0;
  const __m512i off = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t kc = Chunked ? walk_chunk(M, K, kv, 1, 64) : kv;
  const int64_t nr = n0 + (n1 - n0) / R * R;
  walk_rows<S, R, Chunked, __m512i>(
      b, K, kv, kc, kPrefetch, n0, nr,
      [&](__m512i* parked, int64_t n, int64_t gap, int64_t k0, int64_t k1, const int8_t* pf, bool first, bool last)
          __attribute__((target("avx512f,avx512bw,avx512vnni"))) {
            __m512i acc[R * S];  // acc[r * S + M]: b row r's correction sums
            for (int j = 0; j < R * S; ++j) acc[j] = first ? _mm512_setzero_si512() : parked[j];
            const int8_t* br = b + n * K;
            for (int64_t k = k0; k < k1; k += 64) {
              __m512i bv[R];
              for (int r = 0; r < R; ++r) {
                __builtin_prefetch(pf + r * gap * K + k, 0, 1);
                bv[r] = _mm512_loadu_si512(br + r * gap * K + k);
                acc[r * S + M] = _mm512_dpbusd_epi32(acc[r * S + M], off, bv[r]);
              }
              for (int m = 0; m < M; ++m) {
                const __m512i av = _mm512_loadu_si512(a + m * lda + k);
                for (int r = 0; r < R; ++r) acc[r * S + m] = _mm512_dpbusd_epi32(acc[r * S + m], av, bv[r]);
              }
            }
            if (!last) {
              for (int j = 0; j < R * S; ++j) parked[j] = acc[j];
              return;
            }
            for (int r = 0; r < R; ++r) {
              __m512i* ar = acc + r * S;
              if (tail) {  // b's tail masked to zero; a is padded, so its full load stays inside the buffer
                const __m512i bv = _mm512_maskz_loadu_epi8(tail, br + r * gap * K + kv);
                ar[M] = _mm512_dpbusd_epi32(ar[M], off, bv);
                for (int m = 0; m < M; ++m) ar[m] = _mm512_dpbusd_epi32(ar[m], _mm512_loadu_si512(a + m * lda + kv), bv);
              }
              // sum(acc) - sum(corr) as one reduction of acc - corr: the same value, lane sums wrap alike
              for (int m = 0; m < M; ++m) out[m * ldo + n + r * gap] = reduce_wrapping(_mm512_sub_epi32(ar[m], ar[M]));
            }
          });
  if constexpr (R > 1) {
    if (nr < n1) tile_vnni<M, 1, Chunked>(a, lda, b, K, nr, n1, out, ldo);
  }
}

// The VNNI tile: the chunked walk from 3 rows of a past 32 KB, else whole rows, R of them side by
// side (rows_side_by_side: up to 4 rows of a, one b row at a time otherwise).
template <int M>
void tile_vnni_walk(const int8_t* a, int64_t lda, const int8_t* b, int64_t K, int64_t n0, int64_t n1, int32_t* out,
                    int64_t ldo) {
  if (M >= 3 && two_weight_rows(M, K, 1)) {
    tile_vnni<M, 1, true>(a, lda, b, K, n0, n1, out, ldo);
    return;
  }
  if constexpr (M <= 4) {
    switch (two_weight_rows(M, K, 1) ? 1 : rows_side_by_side(M)) {
      case 4: tile_vnni<M, 4, false>(a, lda, b, K, n0, n1, out, ldo); return;
      case 2: tile_vnni<M, 2, false>(a, lda, b, K, n0, n1, out, ldo); return;
      default: break;
    }
  }
  tile_vnni<M, 1, false>(a, lda, b, K, n0, n1, out, ldo);
}

#elif defined(CPU_CAPABILITY_AVX2)

// The AVX2 build's int16 path: vpmaddwd on int16 values, int32 adds (wrapping, as the other
// paths). a comes widened to int16 and in pair order (int8_gemm does it once a call, wide_a):
// each block of 32 values of a row stored as its 16 even-indexed values, then its 16 odd ones. A
// step loads 32 bytes of b and takes its odd bytes as int16 by an arithmetic shift of each 16-bit
// lane right by 8, its even ones by a shift left by 8 first: both in-lane shifts, where
// sign-extending 16 bytes (vpmovsxbw, which crosses the 128-bit lanes) cost as much as the
// multiplies, and sign-extending a's rows again for every row of b doubled that. On the family-23
// EPYC (Zen 1) the sign extension was the bound. 64 bytes of b a step with one prefetch; K's tail
// past a multiple of 32 in scalar uint32 sums.
//
// R rows of b at a time (rows_avx2), 32 bytes of each in turn, walked by few_rows_walk.h's
// walk_rows. Up to kPairRows rows of a, a thread's band of b is walked as two halves side by side
// (R = 2: on AVX2 builds walk_rows puts the pair's rows half the band apart, kPairsApart), as
// linear.cpp's AVX2 walk reads its float rows: two streams a thread; an odd band's last row goes
// alone. On the 2-core Zen 3 EPYC, alternated in one process against one row at a time, the step's
// int8 linears at the 1B shapes read 0.83 -> 1.07 of the read probe at one row, 0.80 -> 0.90 at
// two, 0.83 -> 1.00 at three, the int8 LM head (128256 x 2048) 0.74 -> 1.00; at four rows 0.80 ->
// 0.72 (2 x 4 accumulators and the two rows' decoded halves crowd AVX2's 16 registers), so four
// rows and more keep one row at a time (docs/notes/cpu-ops.md, "W8A8 on AVX2: two rows of b far
// apart"). Each output's sum is the same in either walk (its own row's steps in the same order).
constexpr int kPairRows = 3;

// Rows n, n + gap, .., n + (R - 1) gap of b over K: 64 bytes a step over [k0, k1) (k1 = K's
// multiple of 64), prefetching pf + r * gap * K + k for row r, then K's 32-byte and scalar tails;
// writes out[m * ldo + n + r * gap].
template <int M, int R>
inline void rows_avx2(const int16_t* a, int64_t lda, const int8_t* b, int64_t K, int64_t n, int64_t gap, int64_t k0,
                      int64_t k1, const int8_t* pf, int32_t* out, int64_t ldo) {
  const int64_t kv = K - K % 32;
  __m256i acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_si256();
  auto step = [&](int r, int64_t k) __attribute__((always_inline)) {
    const __m256i bv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (n + r * gap) * K + k));
    const __m256i odd = _mm256_srai_epi16(bv, 8), even = _mm256_srai_epi16(_mm256_slli_epi16(bv, 8), 8);
    for (int m = 0; m < M; ++m) {
      const int16_t* ar = a + m * lda + k;
      const __m256i pe = _mm256_madd_epi16(even, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ar)));
      const __m256i po = _mm256_madd_epi16(odd, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ar + 16)));
      acc[r][m] = _mm256_add_epi32(acc[r][m], _mm256_add_epi32(pe, po));
    }
  };
  for (int64_t k = k0; k < k1; k += 64) {
    for (int r = 0; r < R; ++r) __builtin_prefetch(pf + r * gap * K + k, 0, 1);
    for (int r = 0; r < R; ++r) step(r, k);
    for (int r = 0; r < R; ++r) step(r, k + 32);
  }
  if (kv > k1)
    for (int r = 0; r < R; ++r) step(r, k1);
  for (int r = 0; r < R; ++r) {
    const int8_t* br = b + (n + r * gap) * K;
    for (int m = 0; m < M; ++m) {
      alignas(32) uint32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[r][m]);
      uint32_t s = 0;
      for (int l = 0; l < 8; ++l) s += lanes[l];
      for (int64_t k = kv; k < K; ++k)
        s += static_cast<uint32_t>(static_cast<int32_t>(a[m * lda + pair_order(k)]) * br[k]);
      out[m * ldo + n + r * gap] = static_cast<int32_t>(s);
    }
  }
}

// Rows [n0, n1) of b, R at a time ((n1 - n0) a multiple of R), unchunked.
template <int M, int R>
void walk_avx2(const int16_t* a, int64_t lda, const int8_t* b, int64_t K, int64_t n0, int64_t n1, int32_t* out,
               int64_t ldo) {
  const int64_t k64 = K - K % 64;
  walk_rows<M, R, false, __m256i>(
      b, K, k64, k64, kPrefetch, n0, n1,
      [&](__m256i*, int64_t n, int64_t gap, int64_t k0, int64_t k1, const int8_t* pf, bool, bool) {
        rows_avx2<M, R>(a, lda, b, K, n, gap, k0, k1, pf, out, ldo);
      });
}

template <int M>
void tile_avx2(const int8_t* a_packed, int64_t lda, const int8_t* b, int64_t K, int64_t n0, int64_t n1, int32_t* out,
               int64_t ldo) {
  const int16_t* a = reinterpret_cast<const int16_t*>(a_packed);  // lda int16 a row, in pair order
  int64_t n = n0;  // the rows from n on go one at a time
  if constexpr (M <= kPairRows) {
    n = n0 + (n1 - n0) / 2 * 2;
    walk_avx2<M, 2>(a, lda, b, K, n0, n, out, ldo);
  }
  walk_avx2<M, 1>(a, lda, b, K, n, n1, out, ldo);
}
#endif

// Whether `path` takes a widened to int16 in pair order (the AVX2 build's int16 path, tile_avx2)
// rather than as bytes.
#if defined(CPU_CAPABILITY_AVX2)
constexpr bool wide_a(int path) { return path == kInt16; }
#else
constexpr bool wide_a(int) { return false; }
#endif

// a: the packed rows of a, lda elements apart (int16 ones where wide_a(path), else bytes).
using TileFn = void (*)(const int8_t*, int64_t, const int8_t*, int64_t, int64_t, int64_t, int32_t*, int64_t);

template <template <int> class Kernel>
TileFn pick(int rows) {
  switch (rows) {
    case 1: return Kernel<1>::fn;
    case 2: return Kernel<2>::fn;
    case 3: return Kernel<3>::fn;
    case 4: return Kernel<4>::fn;
    case 5: return Kernel<5>::fn;
    case 6: return Kernel<6>::fn;
    case 7: return Kernel<7>::fn;
    default: return Kernel<8>::fn;
  }
}

template <int M>
struct Portable {
  static constexpr TileFn fn = &tile_portable<M>;
};
#if defined(CPU_CAPABILITY_AVX512)
template <int M>
struct Int16 {
  static constexpr TileFn fn = &tile_avx512<M>;
};
template <int M>
struct Vnni {
  static constexpr TileFn fn = &tile_vnni_walk<M>;
};
#elif defined(CPU_CAPABILITY_AVX2)
template <int M>
struct Int16 {
  static constexpr TileFn fn = &tile_avx2<M>;
};
#endif

TileFn tile_for(int path, int rows) {
#if defined(CPU_CAPABILITY_AVX512)
  if (path == kVnni) return pick<Vnni>(rows);
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (path == kInt16) return pick<Int16>(rows);
#endif
  return pick<Portable>(rows);
}

}  // namespace

int best_int8_path() {
#if defined(CPU_CAPABILITY_AVX512)
  static const int best = __builtin_cpu_supports("avx512vnni") ? kVnni : kInt16;
  return best;
#elif defined(CPU_CAPABILITY_AVX2)
  return kInt16;
#else
  return kPortable;
#endif
}

bool int8_path_available(int path) {
  return path >= kPortable && path <= best_int8_path();
}

void int8_gemm(const int8_t* const* a_rows, int64_t M, const int8_t* b, int64_t N, int64_t K, int32_t* out,
               int64_t ldo, int path) {
  if (M == 0 || N == 0) return;
  TORCH_CHECK(int8_path_available(path), "int8_gemm: path ", path, " cannot run on this CPU / build");
  // a packed: rows of lda elements (zero padding); a ^ 0x80 for VNNI, int16 where wide_a(path)
  const int64_t lda = (K + kAlign - 1) / kAlign * kAlign;
  const bool wide = wide_a(path);
  std::vector<int8_t> bytes(wide ? 0 : static_cast<size_t>(M * lda), 0);
  std::vector<int16_t> words(wide ? static_cast<size_t>(M * lda) : 0, 0);
  const int8_t flip = path == kVnni ? static_cast<int8_t>(0x80) : 0;
  for (int64_t m = 0; m < M; ++m) {
    if (wide) {
      for (int64_t k = 0; k < K; ++k) words[m * lda + pair_order(k)] = a_rows[m][k];
    } else {
      for (int64_t k = 0; k < K; ++k) bytes[m * lda + k] = static_cast<int8_t>(a_rows[m][k] ^ flip);
    }
  }
  // row m0 of packed a, as the tile functions take it
  auto rows_from = [&](int64_t m0) {
    return wide ? reinterpret_cast<const int8_t*>(words.data() + m0 * lda) : bytes.data() + m0 * lda;
  };
  if (K == 0) {
    for (int64_t m = 0; m < M; ++m) std::fill(out + m * ldo, out + m * ldo + N, 0);
    return;
  }
  const int64_t block = M <= kTile ? 1 : std::max<int64_t>(1, kBlockBytes / K);  // b rows per block
  const int64_t blocks = (N + block - 1) / block;
  auto run = [&](int64_t begin, int64_t end) {
    // at M <= kTile: one contiguous band of b per thread, walked once
    const int64_t n_begin = begin * block, n_end = std::min(N, end * block);
    const int64_t step = M <= kTile ? n_end - n_begin : block;
    for (int64_t n0 = n_begin; n0 < n_end; n0 += step) {
      const int64_t n1 = std::min(n_end, n0 + step);
      for (int64_t m0 = 0; m0 < M; m0 += kTile) {
        const int rows = static_cast<int>(std::min<int64_t>(kTile, M - m0));
        tile_for(path, rows)(rows_from(m0), lda, b, K, n0, n1, out + m0 * ldo, ldo);
      }
    }
  };
  at::parallel_for(0, blocks, grain_for(blocks, N * K * std::max<int64_t>(1, (M + kTile - 1) / kTile)), run);
}

at::Tensor int8_matmul_rows(const int8_t* const* a_rows, int64_t M, const at::Tensor& b) {
  const int64_t N = b.size(0), K = b.size(1);
  // torch 2.13's CPU _int_mm returns garbage at K = 1 (N > 1; found by tests/vendor/test_cpu_w8a8.py,
  // every K in 2..139 and the model sizes checked exact): small K stays on int8_gemm, where it is cheap.
  // And only on CPUs with VNNI: without it torch 2.13 runs _int_mm as a plain loop (the 2-core Zen 3
  // EPYC, AVX2: 20 x 2048 @ 2048 x 2048 in 43.7 ms against 2.3 ms here, 64 rows 132.9 against 8.3;
  // docs/notes/cpu-ops.md, "W8A8 prefill without VNNI"), so there every M stays on int8_gemm.
  if (M > kGemvRows && N > 0 && K >= kMinIntMmK && best_int8_path() == kVnni) {
    at::Tensor a = empty_tensor({M, K}, b.options());
    for (int64_t m = 0; m < M; ++m) std::memcpy(a.data_ptr<int8_t>() + m * K, a_rows[m], K);
    return at::_int_mm(a, b.t());
  }
  at::Tensor out = empty_tensor({M, N}, b.options().dtype(at::kInt));
  int8_gemm(a_rows, M, b.data_ptr<int8_t>(), N, K, out.data_ptr<int32_t>(), N, best_int8_path());
  return out;
}

}  // namespace dlinfer_cpu
