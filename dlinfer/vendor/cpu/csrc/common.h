// Shared helpers of the cpu vendor's kernels.
//
// Vectors are ATen's at::vec::Vectorized<float> (AVX-512, AVX2, NEON or plain C++ by the
// CPU_CAPABILITY_* macro the build sets); every kernel computes in float32 and converts bf16/fp16
// on load and store, and is instantiated for the three dtypes with ATen's AT_DISPATCH_V2
// (scalar_t: float, c10::BFloat16, c10::Half). Threads come from ATen's at::parallel_for, i.e. the
// same OpenMP pool as every other torch op of the process; `grain_for` keeps small calls on the
// calling thread.
#pragma once

#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace dlinfer_cpu {

// New tensors: at::empty and at::zeros, defined in registrations.cpp. Their headers
// (<ATen/ops/empty.h>, and <torch/library.h> for the registrations) doubled the compile time of
// every kernel file that included them (~9.5 s of headers a file against ~5 s).
at::Tensor empty_tensor(at::IntArrayRef sizes, const at::TensorOptions& options);
at::Tensor zeros_tensor(at::IntArrayRef sizes, const at::TensorOptions& options);

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

// Work below this many bytes runs on the calling thread: waking the pool costs more than it saves.
constexpr int64_t kMinParallelBytes = 64 * 1024;

// Grain size for at::parallel_for(0, n, grain, fn) over `bytes` of work in all: n below min_bytes
// (parallel_for then calls fn(0, n) on the calling thread, as it does for any range no longer than
// its grain), else 1 (every thread of the pool gets an equal share of the n items).
inline int64_t grain_for(int64_t n, int64_t bytes, int64_t min_bytes = kMinParallelBytes) {
  return bytes < min_bytes ? std::max<int64_t>(n, 1) : 1;
}

// t itself when its last dim is dense (rows may be strided), else a contiguous copy: the kernels
// read rows through their strides but each row's elements one after the other. Done here rather
// than in Python, where the stride check alone would cost more than a small kernel call.
inline at::Tensor dense_rows(const at::Tensor& t) {
  return t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

// Full-vector load of kLanes elements as float32.
template <typename T>
inline Vec load_vec(const T* p) {
  Vec out;
  at::vec::load_to_float<T>(p, out);
  return out;
}
template <>
inline Vec load_vec<float>(const float* p) {
  return Vec::loadu(p);
}

// Full-vector store of kLanes float32 values as T (round to nearest even for bf16/fp16).
template <typename T>
inline void store_vec(T* p, const Vec& v) {
  at::vec::convert_from_float<T>(v, v).store(p, kLanes);
}
template <>
inline void store_vec<float>(float* p, const Vec& v) {
  v.store(p);
}

// v rounded to T and back (the value a float32 result has once stored in T), in registers; v
// itself for float.
template <typename T>
inline Vec round_to(const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v)));
  }
}

// n (< kLanes) values of p as float32, the missing lanes zero (a tail).
template <typename T>
inline Vec load_part(const T* p, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p, n);
  } else {
    T tmp[kLanes] = {};
    std::memcpy(tmp, p, n * sizeof(T));
    return load_vec(tmp);
  }
}

// n float32 values of `src` (any of the three dtypes) into `dst`.
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) load_vec(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// n float32 values of `src` into `dst` of dtype T.
template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store_vec(dst + i, Vec::loadu(src + i));
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// sum(a[i] * b[i]) over n float32 values, lane-wise partial sums then one tree reduction.
inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  if (i < n) acc = at::vec::fmadd(Vec::loadu(a + i, n - i), Vec::loadu(b + i, n - i), acc);
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
}

// y[i] += a * x[i] over n float32 values.
inline void axpy(float a, const float* x, float* y, int64_t n) {
  const Vec va(a);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) at::vec::fmadd(va, Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] += a * x[i];
}

// y[i] *= a over n float32 values.
inline void scale(float a, float* y, int64_t n) {
  const Vec va(a);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) (Vec::loadu(y + i) * va).store(y + i);
  for (; i < n; ++i) y[i] *= a;
}

// Reads element i of a 1-D int32/int64 tensor's data.
struct IndexReader {
  const void* data = nullptr;
  bool is64 = false;
  IndexReader() = default;
  explicit IndexReader(const at::Tensor& t) : data(t.data_ptr()), is64(t.scalar_type() == at::kLong) {
    TORCH_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, "index tensor must be int32/int64");
  }
  inline int64_t operator[](int64_t i) const {
    return is64 ? static_cast<const int64_t*>(data)[i] : static_cast<const int32_t*>(data)[i];
  }
};

}  // namespace dlinfer_cpu
