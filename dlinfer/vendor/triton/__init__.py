"""The triton vendor: every op a Triton kernel, except `linear` (the platform matmul).

Runs on CUDA; also on CPU tensors under TRITON_INTERPRET=1 (Triton's interpreter: correct but
~300x slower than torch, used by CI on small shapes). Both KV-cache layouts. One op family per
file: norm, rotary, kv_cache, activation, moe, linear, quant (W8A8), moe_w8a8, and attention
(attention.py, with its kernels in attention_prefill.py and attention_decode.py).
"""

import torch

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

NOTES = {
    "rms_norm": "Triton: one program per row, fp32 statistics, HF Llama order (cast, then weight)",
    "add_rms_norm": "Triton: residual add fused into the rms_norm pass; both outputs written once",
    "apply_rotary_pos_emb": "Triton: q and k in one launch, fp32 rotate-half, partial rotary copies dims R..D",
    "fill_kv_cache": "Triton: per-token row copy into either layout, int64 offsets, bad slots masked, no host sync; "
                     "int8 caches quantised in registers (IEEE division, ties to even)",
    "prefill_attention": "Triton: varlen causal flash attention over packed K/V (attention_prefill.py)",
    "paged_prefill_attention": "Triton: the prefill kernel with keys read through the block table",
    "paged_decode_attention": "Triton: split-KV flash-decoding + log-sum-exp reduction (attention_decode.py); "
                              "int8 caches dequantised in registers, dots in fp32",
    "silu_and_mul": "Triton: fused fp32 silu(gate) * up, one rounding",
    "moe_gating_topk_softmax": "Triton: fused fp32 softmax + iterative arg-max top-k (ties to the lower id)",
    "fused_moe": "Triton: on-device expert sort/align, grouped tl.dot GEMMs with SiLU-and-mul fused into "
                 "the gate/up epilogue, fp32 weighted combine; no host sync",
    "dynamic_quant": "Triton: one program per row, fp32 amax / 127, correctly rounded division, half to even",
    "linear_w8a8": "Triton: int8 tiles into tl.dot(out_dtype=int32) (exact), fp32 scale epilogue",
    "rms_norm_w8a8": "Triton: the rms_norm row and its quantisation in one program",
    "add_rms_norm_w8a8": "Triton: residual add, rms_norm and quantisation in one program",
    "fused_moe_w8a8": "Triton: fused_moe's expert sort/align and combine around int8 tl.dot GEMMs; x and "
                      "silu(gate) * up quantised per row in between; no host sync",
    "weight_quant_matmul": "Triton: nibbles unpacked in the kernel (either layout), fp32 W tiles, IEEE fp32 tl.dot",
    "linear_w8a8_static": "the torch vendor's (static-scale quantisation, exact int8 product + int32 bias, fp32 "
                          "dequant)",
    "apply_rotary_pos_emb_interleaved": "the torch vendor's (fp32 adjacent-pair rotation)",
    "linear": "not a Triton kernel: torch.nn.functional.linear, i.e. the platform matmul (cuBLAS on CUDA)",
}


def load() -> Vendor:
    import triton  # noqa: F401  (ImportError when Triton is missing: the registry records why)

    from dlinfer.vendor.torch import quant as torch_quant
    from dlinfer.vendor.torch import rotary as torch_rotary
    from dlinfer.vendor.triton import (
        activation,
        attention,
        kv_cache,
        linear,
        moe,
        moe_w8a8,
        norm,
        quant,
        rotary,
        weight_quant,
    )
    from dlinfer.vendor.triton._common import INTERPRET

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
        "rms_norm_w8a8": quant.rms_norm_w8a8,
        "add_rms_norm_w8a8": quant.add_rms_norm_w8a8,
        "fused_moe_w8a8": moe_w8a8.fused_moe_w8a8,
        "weight_quant_matmul": weight_quant.weight_quant_matmul,
        "linear_w8a8_static": torch_quant.linear_w8a8_static,
        "apply_rotary_pos_emb_interleaved": torch_rotary.apply_rotary_pos_emb_interleaved,
    }
    # The interpreter runs the kernels on CPU tensors.
    device_types = ("cuda", "cpu") if INTERPRET else ("cuda",)
    return Vendor(
        name="triton",
        device_types=device_types,
        kv_layouts=(TOKEN_MAJOR, HEAD_MAJOR),
        ops=ops,
        capabilities=Capabilities(
            dtypes=(torch.float32, torch.float16, torch.bfloat16),
            head_dims=None,
            features=frozenset({FEATURE_ALIBI, FEATURE_KV_QUANT, FEATURE_SLIDING_WINDOW, FEATURE_SOFTCAP}),
            notes=dict(NOTES),
        ),
    )
