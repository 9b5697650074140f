// The order in which the few-row linears (linear.cpp, linear_16bit.cpp) read a thread's band of
// weight rows, shared by their float32, 16-bit and vdpbf16ps loops, and by the int8 GEMV's VNNI path
// (int8_gemm.cpp: R weight rows side by side at up to 4 rows of a, else one at a time; chunked
// from 3 rows of a past 32 KB) and its AVX2 int16 path (unchunked: two rows far apart at up to 3
// rows of a, else one at a time).
//
// Every weight vector is used for all M rows of x, so x's M rows are read once per weight vector.
//  - While they fit in L1 (M x K x element size <= kOneRowXBytes) the band is walked one weight
//    row at a time, front to back, one stream a thread, or, where the CPU reads more from several
//    streams (`weight_streams`: Intel's), as that many parts of the band side by side, each front to
//    back, one row of each at a time (at most two parts from five rows of x on: rows_side_by_side).
//  - Past that (and on AVX2 builds at up to 4 rows of x: two_chains), two weight rows at a time
//    (each x vector then loaded once for two of them; unchunked, on AVX2 builds or with several
//    weight streams set, two rows half the band apart: kPairsApart), and from three rows of x on (x
//    past kOneRowXBytes), K is also cut into chunks of kSegmentBytes of each x row (as many elements
//    of each weight row) and the band into blocks of kBlockRows rows: for each block, chunk by
//    chunk, every row pair's segment is walked with its accumulators in registers, parked in a small
//    buffer between chunks. x's chunk (M x 2 KB at most) stays in L1 instead of being reloaded from
//    L2 for every weight vector.
//    "x" is x as the loop reads it: the 16-bit kernel's portable path reads it widened to float32
//    at up to 4 rows.
// Each output's float32 lanes add their products in the same order over k in every walk, so the
// sums are bit-identical whichever is taken. The software prefetch runs `ahead` elements ahead in
// the walking order: along the row in the unchunked walks (and on into the next rows), a few
// segments later in the chunked walk (the same offset in a later row pair, the next chunk or the
// next block). Measured on the Zen 5 VM (docs/notes/cpu-ops.md, "x in L1: K in chunks"): at M = 8
// the chunked walk read 1.1-2x what two rows at a time did in all but one shape (float32 0.64-0.81
// of the read probe against 0.32-0.69); at M = 4, -0.07 to +0.14 of the probe at ~50 GB/s and
// 1.1-1.6x at ~80; at M <= 2 chunks lose (0.73 against 0.86 at K = 8192), so they are not taken.
#pragma once

#include "common.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace dlinfer_cpu {

constexpr int64_t kOneRowXBytes = 32 * 1024;  // x's M rows at most this: the one-row walk
constexpr int64_t kSegmentBytes = 2 * 1024;   // a chunk: this many bytes of each x row
constexpr int kBlockRows = 32;                // rows whose accumulators are parked between chunks

// Two weight rows at a time once x's M rows no longer fit in kOneRowXBytes (element_bytes: x's).
inline bool two_weight_rows(int64_t M, int64_t K, int64_t element_bytes) {
  return M * K * element_bytes > kOneRowXBytes;
}

// On AVX2 builds also at up to kChainRows rows of x, whatever K. With 8 float32 lanes a vector,
// one weight row at a time leaves each output one chain of dependent FMAs, one FMA a weight vector
// (8 elements: 16 bytes of a 16-bit weight), which bounds the loop at the FMA's latency whatever M
// is: on the Zen 3 EPYC, one thread with the weight in L2 (1024 x 128), one row of x, bfloat16 read
// 8.0-8.6 GB/s (and as much at two rows) and float32 17-18, against 15-20 and 40-42 with two
// weight rows (two chains a row of x). The pair is two rows far apart (kPairsApart: the band's two
// halves, two long sequential streams): adjacent rows, one short pair after another, lost on short
// rows (SmolLM2's K = 576 and 1536: 0.85-0.98x one row at a time) where the far pair gained. From
// memory (2 threads, the walks alternated in one process), a decode step's linears, far pair / one
// row at a time: SmolLM2 bfloat16 1.07-1.24x at one row of x, 1.13 at four; float32 1.10-1.15,
// 1.26; the 1B shapes bfloat16 1.20-1.29, 1.14; float32 1.09-1.18, 1.12 (docs/notes/cpu-ops.md,
// "Two FMA chains on AVX2"). Up to four rows: 2 x M sums, with the two weight vectors and x's, fit
// AVX2's 16 registers. The sums' bits do not depend on the walk, so neither do the outputs'.
// AVX-512 builds (16 lanes, and vdpbf16ps's 32 elements an instruction) need no second chain: they
// walk as many rows as `weight_streams` says (one on the Zen 5 VM: there one weight row at a time
// read 0.85-0.98 of the probe against two adjacent rows' 0.75-0.82, docs/notes/cpu-ops.md, "One
// weight row at a time"; far parts were not measured there), and adjacent pairs where x is past
// kOneRowXBytes (far ones where several streams are set).
#if defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kChainRows = 4;
constexpr bool kPairsApart = true;
#else
constexpr int64_t kChainRows = 0;  // never (the walks run M >= 1)
constexpr bool kPairsApart = false;
#endif
inline bool two_chains(int64_t M) { return M <= kChainRows; }

// Weight streams a thread reads side by side while x fits in L1: its band cut into that many
// parts (1, 2 or 4), one row of each at a time. A process-wide setting, read at every call
// (few_rows_walk.cpp): the CPU's default (`default_weight_streams`) unless `set_weight_streams`
// (DLINFER_CPU_WEIGHT_STREAMS, read by the vendor when it loads the kernels) says otherwise.
// Why: on the Intel Xeon VM (a Sapphire Rapids class core) one sequential stream a thread read at
// most ~10 GB/s a core however far ahead it was prefetched, while four streams a thread and a 4 KB
// prefetch read 1.6x that (the read probe: 19-20 against 31-33 GB/s on 2 threads); the float32 and
// bfloat16 kernels at one row of x went from 0.64-0.73 of the probe to 0.89-0.99 with four parts
// (docs/notes/cpu-ops.md, "Four streams a thread on the Xeon"). On the Zen 5 VM one stream a thread
// read 0.85-0.98 of the probe (above), so AMD CPUs keep one, and so do AVX2 builds on any CPU
// (few_rows_walk.cpp: their registers, and no AVX2-only Intel CPU measured).
int64_t weight_streams();
int64_t default_weight_streams();
void set_weight_streams(int64_t streams);  // 0: the default; else 1, 2 or 4

// How many rows walk side by side (R) in the unchunked walk while x fits in L1: the setting, at
// most 2 from 5 rows of x on (R x M sums must stay in registers beside the weight vectors), and at
// least 2 at up to kChainRows rows on AVX2 builds (two_chains).
inline int64_t rows_side_by_side(int64_t M) {
  int64_t r = weight_streams();
  if (M > 4) r = std::min<int64_t>(r, 2);
  if (two_chains(M)) r = std::max<int64_t>(r, 2);
  return r;
}

// Elements of K a chunk holds: all of them (kv, the full-step part of K) while x fits in
// kOneRowXBytes or M <= 2, else kSegmentBytes of an x row (whole steps, at least one);
// element_bytes: x's.
// `step`: the elements one vector step of the kernel's loop takes.
inline int64_t walk_chunk(int64_t M, int64_t K, int64_t kv, int64_t element_bytes, int64_t step) {
  if (M <= 2 || M * K * element_bytes <= kOneRowXBytes) return std::max<int64_t>(kv, 1);
  return std::max<int64_t>(step, kSegmentBytes / element_bytes / step * step);
}

// Walks rows [n0, n1) of w ([N, K] dense, element type T) for M rows of x, R weight rows at a
// time ((n1 - n0) a multiple of R), K in chunks of kc elements when Chunked (kc < kv), by calls of
//   step(parked, n, gap, k0, k1, pf, first, last): weight rows n, n + gap, .., n + (R - 1) gap over
//     elements [k0, k1) (a whole number of steps), prefetching pf + r * gap * K + k for each row r
//     and step k. The R x M sums (acc[r * M + m]) start at zero when `first`, else from
//     parked[R * M]; when `last` the K tail (elements kv..K) is added and output rows n + r gap
//     written, else the sums go to parked.
// gap is 1 (adjacent rows) except in the unchunked walk with R > 1 on builds with kPairsApart or
// with several weight streams set, where it is (n1 - n0) / R: the band's R parts walked side by
// side, each front to back.
// The sums live in the step's locals (registers): unchunked, `first` and `last` are both true and
// they never touch memory (a sums array shared between several lambdas went through the stack for
// every row: 5% at SmolLM2's K = 576). always_inline: the kernels' steps may carry a target
// attribute (the vdpbf16ps one does) and GCC inlines a callee only into a caller with at least its
// target; walk_rows inlined into the kernel lets the step inline in turn. The two walks are
// instantiated apart (Chunked), so the unchunked one, most calls, has the registers to itself
// (together, GCC kept x's row pointers in vector registers: 10% at K = 576, M = 8).
// Precondition: (n1 - n0) % R == 0 (the kernels walk the remainder row with R = 1).
template <int M, int R, bool Chunked, typename Acc, typename T, typename Step>
__attribute__((always_inline)) inline void walk_rows(const T* w, int64_t K, int64_t kv, int64_t kc, int64_t ahead,
                                                     int64_t n0, int64_t n1, Step&& step) {
  if (!Chunked && R > 1 && (kPairsApart || weight_streams() > 1)) {  // the band's R parts side by side
    const int64_t gap = (n1 - n0) / R;
    for (int64_t n = n0; n < n0 + gap; ++n)
      step(static_cast<Acc*>(nullptr), n, gap, 0, kv, w + n * K + ahead, true, true);
  } else if constexpr (!Chunked) {  // one chunk: row after row, the prefetch running on into the next rows
    for (int64_t n = n0; n < n1; n += R) step(static_cast<Acc*>(nullptr), n, 1, 0, kv, w + n * K + ahead, true, true);
  } else {
    constexpr int64_t kGroups = kBlockRows / R;
    const int64_t chunks = (kv + kc - 1) / kc;
    const int64_t later = std::max<int64_t>(1, (ahead + R * kc - 1) / (R * kc));  // segments ahead
    Acc parked[kGroups][R * M];
    for (int64_t b = n0; b < n1; b += kBlockRows) {
      const int64_t groups = std::min<int64_t>(kBlockRows, n1 - b) / R;
      const int64_t next_groups = std::min<int64_t>(kBlockRows, std::max<int64_t>(n1 - b - groups * R, 0)) / R;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t k0 = c * kc, k1 = std::min(k0 + kc, kv);
        for (int64_t i = 0; i < groups; ++i) {
          // the segment `later` steps on in the walking order: (chunk, group) in this block, else
          // one of the next block's first chunks (the chunk index clamped to the last); the
          // prefetch address is that segment's start minus k0. Speed only: a prefetch never faults.
          int64_t s = c * groups + i + later, pn, pc;
          if (s < chunks * groups) {
            pn = b + (s % groups) * R, pc = s / groups;
          } else if (next_groups > 0) {
            s -= chunks * groups;
            pn = b + groups * R + (s % next_groups) * R, pc = std::min<int64_t>(s / next_groups, chunks - 1);
          } else {
            pn = b + i * R, pc = c;  // the band's last segments: nothing left to fetch ahead
          }
          step(parked[i], b + i * R, 1, k0, k1, w + pn * K + pc * kc - k0, c == 0, k1 == kv);
        }
      }
    }
  }
}

// Splits rows [0, N) of a [N, K] weight into one band per thread (all of them on the calling
// thread below kMinParallelBytes) and calls walk(b, e, kc, R, Chunked) for each band [b, e): R
// (1, 2 or 4) and Chunked as std::integral_constant, chosen by x's size (two_weight_rows,
// walk_chunk) and, while x fits in L1, by rows_side_by_side; `step`: the elements one vector step of
// the kernel's loop takes. element_bytes: the weight's; x_bytes: x's as the loop reads it, when
// not the weight's (the 16-bit kernel's portable path reads x widened to float32 at up to 4 rows).
template <int M, typename Walk>
inline void walk_bands(int64_t N, int64_t K, int64_t element_bytes, int64_t step, Walk&& walk,
                       int64_t x_bytes = 0) {
  if (x_bytes == 0) x_bytes = element_bytes;
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max(grain_for(N, N * K * element_bytes), (N + threads - 1) / threads);
  const int64_t kv = K - K % step;
  const int64_t kc = walk_chunk(M, K, kv, x_bytes, step);
  const bool past_l1 = two_weight_rows(M, K, x_bytes);
  const int64_t side = past_l1 ? 2 : rows_side_by_side(M);
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  using Four = std::integral_constant<int, 4>;
  at::parallel_for(0, N, grain, [&](int64_t b, int64_t e) {
    if (side == 1) {
      walk(b, e, kc, One{}, std::false_type{});
    } else if (side == 4 && M <= 4) {  // (rows_side_by_side gives 4 only at M <= 4)
      if constexpr (M <= 4) walk(b, e, kc, Four{}, std::false_type{});
    } else if (kc >= kv) {
      walk(b, e, kc, Two{}, std::false_type{});
    } else {
      walk(b, e, kc, Two{}, std::true_type{});
    }
  });
}

}  // namespace dlinfer_cpu
