"""The cpu vendor: C++ kernels for the decode-time hot path on CPUs.

dlinfer's default on CPU tensors. Its kernels (`csrc/`, built on first use by `build.py`, bound to
the ops' signatures in `kernels.py`) cover what a decode step spends its time on: `linear` at few
rows (a weight-streaming matrix-vector kernel; BLAS beyond 8 rows), `paged_decode_attention` read
straight from the paged cache, `fill_kv_cache`, `rms_norm`, `add_rms_norm`, `apply_rotary_pos_emb`
and `silu_and_mul`, each one call instead of several torch ops. Prefill attention, the MoE ops
and the W8A8 ops are the torch vendor's implementations, named as such in the op table (no
fallback warning: they are this vendor's choice). float32/bfloat16/float16, ALiBi, the int8 KV
cache, both KV-cache layouts (the kernels read the caches as `kv_layouts.canonical` views).

When no C++ compiler can build the kernels, the vendor does not load (`python -m dlinfer env`
says why) and CPU ops run on the torch vendor.
"""

from dlinfer.vendor.base import FEATURE_ALIBI, FEATURE_KV_QUANT, Capabilities, Vendor
from dlinfer.vendor.kv_layouts import HEAD_MAJOR, TOKEN_MAJOR

NOTES = {
    "linear": "C++: float32 at <= 8 rows, a weight-streaming kernel (each W row read once for all rows); "
              "otherwise the torch vendor's path (oneDNN / F.linear)",
    "paged_decode_attention": "C++: reads the paged cache in place, (token, kv head[, split]) per thread, "
                              "GQA heads share each K/V row, online softmax in fp32, split-KV when the batch is small; "
                              "int8 caches read in place, widened to fp32 in registers, scales applied per head "
                              "outside the key loops",
    "fill_kv_cache": "C++: one row copy per (token, head), slots outside the cache skipped; int8 caches: "
                     "each element quantised (IEEE division, ties to even)",
    "rms_norm": "C++: one pass per row, fp32 statistics, HF Llama order",
    "add_rms_norm": "C++: residual add fused into the rms_norm pass",
    "apply_rotary_pos_emb": "C++: q and k in one call, fp32 rotate-half, partial rotary",
    "silu_and_mul": "C++: fused fp32 silu(gate) * up",
    "dynamic_quant": "the torch vendor's (fp32 amax / 127, round half to even)",
    "linear_w8a8": "the torch vendor's (int8 product as an exact float64 matmul, fp32 scales)",
    "linear_w8a8_static": "the torch vendor's (static-scale quantisation, exact int8 product + int32 bias, fp32 "
                          "dequant)",
    "apply_rotary_pos_emb_interleaved": "the torch vendor's (fp32 adjacent-pair rotation)",
    "rms_norm_w8a8": "the torch vendor's (its rms_norm, then dynamic_quant)",
    "add_rms_norm_w8a8": "the torch vendor's (its add_rms_norm, then dynamic_quant)",
    "prefill_attention": "the torch vendor's (scaled_dot_product_attention per sequence)",
    "paged_prefill_attention": "the torch vendor's (per-sequence block gather + scaled_dot_product_attention; "
                               "an int8 cache dequantised per gathered sequence)",
    "moe_gating_topk_softmax": "the torch vendor's (fp32 softmax + stable sort)",
    "fused_moe": "the torch vendor's (tokens sorted by expert, GEMMs through the torch vendor's linear)",
}


def load() -> Vendor:
    from dlinfer.vendor.cpu import build

    build.build()  # raises when the kernels cannot be built: the registry records why

    from dlinfer.vendor.cpu import kernels
    from dlinfer.vendor.torch import attention as torch_attention
    from dlinfer.vendor.torch import moe as torch_moe
    from dlinfer.vendor.torch import quant as torch_quant
    from dlinfer.vendor.torch import rotary as torch_rotary

    ops = {
        "rms_norm": kernels.rms_norm,
        "add_rms_norm": kernels.add_rms_norm,
        "apply_rotary_pos_emb": kernels.apply_rotary_pos_emb,
        "fill_kv_cache": kernels.fill_kv_cache,
        "prefill_attention": torch_attention.prefill_attention,
        "paged_prefill_attention": torch_attention.paged_prefill_attention,
        "paged_decode_attention": kernels.paged_decode_attention,
        "moe_gating_topk_softmax": torch_moe.moe_gating_topk_softmax,
        "fused_moe": torch_moe.fused_moe,
        "silu_and_mul": kernels.silu_and_mul,
        "linear": kernels.linear,
        # W8A8: the torch vendor's functions, by choice (no fallback warning; see NOTES).
        "dynamic_quant": torch_quant.dynamic_quant,
        "linear_w8a8": torch_quant.linear_w8a8,
        "linear_w8a8_static": torch_quant.linear_w8a8_static,
        "apply_rotary_pos_emb_interleaved": torch_rotary.apply_rotary_pos_emb_interleaved,
        "rms_norm_w8a8": torch_quant.rms_norm_w8a8,
        "add_rms_norm_w8a8": torch_quant.add_rms_norm_w8a8,
    }
    return Vendor(
        name="cpu",
        device_types=("cpu",),
        kv_layouts=(TOKEN_MAJOR, HEAD_MAJOR),
        ops=ops,
        capabilities=Capabilities(features=frozenset({FEATURE_ALIBI, FEATURE_KV_QUANT}), notes=dict(NOTES)),
    )
