// fill_kv_cache: copy each new token's key / value rows into its cache slot.
//
// key / value [T, H, D]; the caches come as [NB, BS, H, D] views (dlinfer/vendor/kv_layouts.py
// `canonical`: the cache itself for token_major, a permuted view for head_major) and are written
// through their strides. Slot s = block * BS + offset. A slot outside [0, NB * BS) is skipped, so
// bad metadata never writes outside the cache. One row of D elements per (token, head): a memcpy
// each, or, into an int8 cache (scale / zero [H] float32 given), each element quantised as
// clamp(round_half_even(x / scale[h] + zero[h]), -128, 127): an IEEE float32 division (the build
// has no fast-math), a float32 addition, std::nearbyint in the default rounding mode (ties to
// even); NaN stores 0 (dlinfer/ops/kv_quant.py).
#include "common.h"
#include "entry_points.h"

#include <cmath>

namespace dlinfer_cpu {
namespace {

void fill_one(const at::Tensor& src, const at::Tensor& cache, const IndexReader& slots) {
  const int64_t T = src.size(0), H = src.size(1), D = src.size(2);
  const int64_t NB = cache.size(0), BS = cache.size(1);
  const int64_t c_block = cache.stride(0), c_pos = cache.stride(1), c_head = cache.stride(2);
  const int64_t s_tok = src.stride(0), s_head = src.stride(1);
  const int64_t item = cache.element_size();
  const char* sp = static_cast<const char*>(src.data_ptr());
  char* cp = static_cast<char*>(cache.data_ptr());
  const int64_t limit = NB * BS;
  auto copy_tokens = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0 || slot >= limit) continue;
      const int64_t base = (slot / BS) * c_block + (slot % BS) * c_pos;
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(cp + (base + h * c_head) * item, sp + (t * s_tok + h * s_head) * item, D * item);
    }
  };
  at::parallel_for(0, T, grain_for(T, T * H * D * item), copy_tokens);
}

inline int8_t quantise(float y) {
  if (!(y == y)) return 0;
  return static_cast<int8_t>(std::min(std::max(std::nearbyint(y), -128.f), 127.f));
}

template <typename T>
void fill_quantised(const at::Tensor& src, const at::Tensor& cache, const IndexReader& slots, const at::Tensor& scale,
                    const at::Tensor& zero) {
  const int64_t T_ = src.size(0), H = src.size(1), D = src.size(2);
  const int64_t NB = cache.size(0), BS = cache.size(1);
  const int64_t c_block = cache.stride(0), c_pos = cache.stride(1), c_head = cache.stride(2);
  const int64_t s_tok = src.stride(0), s_head = src.stride(1);
  const T* sp = src.data_ptr<T>();
  int8_t* cp = cache.data_ptr<int8_t>();
  const float* sc = scale.data_ptr<float>();
  const float* zp = zero.data_ptr<float>();
  const int64_t limit = NB * BS;
  at::parallel_for(0, T_, grain_for(T_, T_ * H * D * 4), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0 || slot >= limit) continue;
      const int64_t base = (slot / BS) * c_block + (slot % BS) * c_pos;
      for (int64_t h = 0; h < H; ++h) {
        const T* row = sp + t * s_tok + h * s_head;
        int8_t* dst = cp + base + h * c_head;
        const float s = sc[h], z = zp[h];
        for (int64_t d = 0; d < D; ++d) dst[d] = quantise(static_cast<float>(row[d]) / s + z);
      }
    }
  });
}

void check_quant(const at::Tensor& t, int64_t H) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == H,
              "fill_kv_cache: scales and zeros must be float32 [H]");
}

}  // namespace

void fill_kv_cache(const at::Tensor& key_in, const at::Tensor& value_in, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& kv_indices,
                   const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& k_zero,
                   const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& v_zero) {
  const at::Tensor key = dense_rows(key_in), value = dense_rows(value_in);
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4, "ranks");
  const bool int8 = k_scale.has_value();
  TORCH_CHECK(int8 ? key_cache.scalar_type() == at::kChar && value_cache.scalar_type() == at::kChar &&
                         value.scalar_type() == key.scalar_type()
                   : key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type(),
              "fill_kv_cache: key/value and cache dtypes must match (int8 caches with scales)");
  // A ValueError; the Python wrapper (kernels.py, _rows_dense) sends such caches to the torch vendor first.
  TORCH_CHECK_VALUE(key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
                    "fill_kv_cache: the last dim of the caches must be dense");
  TORCH_CHECK(key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2) &&
                  value_cache.size(2) == value.size(1) && value_cache.size(3) == value.size(2),
              "fill_kv_cache: the caches must be [NB, BS, H, D] views matching key / value [T, H, D]");
  TORCH_CHECK(kv_indices.dim() == 1 && kv_indices.is_contiguous() && kv_indices.size(0) == key.size(0) &&
                  value.size(0) == key.size(0), "fill_kv_cache: kv_indices [T] for key / value [T, ...]");
  IndexReader slots(kv_indices);
  if (int8) {
    TORCH_CHECK(k_zero.has_value() && v_scale.has_value() && v_zero.has_value(), "fill_kv_cache: scales and zeros");
    for (const at::Tensor* t : {&*k_scale, &*k_zero}) check_quant(*t, key.size(1));
    for (const at::Tensor* t : {&*v_scale, &*v_zero}) check_quant(*t, value.size(1));
    AT_DISPATCH_V2(key.scalar_type(), "fill_kv_cache", AT_WRAP([&] {
                     fill_quantised<scalar_t>(key, key_cache, slots, *k_scale, *k_zero);
                     fill_quantised<scalar_t>(value, value_cache, slots, *v_scale, *v_zero);
                   }),
                   at::kFloat, at::kBFloat16, at::kHalf);
    return;
  }
  fill_one(key, key_cache, slots);
  fill_one(value, value_cache, slots);
}

}  // namespace dlinfer_cpu
