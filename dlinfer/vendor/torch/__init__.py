"""The torch vendor: every op in plain PyTorch, on any device.

It is dlinfer's CPU path and the fallback for ops another vendor lacks. Batched tensor code
throughout; where a loop remains it runs per sequence (prefill attention) or per expert
(fused_moe), never per token, and reads lengths on the host (a device sync off the CPU).
"""

from dlinfer.vendor.base import (
    FEATURE_ALIBI,
    FEATURE_KV_QUANT,
    FEATURE_SLIDING_WINDOW,
    FEATURE_SOFTCAP,
    HEAD_MAJOR,
    TOKEN_MAJOR,
    Capabilities,
    Vendor,
)


def load() -> Vendor:
    from dlinfer.vendor.torch import activation, attention, kv_cache, linear, moe, norm, quant, rotary, weight_quant

    ops = {
        "rms_norm": norm.rms_norm,
        "add_rms_norm": norm.add_rms_norm,
        "apply_rotary_pos_emb": rotary.apply_rotary_pos_emb,
        "fill_kv_cache": kv_cache.fill_kv_cache,
        "prefill_attention": attention.prefill_attention,
        "paged_prefill_attention": attention.paged_prefill_attention,
        "paged_decode_attention": attention.paged_decode_attention,
        "moe_gating_topk_softmax": moe.moe_gating_topk_softmax,
        "fused_moe": moe.fused_moe,
        "silu_and_mul": activation.silu_and_mul,
        "linear": linear.linear,
        "dynamic_quant": quant.dynamic_quant,
        "linear_w8a8": quant.linear_w8a8,
        "linear_w8a8_static": quant.linear_w8a8_static,
        "apply_rotary_pos_emb_interleaved": rotary.apply_rotary_pos_emb_interleaved,
        "rms_norm_w8a8": quant.rms_norm_w8a8,
        "add_rms_norm_w8a8": quant.add_rms_norm_w8a8,
        "weight_quant_matmul": weight_quant.weight_quant_matmul,
        "fused_moe_w8a8": quant.fused_moe_w8a8,
    }
    notes = {
        "prefill_attention": "scaled_dot_product_attention per sequence",
        "paged_prefill_attention": "per-sequence block gather + scaled_dot_product_attention",
        "paged_decode_attention": "batched per-token block gather + one scaled_dot_product_attention",
        "fused_moe": "tokens sorted by expert, one GEMM pair per active expert",
        "weight_quant_matmul": "weight dequantised to float32 in column tiles, then a float32 matmul",
        "linear_w8a8": "int8 product as an exact float64 matmul, scales in float32",
        "fused_moe_w8a8": "tokens sorted by expert; per active expert two int8 products (exact float64 matmuls), "
                          "float32 scaling and activation",
        "linear": "float32 on CPU: oneDNN inner product (DLINFER_CPU_LINEAR=aten: F.linear); else F.linear",
    }
    return Vendor(
        name="torch",
        device_types=("*",),
        kv_layouts=(TOKEN_MAJOR, HEAD_MAJOR),
        ops=ops,
        capabilities=Capabilities(features=frozenset({FEATURE_ALIBI, FEATURE_KV_QUANT, FEATURE_SLIDING_WINDOW,
                                                     FEATURE_SOFTCAP}),
                                  notes=notes),
    )
