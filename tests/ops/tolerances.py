"""The one tolerance table of the op parity suite.

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

Exact ops (fill_kv_cache, top-k ids, the add of add_rms_norm) are compared for equality, not here.
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
}


def tolerance(op, dtype):
    """(atol, rtol) for op's output of the given dtype."""
    return TOLERANCES[(dtype, FAMILY[op])]
