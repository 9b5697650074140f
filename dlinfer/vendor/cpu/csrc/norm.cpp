// rms_norm and add_rms_norm, one pass per row, float32 statistics, HF Llama order:
//   s   = h + r                       (add_rms_norm: rounded to the activation dtype, returned)
//   y   = s * (1 / sqrt(mean(s^2) + eps))   in float32, rounded to the activation dtype
//   out = y * w                       (product in float32, rounded to the activation dtype; w is
//                                      read as stored, float32 or the activation dtype, and
//                                      widened in registers, so a float32 weight of a bf16 model
//                                      multiplies unrounded, as in PyTorch's type promotion)
#include "entry_points.h"
#include "norm_row.h"

namespace dlinfer_cpu {
namespace {

template <typename T, typename W>
void norm_rows(const T* x, int64_t ldx, const T* r, int64_t ldr, const W* w, T* out, T* summed, int64_t N,
               int64_t H, float eps) {
  auto rows = [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      norm_row(x + n * ldx, r ? r + n * ldr : nullptr, w, out + n * H, r ? summed + n * H : nullptr, H, eps);
  };
  at::parallel_for(0, N, grain_for(N, N * H * static_cast<int64_t>(sizeof(T))), rows);
}

std::tuple<at::Tensor, at::Tensor> norm(const at::Tensor& hidden_in, const std::optional<at::Tensor>& residual_in,
                                        const at::Tensor& weight, double eps) {
  const at::Tensor hidden = dense_rows(hidden_in);
  const std::optional<at::Tensor> residual =
      residual_in.has_value() ? std::optional<at::Tensor>(dense_rows(*residual_in)) : std::nullopt;
  TORCH_CHECK(hidden.dim() == 2 && weight.is_contiguous(), "rms_norm: shapes");
  TORCH_CHECK((weight.scalar_type() == at::kFloat || weight.scalar_type() == hidden.scalar_type()) &&
                  weight.numel() == hidden.size(1),
              "rms_norm: weight must be [", hidden.size(1), "] float32 or ", hidden.scalar_type(), ", got ",
              weight.sizes(), " ", weight.scalar_type());
  const int64_t N = hidden.size(0), H = hidden.size(1);
  at::Tensor out = empty_tensor({N, H}, hidden.options());
  at::Tensor summed;
  if (residual.has_value()) {
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == N && residual->size(1) == H &&
                    residual->scalar_type() == hidden.scalar_type(),
                "add_rms_norm: residual must be [N, H] like hidden_states");
    summed = empty_tensor({N, H}, hidden.options());
  }
  AT_DISPATCH_V2(hidden.scalar_type(), "rms_norm", AT_WRAP([&] {
    using T = scalar_t;
    auto run = [&](auto* w) {
      norm_rows(hidden.data_ptr<T>(), hidden.stride(0), residual ? residual->data_ptr<T>() : nullptr,
                residual ? residual->stride(0) : 0, w, out.data_ptr<T>(), residual ? summed.data_ptr<T>() : nullptr,
                N, H, static_cast<float>(eps));
    };
    if (weight.scalar_type() == at::kFloat) {
      run(weight.data_ptr<float>());
    } else {
      run(weight.data_ptr<T>());
    }
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return {out, summed};
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps) {
  return std::get<0>(norm(hidden, std::nullopt, weight, eps));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& hidden, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  return norm(hidden, residual, weight, eps);
}

}  // namespace dlinfer_cpu
