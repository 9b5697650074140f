// linear for few rows: y[M, N] = x[M, K] W[N, K]^T (+ bias), float32, M <= kMaxRows.
//
// At decode sizes (one to a few tokens) a linear layer is a matrix-vector product bound by the
// speed at which W streams from memory; BLAS kernels built for large M leave half of that bandwidth
// unused. Here each thread walks a contiguous band of W's rows in the order few_rows_walk.h gives
// (one row at a time while x is small, or 2 or 4 parts of the band side by side where
// `weight_streams` says so; else two rows, in K chunks from M = 3 on; on AVX2 builds two, half the
// band apart (unchunked), at up to 4 rows: two FMA chains a row of x), and every vector of W, once
// loaded, is used for all M rows of x; one horizontal sum per output. A software prefetch into L2
// runs 16 KB ahead of the loads in that order (at M = 8 the FMAs take about as long as the memory
// stream, and the two only overlap when the stream is requested well ahead). Bigger M is
// compute-bound: the caller uses BLAS. The loop is few_rows_portable.h's, the one the bfloat16 /
// float16 kernel's portable path runs, at T = float.
#include "common.h"
#include "entry_points.h"
#include "few_rows_portable.h"
#include "few_rows_walk.h"

namespace dlinfer_cpu {
namespace {

constexpr int kMaxRows = 8;

template <int M>
void run_rows(const float* x, int64_t ldx, const float* w, const float* bias, float* y, int64_t K, int64_t N) {
  walk_bands<M>(N, K, sizeof(float), kLanes, [&](int64_t b, int64_t e, int64_t kc, auto R, auto chunked) {
    walk_portable<float, M, decltype(R)::value, decltype(chunked)::value>(x, ldx, w, Bias{bias, true}, y, b, e, K,
                                                                          N, kc);
  });
}

}  // namespace

int64_t linear_max_rows() { return kMaxRows; }

at::Tensor linear_few_rows(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "linear_few_rows: shapes");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "linear_few_rows: float32 only");
  TORCH_CHECK(x.stride(1) == 1 && weight.is_contiguous(), "linear_few_rows: x rows and weight must be dense");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(M <= kMaxRows, "linear_few_rows: at most ", kMaxRows, " rows");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = empty_tensor({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  switch (M) {
    case 0: break;
    case 1: run_rows<1>(xp, ldx, wp, b, yp, K, N); break;
    case 2: run_rows<2>(xp, ldx, wp, b, yp, K, N); break;
    case 3: run_rows<3>(xp, ldx, wp, b, yp, K, N); break;
    case 4: run_rows<4>(xp, ldx, wp, b, yp, K, N); break;
    case 5: run_rows<5>(xp, ldx, wp, b, yp, K, N); break;
    case 6: run_rows<6>(xp, ldx, wp, b, yp, K, N); break;
    case 7: run_rows<7>(xp, ldx, wp, b, yp, K, N); break;
    case 8: run_rows<8>(xp, ldx, wp, b, yp, K, N); break;
  }
  return y;
}

}  // namespace dlinfer_cpu
