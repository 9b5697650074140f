"""The one tolerance table: the op parity tests (tests/ops), `python -m dlinfer replay` and
DLINFER_OP_COMPARE all read it (docs/tools.md, "Tolerances").

Outputs are compared with an fp64 reference: |out - ref| <= atol + rtol * |ref|, inputs scaled so
that outputs are O(1). Bounds are multiples of the dtype's machine epsilon (spacing at 1:
fp32 2**-23, fp16 2**-10, bf16 2**-7), measured against plain correct implementations (fp32
accumulation, one rounding per stored intermediate) with about 2x margin:

- half types: every op family needs ~1 eps (the final rounding, plus the rounding of a stored
  intermediate: the normalised value of rms_norm, silu(gate) of silu_and_mul, the probabilities
  of attention); allowed 2 eps.
- float32: elementwise ops (rotary, silu_and_mul) need ~1 eps -> 4 eps; reductions (norms over
  H, attention over keys, linear / MoE over K) accumulate rounding in float32: 5-9 eps seen
  for K = 4096 -> 32 eps (3.8e-6). TF32 matmuls would not pass: the contract says float32.

Exact ops (fill_kv_cache, top-k ids, the add of add_rms_norm) are compared for equality, not here
(`EXACT_RESULTS`; integer results are always compared for equality).

Real data (the tools: replay, DLINFER_OP_COMPARE). The table's atol is the error allowed where
the terms an output element sums have a total magnitude of about 1, as in the tests' scaled
inputs. A model's activations are not scaled: a linear's inputs may reach 1e3 and its outputs
cancel, and a correct float32 sum is then off by up to ~20 eps * sum|x_k * w_k| (measured on
SmolLM2-135M) while the output is small. So for the reductions in `SCALED_OPERANDS` the tools
allow atol * max(1, S_i) + rtol * |ref_i|, where S_i is the op rerun by the torch vendor in
float64 on the absolute values of the named operands (for linear S = |x| @ |w|^T + |b|; for
attention the output over |V|): the classic componentwise error bound of a sum. This catches
what such tools are for (a wrong index, layout, scale or dtype; NaN), not the last eps of
accumulation precision, which the op tests check on controlled inputs.

A replay compares a vendor with another vendor's captured result, not with an fp64 reference:
both lie within the bound of the exact value, so they may differ by twice it (`REPLAY_FACTOR`).
"""

import torch

EPS = {
    torch.float32: 2.0**-23,
    torch.float16: 2.0**-10,
    torch.bfloat16: 2.0**-7,
}

# (dtype, family) -> multiple of eps, used for both atol and rtol.
_EPS_MULTIPLE = {
    (torch.float32, "elementwise"): 4,
    (torch.float32, "reduction"): 32,
    (torch.float16, "elementwise"): 2,
    (torch.float16, "reduction"): 2,
    (torch.bfloat16, "elementwise"): 2,
    (torch.bfloat16, "reduction"): 2,
}

TOLERANCES = {key: (m * EPS[key[0]], m * EPS[key[0]]) for key, m in _EPS_MULTIPLE.items()}

# op -> family
FAMILY = {
    "rms_norm": "reduction",
    "add_rms_norm": "reduction",
    "apply_rotary_pos_emb": "elementwise",
    "silu_and_mul": "elementwise",
    "linear": "reduction",
    "prefill_attention": "reduction",
    "paged_prefill_attention": "reduction",
    "paged_decode_attention": "reduction",
    "fused_moe": "reduction",
    # weights are float32 outputs whatever the logits' dtype: a softmax over E in float32
    "moe_gating_topk_softmax": "reduction",
    # W8A8: the int8 product is exact, so the float results are a few float32 roundings
    # (scale = amax / 127; acc * rms_scale * linear_scale + bias, one cast to out_dtype).
    "dynamic_quant": "elementwise",
    "linear_w8a8": "elementwise",
    # static W8A8: the int8 product + int32 bias exact; one float32 product with deq_scale, one cast
    "linear_w8a8_static": "elementwise",
    "apply_rotary_pos_emb_interleaved": "elementwise",
    # the scales (and int8 values) follow the norm, rounded to the activation dtype first
    "rms_norm_w8a8": "reduction",
    "add_rms_norm_w8a8": "reduction",
    # W4A16: a float32 sum over K of x times the dequantised weight (exact for half-type scales)
    "weight_quant_matmul": "reduction",
    # float32 GEMM epilogues and a float32 combine over K experts, one rounding to the output dtype;
    # the parity check adds a per-element slack where an activation sits on a quantisation tie
    "fused_moe_w8a8": "reduction",
}

# (op, result) pairs every correct vendor produces bit for bit, as the parity tests check them:
# results are named as the tools name them (an in-place argument's name, "result" or "result[i]").
EXACT_RESULTS = frozenset({
    ("fill_kv_cache", "key_cache"),
    ("fill_kv_cache", "value_cache"),
    ("add_rms_norm", "result[1]"),  # h + r in the activation dtype: one correctly rounded add
    ("moe_gating_topk_softmax", "result[1]"),  # top-k ids
    ("add_rms_norm_w8a8", "result[2]"),  # h + r, as add_rms_norm's
})

REPLAY_FACTOR = 2.0

# op -> the operands whose absolute values give each output element's error scale S (see above).
SCALED_OPERANDS = {
    "linear": ("x", "weight", "bias"),
    "fused_moe": ("hidden_states", "gate_up_weights", "down_weights", "topk_weights"),
    "prefill_attention": ("value",),
    "paged_prefill_attention": ("value_cache",),
    "paged_decode_attention": ("value_cache",),
}


def tolerance(op, dtype):
    """(atol, rtol) for op's output of the given dtype."""
    return TOLERANCES[(dtype, FAMILY[op])]
