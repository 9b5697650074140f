// The kernels as functions of the extension module (what kernels.py and weight_quant.py call).
//
// A call through torch.ops.dlinfer_cpu.* goes through the dispatcher: the arguments boxed into
// IValues against the schema, then unboxed for the kernel, about 0.8 us a call on the Zen 5 VM,
// and a decode step makes ~300 kernel calls (docs/benchmarks.md, "Kernel calls without the
// dispatcher"). These bindings call the same functions directly, as torch does its own: CPU tensors
// checked, the GIL released while the kernel runs, C++ errors raised as torch raises them. The
// torch.ops registrations stay (tests and tools call them by name); the vendor's hot path does not.
//
// Only the headers the bindings use: pybind11 with torch's Tensor casters (utils/pybind.h) and the
// error macros (Exceptions.h). <torch/extension.h> would add the whole C++ frontend (modules,
// optimisers): this file, the longest of the build, compiled in 60 s with it and 19 s without
// (one core of the Zen 3 EPYC VM, the same casters in the object).
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include "entry_points.h"

namespace dlinfer_cpu {
namespace {

void check_cpu(const char* op, const at::Tensor& t) {
  TORCH_CHECK(!t.defined() || t.device().is_cpu(), "dlinfer_cpu.", op, ": expected CPU tensors, got one on ",
              t.device());
}
void check_cpu(const char* op, const std::optional<at::Tensor>& t) {
  if (t.has_value()) check_cpu(op, *t);
}
template <typename A>
void check_cpu(const char*, const A&) {}

// m.name(args...) -> fn(args...), its tensor arguments checked to be on the CPU first.
template <typename R, typename... A>
void bind(pybind11::module_& m, const char* name, R (*fn)(A...)) {
  m.def(name, [name, fn](A... args) -> R {
    HANDLE_TH_ERRORS
    (check_cpu(name, args), ...);
    pybind11::gil_scoped_release no_gil;
    return fn(args...);
    END_HANDLE_TH_ERRORS_PYBIND
  });
}

}  // namespace
}  // namespace dlinfer_cpu

// What an ahead-of-time build (setup.py) was built from: "digest:torch version:isa"
// (build_flags.stamp), between markers that build.py finds in the file's bytes before loading it;
// empty in a just-in-time build.
#ifndef DLINFER_STAMP
#define DLINFER_STAMP ""
#endif
extern "C" __attribute__((used, visibility("default"))) const char dlinfer_cpu_stamp[] = "dlinfer-stamp[" DLINFER_STAMP "]dlinfer-stamp";

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace dlinfer_cpu;
  m.def("build_stamp", [] { return std::string(DLINFER_STAMP); });
#define DLINFER_CPU_BIND(name) bind(m, #name, &name);
  DLINFER_CPU_ENTRY_POINTS(DLINFER_CPU_BIND)
#undef DLINFER_CPU_BIND
}
