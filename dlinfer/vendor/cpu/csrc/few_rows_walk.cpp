// The walks' one process-wide setting: how many weight streams a thread reads side by side while x
// fits in L1 (few_rows_walk.h, `weight_streams`). An atomic: the kernels read it at every call on
// any thread; the vendor sets it when it loads the kernels (DLINFER_CPU_WEIGHT_STREAMS), tests and
// benchmarks between calls.
#include "few_rows_walk.h"

#include <atomic>

namespace dlinfer_cpu {
namespace {

std::atomic<int64_t> g_streams{0};  // 0: the CPU's default

}  // namespace

// 4 on Intel CPUs running the AVX-512 build, else 1: measured on the Intel Xeon VM and the Zen 5 VM
// (few_rows_walk.h). AVX2 builds keep 1 whatever the CPU: 16 vector registers hold R x M sums only
// for R x M <= 8 (their far pair at up to four rows, two_chains, is the walk measured there), and
// no AVX2-only Intel CPU has been measured.
int64_t default_weight_streams() {
#if defined(CPU_CAPABILITY_AVX512)
  static const int64_t streams = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") ? int64_t{4} : int64_t{1};
  }();
  return streams;
#else
  return 1;
#endif
}

int64_t weight_streams() {
  const int64_t s = g_streams.load(std::memory_order_relaxed);
  return s ? s : default_weight_streams();
}

void set_weight_streams(int64_t streams) {
  TORCH_CHECK(streams == 0 || streams == 1 || streams == 2 || streams == 4,
              "set_weight_streams: streams must be 0 (the CPU's default), 1, 2 or 4, got ", streams);
  g_streams.store(streams, std::memory_order_relaxed);
}

}  // namespace dlinfer_cpu
