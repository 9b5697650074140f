// The cpu vendor's kernel entry points: the functions csrc/*.cpp define, registrations.cpp registers
// as torch.ops.dlinfer_cpu.* and bindings.cpp binds as functions of the extension module, which
// kernels.py and weight_quant.py call (no dispatcher: see bindings.cpp). Every tensor is a CPU
// tensor; shapes and dtypes are checked inside and documented at each definition. T tokens, N rows,
// H hidden size, Hq / Hkv heads, D head size, NB blocks of BS slots, g the 4-bit group size.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace dlinfer_cpu {

// activation.cpp: x [N, 2I] -> silu(x[:, :I]) * x[:, I:]  [N, I].
at::Tensor silu_and_mul(const at::Tensor& x);

// norm.cpp: [N, H] rows, weight [H] (float32 or the rows' dtype).
at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& hidden, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);

// rotary.cpp: query [T, Hq, D], key [T, Hkv, D], cos / sin [T, R] -> new (q, k).
std::tuple<at::Tensor, at::Tensor> apply_rotary_pos_emb(const at::Tensor& query, const at::Tensor& key,
                                                        const at::Tensor& cos, const at::Tensor& sin);

// kv_cache.cpp: key / value [T, Hkv, D] into the canonical caches [NB, BS, Hkv, D] at slots
// kv_indices [T], in place; with scales (float32 [Hkv]) the caches are int8.
void fill_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& kv_indices,
                   const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& k_zero,
                   const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& v_zero);

// attention.cpp: one query token per sequence, written into out [T, Hq, Dv].
void paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_table, const at::Tensor& cu_seqlens_q,
                            const at::Tensor& kv_seq_len, int64_t max_kv_seq_len, double softmax_scale,
                            const std::optional<at::Tensor>& alibi_slopes, const at::Tensor& out,
                            const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                            const std::optional<at::Tensor>& v_zero, const std::optional<at::Tensor>& k_zero,
                            int64_t sliding_window, double logit_softcapping);

// prefill_attention.cpp: causal attention over packed sequences, written into out.
void prefill_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& cu_seqlens_q, double softmax_scale,
                       const std::optional<at::Tensor>& alibi_slopes, const at::Tensor& out,
                       int64_t sliding_window, double logit_softcapping);
void paged_prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_table, const at::Tensor& cu_seqlens_q,
                             const at::Tensor& kv_seq_len, double softmax_scale,
                             const std::optional<at::Tensor>& alibi_slopes, const at::Tensor& out,
                             const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                             const std::optional<at::Tensor>& v_zero, const std::optional<at::Tensor>& k_zero,
                             int64_t sliding_window, double logit_softcapping);

// linear.cpp / linear_16bit.cpp: x [M, K] @ weight [N, K]^T (+ bias [N]) at few rows.
at::Tensor linear_few_rows(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
at::Tensor linear_few_rows_16bit(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                 int64_t path);

// quant_w8.cpp: the W8A8 family.
std::tuple<at::Tensor, at::Tensor> dynamic_quant(const at::Tensor& x);
std::tuple<at::Tensor, at::Tensor> rms_norm_w8a8(const at::Tensor& hidden, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_w8a8(const at::Tensor& hidden, const at::Tensor& residual,
                                                                 const at::Tensor& weight, double eps);
at::Tensor int8_matmul(const at::Tensor& a, const at::Tensor& b, int64_t path);
at::Tensor linear_w8a8(const at::Tensor& a, const at::Tensor& b, const at::Tensor& rms_scale,
                       const at::Tensor& linear_scale, at::ScalarType out_dtype,
                       const std::optional<at::Tensor>& bias, int64_t path);

// moe_w8.cpp: top-k routed int8 experts.
at::Tensor fused_moe_w8a8(const at::Tensor& hidden, const at::Tensor& gate_up, const at::Tensor& gate_up_scales,
                          const at::Tensor& down, const at::Tensor& down_scales, const at::Tensor& topk_weights,
                          const at::Tensor& topk_ids, bool renormalize);

// quant_w4.cpp / quant_w4_tiles.cpp: W4A16 (layouts in quant_w4.h).
at::Tensor w4_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                     const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& bias,
                     int64_t group_size);
at::Tensor w4_dequantise_tiles(const at::Tensor& qweight, const at::Tensor& scale,
                               const std::optional<at::Tensor>& offset, int64_t group_size, int64_t t0, int64_t t1);
at::Tensor w4_column_tiled(const at::Tensor& qweight);

// quant_w4_int.cpp: W4A16 on the k_interleaved layout (path: -1 the best this CPU runs; the digit
// paths 0 portable, 1 VNNI, 2 AMX, exact integer dot products with the same bits; 3 bfloat16 x on
// AVX512-BF16, float32 sums; asked for only, quant_w4_a8.cpp: 4, x as 8-bit bytes per row and group
// on VNNI or AVX2; 5, x as 16-bit integers per row and group on AVX2).
at::Tensor w4_k_interleaved(const at::Tensor& qweight, const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                            int64_t group_size);
at::Tensor w4_matmul_k_interleaved(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                                   const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& bias,
                                   int64_t group_size, int64_t path);
// quant_w4_ki_tiles.cpp: a k_interleaved weight's float32 tiles t0..t1, [K, (t1 - t0) * 64].
at::Tensor w4_ki_dequantise_tiles(const at::Tensor& qweight, int64_t N, int64_t group_size, int64_t t0, int64_t t1);
bool w4_vnni_available();
bool w4_int8_activations_available();  // path 4: VNNI on an AVX-512 build, or an AVX2 build
bool w4_int16_activations_available();  // path 5: an AVX2 build
bool w4_amx_available();
bool w4_bf16_dot_available();

// read_probe.cpp: reads buffer (uint8 [n]) once on `threads` threads, `streams` streams each; the
// checksum of its bytes.
int64_t read_probe(const at::Tensor& buffer, int64_t threads, int64_t streams, int64_t prefetch_bytes, int64_t hint);

// Every entry point above, once: bindings.cpp binds each as a function of the extension module
// (tests/vendor/test_cpu_bindings.py checks the list against the declarations). A new kernel: its
// .cpp in csrc/ (build.py compiles every one), its declaration here, its name in this list, its
// schema in registrations.cpp.
#define DLINFER_CPU_ENTRY_POINTS(X) \
  X(silu_and_mul) \
  X(rms_norm) \
  X(add_rms_norm) \
  X(apply_rotary_pos_emb) \
  X(fill_kv_cache) \
  X(paged_decode_attention) \
  X(prefill_attention) \
  X(paged_prefill_attention) \
  X(linear_few_rows) \
  X(linear_few_rows_16bit) \
  X(dynamic_quant) \
  X(rms_norm_w8a8) \
  X(add_rms_norm_w8a8) \
  X(int8_matmul) \
  X(linear_w8a8) \
  X(fused_moe_w8a8) \
  X(w4_matmul) \
  X(w4_dequantise_tiles) \
  X(w4_column_tiled) \
  X(w4_k_interleaved) \
  X(w4_matmul_k_interleaved) \
  X(w4_ki_dequantise_tiles) \
  X(w4_vnni_available) \
  X(w4_int8_activations_available) \
  X(w4_int16_activations_available) \
  X(w4_amx_available) \
  X(w4_bf16_dot_available) \
  X(read_probe)

// Facts of the kernels that tests and tools read through torch.ops.dlinfer_cpu only (registrations.cpp),
// not kernels: the split rule of the decode attention (attention.cpp), the most rows the few-row
// linears and the W4 register kernel take (linear.cpp, quant_w4.cpp), and the paths the 16-bit linear
// and the int8 GEMM take when asked for none (linear_16bit.cpp, int8_gemm.cpp).
int64_t decode_num_splits(int64_t tokens, int64_t kv_heads, int64_t longest, int64_t block_size, int64_t threads);
int64_t linear_max_rows();
int64_t linear_16bit_best_path();
int64_t w4_max_rows();
int64_t int8_best_path();

}  // namespace dlinfer_cpu
