// silu_and_mul: out = silu(x[:, :I]) * x[:, I:] in float32 math, rounded as F.silu(gate) * up:
//   silu(g) = g / (1 + exp(-g)), rounded to the activation dtype (F.silu stores it), times up,
//   rounded to the activation dtype.
#include "common.h"
#include "entry_points.h"

#include <cmath>
#include <vector>

namespace dlinfer_cpu {
namespace {

template <typename T>
void silu_mul_rows(const T* x, int64_t ldx, T* out, int64_t N, int64_t I) {
  auto rows = [&](int64_t begin, int64_t end) {
    const Vec one(1.f);
    for (int64_t n = begin; n < end; ++n) {
      const T* g = x + n * ldx;
      const T* u = g + I;
      T* o = out + n * I;
      int64_t i = 0;
      for (; i + kLanes <= I; i += kLanes) {
        const Vec gv = load_vec(g + i);
        const Vec silu = round_to<T>(gv / (one + gv.neg().exp()));
        store_vec(o + i, silu * load_vec(u + i));
      }
      for (; i < I; ++i) {
        const float gi = static_cast<float>(g[i]);
        const float silu = static_cast<float>(static_cast<T>(gi / (1.f + std::exp(-gi))));
        o[i] = static_cast<T>(silu * static_cast<float>(u[i]));
      }
    }
  };
  at::parallel_for(0, N, grain_for(N, N * I * 2 * static_cast<int64_t>(sizeof(T))), rows);
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& x_in) {
  const at::Tensor x = dense_rows(x_in);
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be [N, 2I]");
  const int64_t N = x.size(0), I = x.size(1) / 2;
  at::Tensor out = empty_tensor({N, I}, x.options());
  AT_DISPATCH_V2(x.scalar_type(), "silu_and_mul", AT_WRAP([&] {
    silu_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), out.data_ptr<scalar_t>(), N, I);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}

}  // namespace dlinfer_cpu
