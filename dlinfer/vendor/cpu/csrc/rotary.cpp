// apply_rotary_pos_emb: rotate-half rotary embedding of q and k in one call, float32 math.
//   out[i] = x[i] cos[i] - x[i + R/2] sin[i]        i <  R/2
//   out[i] = x[i] cos[i] + x[i - R/2] sin[i]        R/2 <= i < R
//   out[i] = x[i]                                   R <= i < D   (partial rotary)
// Each product rounded to float32, then the sum (HF's q * cos + rotate_half(q) * sin, bitwise
// in float32), then one rounding to the activation dtype. x, cos and sin are read as stored
// (cos / sin float32 or the activation dtype) and widened in registers; nothing is staged in
// float32 memory.
#include "common.h"
#include "entry_points.h"

namespace dlinfer_cpu {
namespace {

// One head's row: x [D] -> out [D]; c / s [R].
template <typename T, typename C>
inline void rotate_row(const T* x, T* out, int64_t D, const C* c, const C* s, int64_t R) {
  const int64_t half = R / 2;
  int64_t i = 0;
  for (; i + kLanes <= half; i += kLanes) {
    const Vec x1 = load_vec(x + i), x2 = load_vec(x + half + i);
    store_vec(out + i, x1 * load_vec(c + i) - x2 * load_vec(s + i));
    store_vec(out + half + i, x2 * load_vec(c + half + i) + x1 * load_vec(s + half + i));
  }
  for (; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[half + i]);
    out[i] = static_cast<T>(x1 * static_cast<float>(c[i]) - x2 * static_cast<float>(s[i]));
    out[half + i] = static_cast<T>(x2 * static_cast<float>(c[half + i]) + x1 * static_cast<float>(s[half + i]));
  }
  if (R < D) std::memcpy(out + R, x + R, (D - R) * sizeof(T));  // partial rotary: the rest as is
}

template <typename T, typename C>
void rotate(const T* x, int64_t s_tok, int64_t s_head, T* out, int64_t T_, int64_t H, int64_t D, const C* cos,
            const C* sin, int64_t R) {
  auto tokens = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < H; ++h)
        rotate_row(x + t * s_tok + h * s_head, out + (t * H + h) * D, D, cos + t * R, sin + t * R, R);
  };
  at::parallel_for(0, T_, grain_for(T_, T_ * H * D * static_cast<int64_t>(sizeof(T))), tokens);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> apply_rotary_pos_emb(const at::Tensor& query_in, const at::Tensor& key_in,
                                                        const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor query = dense_rows(query_in), key = dense_rows(key_in);
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3, "rotary: q/k");
  const auto ct = cos.scalar_type();
  TORCH_CHECK((ct == at::kFloat || ct == query.scalar_type()) && sin.scalar_type() == ct && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == query.size(0),
              "rotary: cos/sin must be dense [T, R], float32 or ", query.scalar_type(), ", got ", cos.sizes(), " ",
              ct, " and ", sin.sizes(), " ", sin.scalar_type());
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), "rotary: q/k dtypes must match");
  const int64_t R = cos.size(1);
  TORCH_CHECK(R % 2 == 0 && R <= query.size(2) && R <= key.size(2), "rotary: R must be even and <= D");
  at::Tensor q_out = empty_tensor(query.sizes(), query.options());
  at::Tensor k_out = empty_tensor(key.sizes(), key.options());
  AT_DISPATCH_V2(query.scalar_type(), "apply_rotary_pos_emb", AT_WRAP([&] {
    using T = scalar_t;
    auto run = [&](auto* c, auto* s) {
      rotate(query.data_ptr<T>(), query.stride(0), query.stride(1), q_out.data_ptr<T>(), query.size(0),
             query.size(1), query.size(2), c, s, R);
      rotate(key.data_ptr<T>(), key.stride(0), key.stride(1), k_out.data_ptr<T>(), key.size(0), key.size(1),
             key.size(2), c, s, R);
    };
    if (ct == at::kFloat) {
      run(cos.data_ptr<float>(), sin.data_ptr<float>());
    } else {
      run(cos.data_ptr<T>(), sin.data_ptr<T>());
    }
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return {q_out, k_out};
}

}  // namespace dlinfer_cpu
