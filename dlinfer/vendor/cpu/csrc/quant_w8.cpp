// W8A8 on the CPU: dynamic per-token quantisation, RMSNorm fused with it, and the int8 linear.
//
// Every result is bit-identical to the torch vendor's (dlinfer/vendor/torch/quant.py):
//  - quantisation (int8_gemm.h quantize_row): float32 amax / 127, float32 division, round half to
//    even, clamp; a zero row: scale 0, values 0; a row holding a NaN: scale NaN, values 0;
//  - the fused norms quantise exactly the values this vendor's rms_norm / add_rms_norm write
//    (norm_row.h), read back as float32, in the same pass over the row;
//  - linear_w8a8: the exact int32 product (int8_gemm.cpp), then ((float)acc * rms_scale[m]) *
//    linear_scale[n] (+ (float)bias[n]) in float32, one rounding to out_dtype: PyTorch's order.
#include "entry_points.h"
#include "int8_gemm.h"
#include "norm_row.h"

#include <vector>

namespace dlinfer_cpu {
std::tuple<at::Tensor, at::Tensor> dynamic_quant(const at::Tensor& x_in) {
  const at::Tensor x = dense_rows(x_in);
  TORCH_CHECK(x.dim() == 2, "dynamic_quant: x must be [N, K]");
  const int64_t N = x.size(0), K = x.size(1);
  at::Tensor q = empty_tensor({N, K}, x.options().dtype(at::kChar));
  at::Tensor scale = empty_tensor({N}, x.options().dtype(at::kFloat));
  AT_DISPATCH_V2(x.scalar_type(), "dynamic_quant", AT_WRAP([&] {
    using T = scalar_t;
    const T* xp = x.data_ptr<T>();
    const int64_t ldx = x.stride(0);
    int8_t* qp = q.data_ptr<int8_t>();
    float* sp = scale.data_ptr<float>();
    at::parallel_for(0, N, grain_for(N, N * K * static_cast<int64_t>(sizeof(T))), [&](int64_t begin, int64_t end) {
      std::vector<float> row(std::is_same_v<T, float> ? 0 : K);
      for (int64_t n = begin; n < end; ++n) {
        const float* xf;
        if constexpr (std::is_same_v<T, float>) {
          xf = reinterpret_cast<const float*>(xp + n * ldx);  // T is float here
        } else {
          to_float(xp + n * ldx, row.data(), K);
          xf = row.data();
        }
        sp[n] = quantize_row(xf, qp + n * K, K);
      }
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return {q, scale};
}

namespace {

// rms_norm (+ residual) then quantisation, row by row: (xq, scale, h + r or an undefined tensor).
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_quant(const at::Tensor& hidden_in,
                                                          const std::optional<at::Tensor>& residual_in,
                                                          const at::Tensor& weight, double eps) {
  const at::Tensor hidden = dense_rows(hidden_in);
  const std::optional<at::Tensor> residual =
      residual_in.has_value() ? std::optional<at::Tensor>(dense_rows(*residual_in)) : std::nullopt;
  TORCH_CHECK(hidden.dim() == 2 && weight.is_contiguous() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == hidden.scalar_type()) &&
                  weight.numel() == hidden.size(1),
              "rms_norm_w8a8: hidden_states [N, H], weight [H] float32 or hidden_states' dtype");
  const int64_t N = hidden.size(0), H = hidden.size(1);
  at::Tensor q = empty_tensor({N, H}, hidden.options().dtype(at::kChar));
  at::Tensor scale = empty_tensor({N}, hidden.options().dtype(at::kFloat));
  at::Tensor summed;
  if (residual.has_value()) {
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == N && residual->size(1) == H &&
                    residual->scalar_type() == hidden.scalar_type(),
                "add_rms_norm_w8a8: residual must be [N, H] like hidden_states");
    summed = empty_tensor({N, H}, hidden.options());
  }
  AT_DISPATCH_V2(hidden.scalar_type(), "rms_norm_w8a8", AT_WRAP([&] {
    using T = scalar_t;
    const T* hp = hidden.data_ptr<T>();
    const T* rp = residual ? residual->data_ptr<T>() : nullptr;
    const int64_t ldh = hidden.stride(0), ldr = residual ? residual->stride(0) : 0;
    T* sum_p = residual ? summed.data_ptr<T>() : nullptr;
    int8_t* qp = q.data_ptr<int8_t>();
    float* sp = scale.data_ptr<float>();
    auto run = [&](auto* w) {  // the weight read as stored (float32 or T), as rms_norm does (norm.cpp)
      at::parallel_for(0, N, grain_for(N, N * H * static_cast<int64_t>(sizeof(T))), [&](int64_t begin, int64_t end) {
        std::vector<T> normed(H);
        std::vector<float> row(H);
        for (int64_t n = begin; n < end; ++n) {
          norm_row(hp + n * ldh, rp ? rp + n * ldr : nullptr, w, normed.data(), sum_p ? sum_p + n * H : nullptr, H,
                   static_cast<float>(eps));
          to_float(normed.data(), row.data(), H);
          sp[n] = quantize_row(row.data(), qp + n * H, H);
        }
      });
    };
    if (weight.scalar_type() == at::kFloat) {
      run(weight.data_ptr<float>());
    } else {
      run(weight.data_ptr<T>());
    }
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return {q, scale, summed};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_w8a8(const at::Tensor& hidden, const at::Tensor& weight, double eps) {
  auto out = norm_quant(hidden, std::nullopt, weight, eps);
  return {std::get<0>(out), std::get<1>(out)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_w8a8(const at::Tensor& hidden, const at::Tensor& residual,
                                                                 const at::Tensor& weight, double eps) {
  return norm_quant(hidden, residual, weight, eps);
}

namespace {

int resolve_path(int64_t path) {
  TORCH_CHECK(int8_path_available(static_cast<int>(path)), "int8 path ", path, " is not available here");
  return static_cast<int>(path);
}

// The int8 product's operands as int8_gemm reads them: a [M, K] by row pointers (its rows may be
// strided, each row dense), b [N, K] dense; `op` names the caller in the shape error.
struct Int8Operands {
  at::Tensor a, b;
  std::vector<const int8_t*> rows;
};

Int8Operands int8_operands(const char* op, const at::Tensor& a_in, const at::Tensor& b_in) {
  Int8Operands o{dense_rows(a_in), b_in.contiguous(), {}};
  TORCH_CHECK(o.a.dim() == 2 && o.b.dim() == 2 && o.a.size(1) == o.b.size(1) && o.a.scalar_type() == at::kChar &&
                  o.b.scalar_type() == at::kChar,
              op, ": a [M, K] int8, b [N, K] int8");
  o.rows.resize(o.a.size(0));
  for (int64_t m = 0; m < o.a.size(0); ++m) o.rows[m] = o.a.data_ptr<int8_t>() + m * o.a.stride(0);
  return o;
}

}  // namespace

// a [M, K] int8, b [N, K] int8 -> [M, N] int32, exact. path -1: int8_matmul_rows' choice, else
// int8_gemm on that path (the tests run each).
at::Tensor int8_matmul(const at::Tensor& a_in, const at::Tensor& b_in, int64_t path) {
  const Int8Operands o = int8_operands("int8_matmul", a_in, b_in);
  const int64_t M = o.a.size(0), N = o.b.size(0), K = o.a.size(1);
  if (path < 0) return int8_matmul_rows(o.rows.data(), M, o.b);
  at::Tensor out = empty_tensor({M, N}, o.a.options().dtype(at::kInt));
  int8_gemm(o.rows.data(), M, o.b.data_ptr<int8_t>(), N, K, out.data_ptr<int32_t>(), N, resolve_path(path));
  return out;
}

at::Tensor linear_w8a8(const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& rms_scale_in,
                       const at::Tensor& linear_scale_in, at::ScalarType out_dtype,
                       const std::optional<at::Tensor>& bias_in, int64_t path) {
  const Int8Operands o = int8_operands("linear_w8a8", a_in, b_in);
  const at::Tensor rms_scale = rms_scale_in.contiguous(), linear_scale = linear_scale_in.contiguous();
  const int64_t M = o.a.size(0), N = o.b.size(0), K = o.a.size(1);
  TORCH_CHECK(rms_scale.scalar_type() == at::kFloat && rms_scale.numel() == M &&
                  linear_scale.scalar_type() == at::kFloat && linear_scale.numel() == N,
              "linear_w8a8: rms_scale float32 [M], linear_scale float32 [N] or [N, 1]");
  std::vector<float> bias(bias_in.has_value() ? N : 0);
  if (bias_in.has_value()) {
    const at::Tensor bf = bias_in->to(at::kFloat).contiguous();  // the exact float32 value of each bias
    std::copy(bf.data_ptr<float>(), bf.data_ptr<float>() + N, bias.begin());
  }
  // The exact int32 product, int8_matmul's choice of kernel: the weight-streaming one (up to
  // kGemvRows rows, or on an explicit path) into a plain buffer, no tensor of its own (a call's
  // fixed cost counts: 120 of them a decode step); else int8_matmul_rows'.
  at::Tensor acc_tensor;
  std::vector<int32_t> acc_buffer;
  const int32_t* ap;
  if (path >= 0 || M <= kGemvRows) {
    acc_buffer.resize(M * N);
    int8_gemm(o.rows.data(), M, o.b.data_ptr<int8_t>(), N, K, acc_buffer.data(), N,
              path < 0 ? best_int8_path() : resolve_path(path));
    ap = acc_buffer.data();
  } else {
    acc_tensor = int8_matmul_rows(o.rows.data(), M, o.b);
    ap = acc_tensor.data_ptr<int32_t>();
  }
  at::Tensor out = empty_tensor({M, N}, o.a.options().dtype(out_dtype));
  AT_DISPATCH_V2(out_dtype, "linear_w8a8", AT_WRAP([&] {
    using T = scalar_t;
    const float* rs = rms_scale.data_ptr<float>();
    const float* ls = linear_scale.data_ptr<float>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, M, grain_for(M, M * N * 4), [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        for (int64_t n = 0; n < N; ++n) {
          float v = static_cast<float>(ap[m * N + n]) * rs[m];
          v = v * ls[n];
          if (!bias.empty()) v = v + bias[n];
          op[m * N + n] = static_cast<T>(v);
        }
      }
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}

int64_t int8_best_path() { return best_int8_path(); }

}  // namespace dlinfer_cpu
