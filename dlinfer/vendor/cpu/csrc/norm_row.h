// One row of rms_norm / add_rms_norm (norm.cpp), shared with the fused W8A8 norms (quant_w8.cpp),
// which quantise exactly the values rms_norm writes.
#pragma once

#include "common.h"

#include <cmath>

namespace dlinfer_cpu {

// One row: pass 1 forms s (h + r, rounded and stored when there is a residual) and the sum of
// squares; pass 2 writes round(round(s * inv) * w). W: the weight's dtype, float32 or T, read as
// stored and widened in registers (exactly: the product is the same either way).
template <typename T, typename W>
void norm_row(const T* x, const T* r, const W* w, T* out, T* summed, int64_t H, float eps) {
  const T* s = r ? summed : x;
  Vec acc(0.f);
  float tail = 0.f;
  int64_t i = 0;
  for (; i + kLanes <= H; i += kLanes) {
    Vec v = load_vec(x + i);
    if (r) {
      v = round_to<T>(v + load_vec(r + i));
      store_vec(summed + i, v);
    }
    acc = at::vec::fmadd(v, v, acc);
  }
  for (; i < H; ++i) {
    float v = static_cast<float>(x[i]);
    if (r) {
      summed[i] = static_cast<T>(v + static_cast<float>(r[i]));
      v = static_cast<float>(summed[i]);
    }
    tail += v * v;
  }
  const float ss = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc) + tail;
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  const Vec vinv(inv);
  for (i = 0; i + kLanes <= H; i += kLanes)
    store_vec(out + i, round_to<T>(load_vec(s + i) * vinv) * load_vec(w + i));
  for (; i < H; ++i) {
    const T y = static_cast<T>(static_cast<float>(s[i]) * inv);
    out[i] = static_cast<T>(static_cast<float>(y) * static_cast<float>(w[i]));
  }
}

}  // namespace dlinfer_cpu
