"""The cpu vendor: C++ kernels for the decode-time hot path on CPUs.

dlinfer's default on CPU tensors. Its kernels (`csrc/`, built on first use by `build.py`, bound to
the ops' signatures in `kernels.py`) cover what a decode step spends its time on: `linear` at few
rows (a weight-streaming matrix-vector kernel, float32 and bf16 / fp16; BLAS beyond 8 rows),
`paged_decode_attention` read
straight from the paged cache, `fill_kv_cache`, `rms_norm`, `add_rms_norm`, `apply_rotary_pos_emb`
and `silu_and_mul`, each one call instead of several torch ops, the W8A8 family (`dynamic_quant`,
`linear_w8a8` with an AVX-512 VNNI int8 kernel, the fused norm + quantisation ops,
`fused_moe_w8a8`), W4A16 `weight_quant_matmul` (on the layout its load-time `repack_weight_quant`
hook makes: k_interleaved, exact integer dot products on AVX-512 VNNI and AMX, where the CPU has
both, or for a bfloat16 model on VNNI and AVX512-BF16 the nibbles as bfloat16 integers against x
with vdpbf16ps, or for a bfloat16 model on an AVX2 build x as 16-bit integers per group;
column_tiled, 4-bit weights decoded to float32 in registers, elsewhere), flash-style
`prefill_attention` and `paged_prefill_attention` (the paged cache read in place) and the int8 KV
cache (read in the decode and paged prefill kernels). The float MoE ops, `linear_w8a8_static` and
`apply_rotary_pos_emb_interleaved` are the torch vendor's implementations, named as such in the
op table (no fallback warning: they are this vendor's choice). float32/bfloat16/float16, ALiBi,
both KV-cache layouts (the kernels read the caches as `kv_layouts.canonical` views).

When no C++ compiler can build the kernels, the vendor does not load (`python -m dlinfer env`
says why) and CPU ops run on the torch vendor.
"""

from dlinfer.vendor.base import (
    FEATURE_ALIBI,
    FEATURE_KV_QUANT,
    FEATURE_SLIDING_WINDOW,
    FEATURE_SOFTCAP,
    Capabilities,
    Vendor,
)
from dlinfer.vendor.kv_layouts import HEAD_MAJOR, TOKEN_MAJOR

NOTES = {
    "linear": "C++ at <= 8 rows, a weight-streaming kernel (each W row read once for all rows; on Intel CPUs "
              "with the AVX-512 build four far parts of each thread's rows side by side: "
              "DLINFER_CPU_WEIGHT_STREAMS; bf16 / fp16 at 5-8 rows on a Zen 1 CPU (AVX2): two passes of at "
              "most 4): float32, and "
              "bf16 / fp16 with the weights read as stored, fp32 sums, one rounding (bf16 on AVX512_BF16 "
              "vdpbf16ps where the CPU has it); otherwise the torch vendor's path (oneDNN / F.linear)",
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
    "dynamic_quant": "C++: one pass per row, fp32 amax / 127, round half to even (bit-identical to torch's)",
    "linear_w8a8": "C++: exact int8 product, AVX-512 VNNI (vpdpbusd, +128 offset and per-row correction) or "
                   "int16 vpmaddwd (AVX-512BW or AVX2) or portable at <= 8 rows, beyond that oneDNN's int8 GEMM "
                   "(torch._int_mm) with VNNI, else the same kernels over blocks of the weight; fp32 scales",
    "rms_norm_w8a8": "C++: this vendor's rms_norm row and its quantisation in one pass",
    "add_rms_norm_w8a8": "C++: residual add, rms_norm and quantisation in one pass",
    "fused_moe_w8a8": "C++: per active expert two exact int8 products (linear_w8a8's), fp32 epilogues, silu * up "
                      "and per-token quantisation fused between them",
    "weight_quant_matmul": "C++, two kernels by the load-time layout: k_interleaved (CPUs with VNNI and AMX): "
                           "exact int32 dot products of the nibbles with each group's activations as 31-bit "
                           "fixed point, VNNI at one row, AMX tiles beyond, one fp32 epilogue per group; "
                           "(bfloat16 models on VNNI + AVX512-BF16 without AMX): exact products q - z times x "
                           "by vdpbf16ps, fp32 sums, one decode per 4 rows; "
                           "column_tiled: dequantised in registers per 128-column tile, 8 rows per decode (4 on AVX2), "
                           "fp32 accumulation per group (beyond 4096 rows, 128 on AVX2, 1 on portable builds: "
                           "float32 blocks dequantised in C++, then BLAS); "
                           "DLINFER_CPU_W4_ACTIVATIONS=int8 (opt-in; k_interleaved on VNNI or AVX2): x quantised to "
                           "int8 per row and group, exact int32 sums (vpdpbusd, or vpmaddubsw + vpmaddwd), one fp32 "
                           "epilogue per group, one decode per 4 rows; =int16 (AVX2 builds, where auto, the default, "
                           "takes it for bfloat16 models; k_interleaved): x as 16-bit integers per row "
                           "and group (power-of-two step), exact int32 sums of int16 pairs (vpmaddwd; past 256 rows: "
                           "the dequantised weight by BLAS)",
    "linear_w8a8_static": "the torch vendor's (static-scale quantisation, exact int8 product + int32 bias, fp32 "
                          "dequant)",
    "apply_rotary_pos_emb_interleaved": "the torch vendor's (fp32 adjacent-pair rotation)",
    "prefill_attention": "C++: flash-style, (sequence, kv head, query tile) per item, GQA heads in one tile, "
                         "keys in chunks of 64, online softmax in fp32",
    "paged_prefill_attention": "C++: flash-style over the paged cache read in place (a block per chunk), "
                               "(sequence, kv head, query tile) per item, online softmax in fp32; int8 caches "
                               "widened per chunk, V dequantised there, K's scale folded into the query",
    "moe_gating_topk_softmax": "the torch vendor's (fp32 softmax + stable sort)",
    "fused_moe": "the torch vendor's (tokens sorted by expert, GEMMs through the torch vendor's linear)",
}


def load() -> Vendor:
    from dlinfer.vendor.cpu import build

    build.build()  # raises when the kernels cannot be built: the registry records why

    from dlinfer.vendor.cpu import graph_bindings, kernels, weight_quant
    from dlinfer.vendor.torch import moe as torch_moe
    from dlinfer.vendor.torch import quant as torch_quant
    from dlinfer.vendor.torch import rotary as torch_rotary

    ops = {
        "rms_norm": kernels.rms_norm,
        "add_rms_norm": kernels.add_rms_norm,
        "apply_rotary_pos_emb": kernels.apply_rotary_pos_emb,
        "fill_kv_cache": kernels.fill_kv_cache,
        "prefill_attention": kernels.prefill_attention,
        "paged_prefill_attention": kernels.paged_prefill_attention,
        "paged_decode_attention": kernels.paged_decode_attention,
        "moe_gating_topk_softmax": torch_moe.moe_gating_topk_softmax,
        "fused_moe": torch_moe.fused_moe,
        "silu_and_mul": kernels.silu_and_mul,
        "linear": kernels.linear,
        "dynamic_quant": kernels.dynamic_quant,
        "linear_w8a8": kernels.linear_w8a8,
        "rms_norm_w8a8": kernels.rms_norm_w8a8,
        "add_rms_norm_w8a8": kernels.add_rms_norm_w8a8,
        "fused_moe_w8a8": kernels.fused_moe_w8a8,
        "weight_quant_matmul": weight_quant.weight_quant_matmul,
        "linear_w8a8_static": torch_quant.linear_w8a8_static,
        "apply_rotary_pos_emb_interleaved": torch_rotary.apply_rotary_pos_emb_interleaved,
    }
    return Vendor(
        name="cpu",
        device_types=("cpu",),
        kv_layouts=(TOKEN_MAJOR, HEAD_MAJOR),
        ops=ops,
        capabilities=Capabilities(features=frozenset({FEATURE_ALIBI, FEATURE_KV_QUANT, FEATURE_SLIDING_WINDOW,
                                                     FEATURE_SOFTCAP}),
                                  notes=dict(NOTES)),
        repack_weight_quant=weight_quant.repack_weight_quant,
        graph_bindings=graph_bindings.BINDINGS,
    )
