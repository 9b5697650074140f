// The kernels as torch.ops.dlinfer_cpu.* (schemas and CPU implementations; the functions are
// declared in entry_points.h and defined in the file each comment names), and the allocation
// helpers of common.h. The only file of the build that includes <torch/library.h> and
// <ATen/ops/empty.h>: each adds ~4 s to a file's compile, once here instead of in every kernel file.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "common.h"
#include "entry_points.h"
#include "few_rows_walk.h"

namespace dlinfer_cpu {

at::Tensor empty_tensor(at::IntArrayRef sizes, const at::TensorOptions& options) { return at::empty(sizes, options); }
at::Tensor zeros_tensor(at::IntArrayRef sizes, const at::TensorOptions& options) { return at::zeros(sizes, options); }

TORCH_LIBRARY_FRAGMENT(dlinfer_cpu, m) {
  // activation.cpp
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  // attention.cpp
  m.def(
      "paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
      "Tensor cu_seqlens_q, Tensor kv_seq_len, int max_kv_seq_len, float softmax_scale, Tensor? alibi_slopes, "
      "Tensor(a!) out, Tensor? k_scale=None, Tensor? v_scale=None, Tensor? v_zero=None, Tensor? k_zero=None, "
      "int sliding_window=0, float logit_softcapping=0.0) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
  m.def("decode_num_splits(int tokens, int kv_heads, int longest, int block_size, int threads) -> int",
        &decode_num_splits);
  // few_rows_walk.cpp
  m.def("weight_streams() -> int", &weight_streams);
  m.def("default_weight_streams() -> int", &default_weight_streams);
  m.def("set_weight_streams(int streams) -> ()", &set_weight_streams);
  // kv_cache.cpp
  m.def(
      "fill_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor kv_indices, "
      "Tensor? k_scale=None, Tensor? k_zero=None, Tensor? v_scale=None, Tensor? v_zero=None) -> ()");
  m.impl("fill_kv_cache", c10::DispatchKey::CPU, &fill_kv_cache);
  // linear.cpp
  m.def("linear_few_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("linear_few_rows", c10::DispatchKey::CPU, &linear_few_rows);
  m.def("max_few_rows() -> int", &linear_max_rows);
  // linear_16bit.cpp
  m.def("linear_few_rows_16bit(Tensor x, Tensor weight, Tensor? bias, int path=-1) -> Tensor");
  m.impl("linear_few_rows_16bit", c10::DispatchKey::CPU, &linear_few_rows_16bit);
  m.def("linear_16bit_best_path() -> int", &linear_16bit_best_path);
  // moe_w8.cpp
  m.def("fused_moe_w8a8(Tensor hidden_states, Tensor gate_up_weights, Tensor gate_up_scales, Tensor down_weights, "
        "Tensor down_scales, Tensor topk_weights, Tensor topk_ids, bool renormalize) -> Tensor");
  m.impl("fused_moe_w8a8", c10::DispatchKey::CPU, &fused_moe_w8a8);
  // norm.cpp
  m.def("rms_norm(Tensor hidden_states, Tensor weight, float epsilon) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def("add_rms_norm(Tensor hidden_states, Tensor residual, Tensor weight, float epsilon) -> (Tensor, Tensor)");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  // prefill_attention.cpp
  m.def(
      "prefill_attention(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, float softmax_scale, "
      "Tensor? alibi_slopes, Tensor(a!) out, int sliding_window=0, float logit_softcapping=0.0) -> ()");
  m.impl("prefill_attention", c10::DispatchKey::CPU, &prefill_attention);
  m.def(
      "paged_prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
      "Tensor cu_seqlens_q, Tensor kv_seq_len, float softmax_scale, Tensor? alibi_slopes, Tensor(a!) out, "
      "Tensor? k_scale=None, Tensor? v_scale=None, Tensor? v_zero=None, Tensor? k_zero=None, "
      "int sliding_window=0, float logit_softcapping=0.0) -> ()");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, &paged_prefill_attention);
  // quant_w4.cpp
  m.def("w4_matmul(Tensor x, Tensor qweight, Tensor scale, Tensor? offset, Tensor? bias, int group_size) "
        "-> Tensor");
  m.impl("w4_matmul", c10::DispatchKey::CPU, &w4_matmul);
  m.def("w4_max_rows() -> int", &w4_max_rows);
  // quant_w4_int.cpp
  m.def("w4_k_interleaved(Tensor qweight, Tensor scale, Tensor? offset, int group_size) -> Tensor");
  m.impl("w4_k_interleaved", c10::DispatchKey::CPU, &w4_k_interleaved);
  m.def("w4_matmul_k_interleaved(Tensor x, Tensor qweight, Tensor scale, Tensor? offset, Tensor? bias, int group_size, "
        "int path=-1) -> Tensor");
  m.impl("w4_matmul_k_interleaved", c10::DispatchKey::CPU, &w4_matmul_k_interleaved);
  m.def("w4_vnni_available() -> bool", &w4_vnni_available);
  m.def("w4_int8_activations_available() -> bool", &w4_int8_activations_available);
  m.def("w4_int16_activations_available() -> bool", &w4_int16_activations_available);
  m.def("w4_amx_available() -> bool", &w4_amx_available);
  m.def("w4_bf16_dot_available() -> bool", &w4_bf16_dot_available);
  // quant_w4_ki_tiles.cpp
  m.def("w4_ki_dequantise_tiles(Tensor qweight, int N, int group_size, int t0, int t1) -> Tensor");
  m.impl("w4_ki_dequantise_tiles", c10::DispatchKey::CPU, &w4_ki_dequantise_tiles);
  // quant_w4_tiles.cpp
  m.def("w4_dequantise_tiles(Tensor qweight, Tensor scale, Tensor? offset, int group_size, int t0, int t1) -> Tensor");
  m.impl("w4_dequantise_tiles", c10::DispatchKey::CPU, &w4_dequantise_tiles);
  m.def("w4_column_tiled(Tensor qweight) -> Tensor");
  m.impl("w4_column_tiled", c10::DispatchKey::CPU, &w4_column_tiled);
  // quant_w8.cpp
  m.def("dynamic_quant(Tensor x) -> (Tensor, Tensor)");
  m.impl("dynamic_quant", c10::DispatchKey::CPU, &dynamic_quant);
  m.def("rms_norm_w8a8(Tensor hidden_states, Tensor weight, float epsilon) -> (Tensor, Tensor)");
  m.impl("rms_norm_w8a8", c10::DispatchKey::CPU, &rms_norm_w8a8);
  m.def("add_rms_norm_w8a8(Tensor hidden_states, Tensor residual, Tensor weight, float epsilon) "
        "-> (Tensor, Tensor, Tensor)");
  m.impl("add_rms_norm_w8a8", c10::DispatchKey::CPU, &add_rms_norm_w8a8);
  m.def("int8_matmul(Tensor a, Tensor b, int path=-1) -> Tensor");
  m.impl("int8_matmul", c10::DispatchKey::CPU, &int8_matmul);
  m.def("linear_w8a8(Tensor a, Tensor b, Tensor rms_scale, Tensor linear_scale, ScalarType out_dtype, "
        "Tensor? bias, int path=-1) -> Tensor");
  m.impl("linear_w8a8", c10::DispatchKey::CPU, &linear_w8a8);
  m.def("int8_best_path() -> int", &int8_best_path);
  // read_probe.cpp
  m.def("read_probe(Tensor buffer, int threads, int streams, int prefetch_bytes, int hint) -> int");
  m.impl("read_probe", c10::DispatchKey::CPU, &read_probe);
  // rotary.cpp
  m.def("apply_rotary_pos_emb(Tensor query, Tensor key, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.impl("apply_rotary_pos_emb", c10::DispatchKey::CPU, &apply_rotary_pos_emb);
}

}  // namespace dlinfer_cpu
