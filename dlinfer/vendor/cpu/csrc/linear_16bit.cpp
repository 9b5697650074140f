// linear for few rows in bfloat16 / float16: y[M, N] = x[M, K] W[N, K]^T (+ bias), M <= 8.
//
// The float32 kernel's loop (linear.cpp: each thread walks a band of W's rows in few_rows_walk.h's
// order, every W vector used for all M rows of x, a software prefetch 16 KB ahead; on a Zen 1 CPU
// an AVX2 build runs 5 to 8 rows as two passes of at most 4: see run), with W read
// as 16-bit values, half of float32's bytes: the weights stream as stored, never widened into
// memory (x is, at up to 4 rows on the portable path: M x K floats, see run_rows). Sums are
// float32; each output is rounded once to the activation dtype (round to nearest even), after
// the bias is added in float32. Two paths, chosen at run time:
//  - AVX512_BF16 (bfloat16 only, AVX-512 builds on CPUs with the flag): vdpbf16ps multiplies 16
//    pairs of bf16 (exact in float32) and adds both products into 16 float32 lanes; 32 elements
//    of K per instruction. Like every bf16 dot-product instruction it treats subnormal inputs
//    (|v| < 2^-126) as zero.
//  - portable (any build, bfloat16 and float16): ATen's vectors; x widened to float32 once per
//    call up to 4 rows, each weight vector widened in registers (bf16: a 16-bit shift; fp16:
//    vcvtph2ps where the build has F16C), then fmadd: few_rows_portable.h, the loop the float32
//    kernel runs too.
#include "common.h"
#include "entry_points.h"
#include "few_rows_portable.h"
#include "few_rows_walk.h"

#include <memory>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace dlinfer_cpu {
namespace {

constexpr int kMaxRows = 8;
enum Path : int { kPortable = 0, kAvx512Bf16 = 1 };

int best_path() {
#if defined(CPU_CAPABILITY_AVX512)
  static const int best = __builtin_cpu_supports("avx512bf16") ? kAvx512Bf16 : kPortable;
  return best;
#else
  return kPortable;
#endif
}

#if defined(CPU_CAPABILITY_AVX2)
// Whether this CPU executes a 256-bit operation as two 128-bit halves (AMD Zen 1 and Zen+, which
// GCC reports as znver1): there 5 to 8 rows run as two passes (`run`).
bool split_rows_here() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("znver1") != 0;
  }();
  return yes;
}
#endif

#if defined(CPU_CAPABILITY_AVX512)

template <int M, int R, bool Chunked>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void walk_dpbf16(const uint16_t* x, int64_t ldx,
                                                                        const uint16_t* w, Bias bias,
                                                                        c10::BFloat16* y, int64_t n0, int64_t n1,
                                                                        int64_t K, int64_t N, int64_t kc) {
  const int64_t kv = K - K % 32;
  const __mmask32 tail = K > kv ? static_cast<__mmask32>((1ULL << (K - kv)) - 1) : 0;
  const int64_t nr = n0 + (n1 - n0) / R * R;
  walk_rows<M, R, Chunked, __m512>(
      w, K, kv, kc, kFewRowsPrefetchBytes / 2, n0, nr,
      [&](__m512* parked, int64_t n, int64_t gap, int64_t k0, int64_t k1, const uint16_t* pf, bool first,
          bool last)
          __attribute__((target("avx512f,avx512bw,avx512bf16"))) {
            __m512 acc[R * M];
            for (int j = 0; j < R * M; ++j) acc[j] = first ? _mm512_setzero_ps() : parked[j];
            const uint16_t* wr = w + n * K;
            for (int64_t k = k0; k < k1; k += 32) {
              __m512bh wv[R];
              for (int r = 0; r < R; ++r) {
                __builtin_prefetch(pf + r * gap * K + k, 0, 1);
                wv[r] = (__m512bh)_mm512_loadu_si512(wr + r * gap * K + k);
              }
              for (int m = 0; m < M; ++m) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);
                for (int r = 0; r < R; ++r) acc[r * M + m] = _mm512_dpbf16_ps(acc[r * M + m], wv[r], xv);
              }
            }
            if (!last) {
              for (int j = 0; j < R * M; ++j) parked[j] = acc[j];
              return;
            }
            for (int r = 0; r < R; ++r) {
              if (tail) {
                const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + r * gap * K + kv);
                for (int m = 0; m < M; ++m)
                  acc[r * M + m] = _mm512_dpbf16_ps(acc[r * M + m], wv,
                                                    (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * ldx + kv));
              }
              for (int m = 0; m < M; ++m)
                y[m * N + n + r * gap] = static_cast<c10::BFloat16>(
                    bias.add<c10::BFloat16>(_mm512_reduce_add_ps(acc[r * M + m]), n + r * gap));
            }
          });
  if constexpr (R > 1) {
    if (nr < n1) walk_dpbf16<M, 1, Chunked>(x, ldx, w, bias, y, nr, n1, K, N, kc);
  }
}

#endif

template <typename T, int M>
void run_rows(const T* x, int64_t ldx, const T* w, Bias bias, T* y, int64_t K, int64_t N, int path) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (path == kAvx512Bf16) {
      const auto xb = reinterpret_cast<const uint16_t*>(x);
      const auto wb = reinterpret_cast<const uint16_t*>(w);
      walk_bands<M>(N, K, sizeof(T), 32, [&](int64_t b, int64_t e, int64_t kc, auto R, auto chunked) {
        walk_dpbf16<M, decltype(R)::value, decltype(chunked)::value>(xb, ldx, wb, bias, y, b, e, K, N, kc);
      });
      return;
    }
  }
#endif
  // Up to 4 rows, x widened to float32 once (exact), so the loop converts only the weights:
  // converting x in it took 2 operations per x vector and weight row, the FMAs' count (AVX2, Zen
  // 3 EPYC: 1B gate_up at 4 rows 10.5-10.7 -> 4.5-5.9 ms with this and the unrolled loops). The
  // walk is then chosen by x's float32 bytes (on AVX2 builds two rows at any K: two_chains).
  // From 5 rows on x stays 16-bit: its float32 chunks left the two-row walk's 2 x M sums fewer
  // registers (1B down at 8 rows 3.2-3.7 -> 5.3-6.0 ms, the Zen 3 VM). (On a Zen 1 CPU AVX2 builds
  // no longer come here with more than 4 rows: `run` splits them.)
  if constexpr (M <= 4) {
    std::unique_ptr<float[]> xf(new float[M * K]);
    for (int m = 0; m < M; ++m) to_float(x + m * ldx, xf.get() + m * K, K);
    walk_bands<M>(
        N, K, sizeof(T), kLanes,
        [&](int64_t b, int64_t e, int64_t kc, auto R, auto chunked) {
          walk_portable<T, M, decltype(R)::value, decltype(chunked)::value, float>(xf.get(), K, w, bias, y, b, e, K,
                                                                                   N, kc);
        },
        sizeof(float));
  } else {
    walk_bands<M>(N, K, sizeof(T), kLanes, [&](int64_t b, int64_t e, int64_t kc, auto R, auto chunked) {
      walk_portable<T, M, decltype(R)::value, decltype(chunked)::value>(x, ldx, w, bias, y, b, e, K, N, kc);
    });
  }
}

template <typename T>
void run(const T* x, int64_t ldx, const T* w, Bias bias, T* y, int64_t M, int64_t K, int64_t N, int path) {
#if defined(CPU_CAPABILITY_AVX2)
  // 5 to 8 rows on a CPU that splits 256-bit operations in two (`split_rows_here`): two passes
  // over the weight, rows 0-3 then the rest, each with x widened to float32 (the <= 4 rows walk),
  // instead of one pass converting x's 16-bit values at every weight vector (2 operations per x
  // vector and weight row beside 1 FMA). A row's bits do not depend on the rows beside it, so the
  // outputs are the same. On the 2-vCPU EPYC of /proc/cpuinfo family 23 (Zen 1), 1B shapes from
  // memory, bfloat16, 8 rows: gate_up 23.6 -> 10.3 ms, down 8.6 -> 6.1 ms (docs/notes/cpu-ops.md,
  // "bfloat16 at 5 to 8 rows on AVX2: two passes"). Elsewhere (the Zen 3 VM: one pass took 3.2-3.7
  // ms on 8 rows of down, where two four-row passes would take ~4) the one pass stays.
  if (M > 4 && split_rows_here()) {
    run<T>(x, ldx, w, bias, y, 4, K, N, path);
    run<T>(x + 4 * ldx, ldx, w, bias, y + 4 * N, M - 4, K, N, path);
    return;
  }
#endif
  switch (M) {
    case 1: run_rows<T, 1>(x, ldx, w, bias, y, K, N, path); break;
    case 2: run_rows<T, 2>(x, ldx, w, bias, y, K, N, path); break;
    case 3: run_rows<T, 3>(x, ldx, w, bias, y, K, N, path); break;
    case 4: run_rows<T, 4>(x, ldx, w, bias, y, K, N, path); break;
    case 5: run_rows<T, 5>(x, ldx, w, bias, y, K, N, path); break;
    case 6: run_rows<T, 6>(x, ldx, w, bias, y, K, N, path); break;
    case 7: run_rows<T, 7>(x, ldx, w, bias, y, K, N, path); break;
    case 8: run_rows<T, 8>(x, ldx, w, bias, y, K, N, path); break;
    default: break;
  }
}

}  // namespace

int64_t linear_16bit_best_path() { return best_path(); }

// x [M, K] (rows dense), weight [N, K] contiguous, bias [N]? (x's dtype or float32), all
// bfloat16 or float16 -> [M, N] in x's dtype. path: -1 the best for the dtype, else that path.
at::Tensor linear_few_rows_16bit(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                 int64_t path) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "linear_few_rows_16bit: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK((dt == at::kBFloat16 || dt == at::kHalf) && weight.scalar_type() == dt,
              "linear_few_rows_16bit: x and weight must both be bfloat16 or both float16, got ", dt, " and ",
              weight.scalar_type());
  TORCH_CHECK(x.stride(1) == 1 && weight.is_contiguous(), "linear_few_rows_16bit: x rows and weight must be dense");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(M <= kMaxRows, "linear_few_rows_16bit: at most ", kMaxRows, " rows, got ", M);
  if (path < 0) path = dt == at::kBFloat16 ? best_path() : kPortable;
  TORCH_CHECK(path == kPortable || (path == kAvx512Bf16 && best_path() == kAvx512Bf16 && dt == at::kBFloat16),
              "linear_few_rows_16bit: path ", path, " cannot run here for ", dt, " (best here: ", best_path(), ")");
  Bias b;
  if (bias.has_value()) {
    TORCH_CHECK((bias->scalar_type() == dt || bias->scalar_type() == at::kFloat) && bias->is_contiguous() &&
                    bias->numel() == N,
                "linear_few_rows_16bit: bias must be dense [", N, "] in x's dtype or float32, got ", bias->sizes(),
                " ", bias->scalar_type());
    b = Bias{bias->data_ptr(), bias->scalar_type() == at::kFloat};
  }
  at::Tensor y = empty_tensor({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const int p = static_cast<int>(path);
  if (dt == at::kBFloat16) {
    using T = c10::BFloat16;
    run<T>(x.data_ptr<T>(), x.stride(0), weight.data_ptr<T>(), b, y.data_ptr<T>(), M, K, N, p);
  } else {
    using T = c10::Half;
    run<T>(x.data_ptr<T>(), x.stride(0), weight.data_ptr<T>(), b, y.data_ptr<T>(), M, K, N, p);
  }
  return y;
}

}  // namespace dlinfer_cpu
