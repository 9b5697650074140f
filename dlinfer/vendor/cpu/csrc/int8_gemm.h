// The int8 x int8 -> int32 product of the W8A8 ops (int8_gemm.cpp), and the per-row int8
// quantisation they share.
#pragma once

#include "common.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace dlinfer_cpu {

// The int8 dot-product paths, best last. kVnni: AVX-512 VNNI (vpdpbusd, 64 products per
// instruction); kInt16: sign-extend to int16, vpmaddwd (AVX-512BW, or AVX2 on an AVX2 build);
// kPortable: plain C++.
enum Int8Path : int { kPortable = 0, kInt16 = 1, kVnni = 2 };

// The best path this build and this CPU can run (the build's ISA, then the CPU's VNNI flag).
int best_int8_path();

// True when `path` can run here.
bool int8_path_available(int path);

// out[m * ldo + n] = sum_k a_rows[m][k] * b[n * K + k], exact (wrapping int32 arithmetic: exact
// whenever the result fits int32, i.e. always for K <= 131071). a_rows: M row pointers of K int8
// (the MoE passes gathered tokens); b: [N, K] int8 contiguous. Parallel over b's rows.
void int8_gemm(const int8_t* const* a_rows, int64_t M, const int8_t* b, int64_t N, int64_t K, int32_t* out,
               int64_t ldo, int path);

// The product the ops use: at most kGemvRows rows of a, int8_gemm on the best path (a weight
// stream); more, on CPUs with VNNI, ATen's at::_int_mm (oneDNN's int8 GEMM, exact int32, faster
// from ~12 rows on as measured on Zen 5; the rows are gathered into one tensor first; not at K <
// 16), elsewhere int8_gemm's blocks (torch's _int_mm is a plain loop there; see the .cpp).
// Returns [M, N] int32.
constexpr int64_t kGemvRows = 8;
at::Tensor int8_matmul_rows(const int8_t* const* a_rows, int64_t M, const at::Tensor& b);

// Per-row symmetric int8 quantisation of n float32 values (dynamic_quant's rule):
// scale = amax|x| / 127, q = clamp(round_half_even(x / (scale ? scale : 1)), -128, 127); a row holding a NaN:
// scale NaN, q = 0 (the next linear_w8a8 row is NaN, as the torch vendor's). Returns scale.
inline float quantize_row(const float* x, int8_t* q, int64_t n) {
  Vec vmax(0.f);
  float amax = 0.f;
  bool nan = false;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vmax = at::vec::maximum(vmax, Vec::loadu(x + i).abs());  // NaN-propagating
  for (; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    amax = std::max(amax, std::abs(x[i]));
  }
  const float vector_max = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  if (nan || std::isnan(vector_max)) {  // std::max would drop it: the row's scale is NaN, its codes 0
    std::memset(q, 0, static_cast<size_t>(n));
    return std::numeric_limits<float>::quiet_NaN();
  }
  amax = std::max(amax, vector_max);
  const float scale = amax / 127.f;
  const float div = scale == 0.f ? 1.f : scale;
  const Vec vdiv(div), lo(-128.f), hi(127.f);
  float tmp[kLanes];
  for (i = 0; i + kLanes <= n; i += kLanes) {
    at::vec::clamp((Vec::loadu(x + i) / vdiv).round(), lo, hi).store(tmp);
    for (int64_t j = 0; j < kLanes; ++j) q[i + j] = static_cast<int8_t>(static_cast<int32_t>(tmp[j]));
  }
  for (; i < n; ++i) q[i] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, std::nearbyint(x[i] / div))));
  return scale;
}

}  // namespace dlinfer_cpu
