// The few-row linears' portable loop (ATen's vectors): float32 (linear.cpp) and bfloat16 /
// float16 (linear_16bit.cpp), each weight vector widened to float32 in registers (a plain load
// for float32), fmadd into float32 sums, walked in few_rows_walk.h's order. The loops over rows
// are unrolled by pragma so that GCC keeps the accumulators in registers: without, it kept the
// array in memory at some (M, R) and stored every accumulator on each step of k (the float32
// kernel at 7-8 rows, the 16-bit one at 4 rows, on an AVX2 build).
#pragma once

#include "common.h"
#include "few_rows_walk.h"

namespace dlinfer_cpu {

constexpr int64_t kFewRowsPrefetchBytes = 16 * 1024;  // ahead in the weight stream, in walking order

// bias[n] as float32: a bias in the activation dtype or in float32, or none.
struct Bias {
  const void* data = nullptr;
  bool f32 = false;
  template <typename T>
  inline float add(float s, int64_t n) const {
    if (!data) return s;
    return s + (f32 ? static_cast<const float*>(data)[n] : static_cast<float>(static_cast<const T*>(data)[n]));
  }
};

// x in T, or already widened to float32 (X = float: the 16-bit kernel widens x once per call,
// rather than once per use in every row's loop).
template <typename T, int M, int R, bool Chunked, typename X = T>
void walk_portable(const X* x, int64_t ldx, const T* w, Bias bias, T* y, int64_t n0, int64_t n1, int64_t K,
                   int64_t N, int64_t kc) {
  const int64_t kv = K - K % kLanes;
  const int64_t nr = n0 + (n1 - n0) / R * R;
  walk_rows<M, R, Chunked, Vec>(
      w, K, kv, kc, kFewRowsPrefetchBytes / static_cast<int64_t>(sizeof(T)), n0, nr,
      [&](Vec* parked, int64_t n, int64_t gap, int64_t k0, int64_t k1, const T* pf, bool first, bool last) {
        Vec acc[R * M];
#pragma GCC unroll 16
        for (int j = 0; j < R * M; ++j) acc[j] = first ? Vec(0.f) : parked[j];
        const T* wr = w + n * K;
        for (int64_t k = k0; k < k1; k += kLanes) {
          Vec wv[R];
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            __builtin_prefetch(pf + r * gap * K + k, 0, 1);
            wv[r] = load_vec(wr + r * gap * K + k);
          }
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) {
            const Vec xv = load_vec(x + m * ldx + k);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) acc[r * M + m] = at::vec::fmadd(wv[r], xv, acc[r * M + m]);
          }
        }
        if (!last) {
#pragma GCC unroll 16
          for (int j = 0; j < R * M; ++j) parked[j] = acc[j];
          return;
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const Vec wt = kv < K ? load_part(wr + r * gap * K + kv, K - kv) : Vec(0.f);
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) {
            Vec& a = acc[r * M + m];
            if (kv < K) a = at::vec::fmadd(wt, load_part(x + m * ldx + kv, K - kv), a);
            const float s = at::vec::vec_reduce_all<float>([](Vec& u, Vec& v) { return u + v; }, a);
            y[m * N + n + r * gap] = static_cast<T>(bias.add<T>(s, n + r * gap));
          }
        }
      });
  if constexpr (R > 1) {
    if (nr < n1) walk_portable<T, M, 1, Chunked, X>(x, ldx, w, bias, y, nr, n1, K, N, kc);
  }
}

}  // namespace dlinfer_cpu
