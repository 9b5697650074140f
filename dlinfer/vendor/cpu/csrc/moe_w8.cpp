// fused_moe_w8a8 on the CPU: the W8A8 expert MLP with the int8 product of int8_gemm.cpp.
//
//   x [T, H] -> xq, x_scale (per token, quantize_row)
//   per expert e with tokens S_e (the (token, k) pairs routed to it, in token order):
//     gu[s, j]  = ((float)(xq[s] . Wgu[e, j]) * x_scale[s]) * gu_scale[e, j]         float32
//     act[s, i] = silu(gu[s, i]) * gu[s, I + i]                                     float32
//     aq, a_scale = quantize_row(act[s])
//     y[s, h]   = ((float)(aq[s] . Wd[e, h]) * a_scale[s]) * d_scale[e, h]           float32
//     out[t]   += w[t, k] * y                                                       float32
//   out rounded once to hidden_states' dtype.
// The int8 products are exact; the float32 steps follow the torch vendor's order, except silu's
// exp (ATen's vectorised exp here), so act may differ from the torch vendor's in its last bits,
// and an element on a rounding tie may quantise one step away (the conformance check allows it).
// Experts run one after another, each GEMM through int8_matmul_rows (the weight-streaming int8
// kernel, parallel over output channels, up to 8 tokens; oneDNN's int8 GEMM beyond), which at
// decode sizes is where the time goes: streaming the active experts' weights. Ids outside [0, E)
// contribute nothing (the op's value checks reject them first when enabled).
#include "entry_points.h"
#include "int8_gemm.h"

#include <vector>

namespace dlinfer_cpu {
namespace {

// act[i] = silu(g[i]) * u[i], float32, n values.
inline void silu_mul(const float* g, const float* u, float* act, int64_t n) {
  const Vec one(1.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec x = Vec::loadu(g + i);
    (x / (one + x.neg().exp()) * Vec::loadu(u + i)).store(act + i);
  }
  for (; i < n; ++i) act[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

}  // namespace

at::Tensor fused_moe_w8a8(const at::Tensor& hidden_in, const at::Tensor& gate_up_in, const at::Tensor& gate_up_scales_in,
                          const at::Tensor& down_in, const at::Tensor& down_scales_in, const at::Tensor& topk_weights_in,
                          const at::Tensor& topk_ids_in, bool renormalize) {
  const at::Tensor hidden = hidden_in.contiguous(), gate_up = gate_up_in.contiguous(), down = down_in.contiguous();
  const at::Tensor gu_scales = gate_up_scales_in.to(at::kFloat).contiguous();
  const at::Tensor d_scales = down_scales_in.to(at::kFloat).contiguous();
  const at::Tensor weights = topk_weights_in.to(at::kFloat).contiguous();
  const at::Tensor ids = topk_ids_in.contiguous();
  TORCH_CHECK(hidden.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3 && gate_up.scalar_type() == at::kChar &&
                  down.scalar_type() == at::kChar,
              "fused_moe_w8a8: hidden [T, H], int8 gate_up [E, 2I, H], int8 down [E, H, I]");
  const int64_t T = hidden.size(0), H = hidden.size(1), E = gate_up.size(0), I = gate_up.size(1) / 2;
  const int64_t K = ids.size(1);
  TORCH_CHECK(gate_up.size(2) == H && down.size(0) == E && down.size(1) == H && down.size(2) == I &&
                  gu_scales.numel() == E * 2 * I && d_scales.numel() == E * H && ids.size(0) == T &&
                  weights.size(0) == T && weights.size(1) == K,
              "fused_moe_w8a8: inconsistent shapes");

  // x quantised per token
  std::vector<int8_t> xq(T * H);
  std::vector<float> xs(T);
  {
    const at::Tensor xf = hidden.to(at::kFloat).contiguous();
    const float* xp = xf.data_ptr<float>();
    at::parallel_for(0, T, grain_for(T, T * H * 4), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) xs[t] = quantize_row(xp + t * H, xq.data() + t * H, H);
    });
  }
  // routing weights (renormalised per token: w / sum(w), as the torch vendor) and pairs per expert
  std::vector<float> w(weights.data_ptr<float>(), weights.data_ptr<float>() + T * K);
  if (renormalize) {
    for (int64_t t = 0; t < T; ++t) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += w[t * K + k];
      for (int64_t k = 0; k < K; ++k) w[t * K + k] = w[t * K + k] / sum;
    }
  }
  IndexReader id(ids);
  std::vector<std::vector<int64_t>> pairs(E);  // t * K + k, ids outside [0, E) contribute nothing
  for (int64_t p = 0; p < T * K; ++p) {
    const int64_t e = id[p];
    if (e >= 0 && e < E) pairs[e].push_back(p);
  }

  at::Tensor out_f = empty_tensor({T, H}, hidden.options().dtype(at::kFloat));
  float* out = out_f.data_ptr<float>();
  std::fill(out, out + T * H, 0.f);
  std::vector<const int8_t*> rows;
  std::vector<float> gu, act;
  std::vector<int8_t> aq;
  std::vector<float> as;
  std::vector<const int8_t*> a_rows;
  for (int64_t e = 0; e < E; ++e) {
    const std::vector<int64_t>& ps = pairs[e];
    const int64_t S = static_cast<int64_t>(ps.size());
    if (S == 0) continue;
    rows.resize(S);
    for (int64_t s = 0; s < S; ++s) rows[s] = xq.data() + (ps[s] / K) * H;
    const at::Tensor acc_gu_t = int8_matmul_rows(rows.data(), S, gate_up[e]);
    const int32_t* acc_gu = acc_gu_t.data_ptr<int32_t>();
    gu.resize(S * 2 * I);
    act.resize(S * I);
    aq.resize(S * I);
    as.resize(S);
    const float* gus = gu_scales.data_ptr<float>() + e * 2 * I;
    at::parallel_for(0, S, grain_for(S, S * I * 16), [&](int64_t b, int64_t end) {
      for (int64_t s = b; s < end; ++s) {
        const float x_scale = xs[ps[s] / K];
        float* g = gu.data() + s * 2 * I;
        for (int64_t j = 0; j < 2 * I; ++j) {
          const float v = static_cast<float>(acc_gu[s * 2 * I + j]) * x_scale;
          g[j] = v * gus[j];
        }
        silu_mul(g, g + I, act.data() + s * I, I);
        as[s] = quantize_row(act.data() + s * I, aq.data() + s * I, I);
      }
    });
    a_rows.resize(S);
    for (int64_t s = 0; s < S; ++s) a_rows[s] = aq.data() + s * I;
    const at::Tensor acc_d_t = int8_matmul_rows(a_rows.data(), S, down[e]);
    const int32_t* acc_d = acc_d_t.data_ptr<int32_t>();
    const float* ds = d_scales.data_ptr<float>() + e * H;
    // each thread owns a range of output columns and adds the pairs in order (a token routed twice
    // to one expert adds twice, as in the torch vendor)
    at::parallel_for(0, H, grain_for(H, S * H * 8), [&](int64_t h0, int64_t h1) {
      for (int64_t s = 0; s < S; ++s) {
        const int64_t t = ps[s] / K;
        const float a_scale = as[s], wt = w[ps[s]];
        for (int64_t h = h0; h < h1; ++h) {
          const float y = (static_cast<float>(acc_d[s * H + h]) * a_scale) * ds[h];
          out[t * H + h] += y * wt;
        }
      }
    });
  }
  return out_f.to(hidden.scalar_type());
}

}  // namespace dlinfer_cpu
