// apply_rotary_pos_emb: rotate-half rotary embedding of q and k in one call, float32 math.
//   out[i] = x[i] cos[i] - x[i + R/2] sin[i]        i <  R/2
//   out[i] = x[i] cos[i] + x[i - R/2] sin[i]        R/2 <= i < R
//   out[i] = x[i]                                   R <= i < D   (partial rotary)
// Each product rounded to float32, then the sum (HF's q * cos + rotate_half(q) * sin, bitwise
// in float32), then one rounding to the activation dtype.
#include "common.h"

#include <vector>

namespace dlinfer_cpu {
namespace {

template <typename T>
void rotate(const T* x, int64_t s_tok, int64_t s_head, T* out, int64_t T_, int64_t H, int64_t D, const float* cos,
            const float* sin, int64_t R) {
  const int64_t half = R / 2;
  auto tokens = [&](int64_t begin, int64_t end) {
    std::vector<float> xf(D), of(D);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * R;
      const float* s = sin + t * R;
      for (int64_t h = 0; h < H; ++h) {
        to_float(x + t * s_tok + h * s_head, xf.data(), D);
        int64_t i = 0;
        for (; i + kLanes <= half; i += kLanes) {
          const Vec x1 = Vec::loadu(xf.data() + i), x2 = Vec::loadu(xf.data() + half + i);
          (x1 * Vec::loadu(c + i) - x2 * Vec::loadu(s + i)).store(of.data() + i);
          (x2 * Vec::loadu(c + half + i) + x1 * Vec::loadu(s + half + i)).store(of.data() + half + i);
        }
        for (; i < half; ++i) {
          of[i] = xf[i] * c[i] - xf[half + i] * s[i];
          of[half + i] = xf[half + i] * c[half + i] + xf[i] * s[half + i];
        }
        for (int64_t k = R; k < D; ++k) of[k] = xf[k];
        from_float(of.data(), out + (t * H + h) * D, D);
      }
    }
  };
  at::parallel_for(0, T_, grain_for(T_, T_ * H * D * static_cast<int64_t>(sizeof(T))), tokens);
}

std::tuple<at::Tensor, at::Tensor> apply_rotary_pos_emb(const at::Tensor& query_in, const at::Tensor& key_in,
                                                        const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor query = dense_rows(query_in), key = dense_rows(key_in);
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3, "rotary: q/k");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.size(0) == query.size(0),
              "rotary: cos/sin must be dense float32 [T, R]");
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), "rotary: q/k dtypes must match");
  const int64_t R = cos.size(1);
  TORCH_CHECK(R % 2 == 0 && R <= query.size(2) && R <= key.size(2), "rotary: R must be even and <= D");
  at::Tensor q_out = at::empty(query.sizes(), query.options());
  at::Tensor k_out = at::empty(key.sizes(), key.options());
  AT_DISPATCH_V2(query.scalar_type(), "apply_rotary_pos_emb", AT_WRAP([&] {
    using T = scalar_t;
    rotate<T>(query.data_ptr<T>(), query.stride(0), query.stride(1), q_out.data_ptr<T>(), query.size(0),
              query.size(1), query.size(2), cos.data_ptr<float>(), sin.data_ptr<float>(), R);
    rotate<T>(key.data_ptr<T>(), key.stride(0), key.stride(1), k_out.data_ptr<T>(), key.size(0), key.size(1),
              key.size(2), cos.data_ptr<float>(), sin.data_ptr<float>(), R);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return {q_out, k_out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dlinfer_cpu, m) {
  m.def("apply_rotary_pos_emb(Tensor query, Tensor key, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.impl("apply_rotary_pos_emb", c10::DispatchKey::CPU, &apply_rotary_pos_emb);
}

}  // namespace dlinfer_cpu
