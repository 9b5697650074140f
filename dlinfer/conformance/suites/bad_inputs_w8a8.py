"""The W8A8 ops' rows of the bad-input suites (dlinfer/conformance/suites/bad_inputs.py runs
them): a valid small call per op and the mutations that break one argument each."""

import torch

from dlinfer.conformance.inputs import device, gen

F32, F16, I32, I64 = torch.float32, torch.float16, torch.int32, torch.int64
META = torch.device("meta")
T = 5
OPS = ("dynamic_quant", "linear_w8a8", "rms_norm_w8a8", "add_rms_norm_w8a8", "fused_moe_w8a8")


def _r(*shape, dtype=F32, seed=0):
    return torch.randn(*shape, generator=gen(seed)).to(dtype=dtype, device=device())


def _i8(*shape, seed=0):
    return torch.randint(-128, 128, shape, generator=gen(seed), dtype=I64).to(dtype=torch.int8, device=device())


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device=META)


def _ids():
    return torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2]], dtype=I64, device=device())


def good_call(op):
    """Keyword arguments (the contract's names) of a valid small call; None for another op."""
    if op == "dynamic_quant":
        return dict(x=_r(T, 64), quant_dtype=torch.int8, quant_granularity="PER_TOKEN")
    if op == "linear_w8a8":
        return dict(a=_i8(T, 64), b=_i8(48, 64, seed=1), rms_scale=torch.full((T, 1), 0.01, device=device()),
                    linear_scale=torch.full((48,), 0.01, device=device()), out_dtype=F16, quant_dtype=torch.int8,
                    bias=_r(48, dtype=F16))
    if op == "rms_norm_w8a8":
        return dict(hidden_states=_r(T, 64), weight=_r(64), epsilon=1e-6, quant_dtype=torch.int8)
    if op == "add_rms_norm_w8a8":
        return dict(hidden_states=_r(T, 64), residual=_r(T, 64, seed=1), weight=_r(64), epsilon=1e-6,
                    quant_dtype=torch.int8)
    if op == "fused_moe_w8a8":
        ids = _ids()
        return dict(hidden_states=_r(T, 32), gate_up_weights=_i8(4, 2 * 48, 32), gate_up_scales=_r(4, 96).abs(),
                    down_weights=_i8(4, 32, 48, seed=1), down_scales=_r(4, 32, 1).abs(),
                    topk_weights=torch.full((T, 2), 0.5, device=device()), topk_ids=ids, topk=2, renormalize=False,
                    moe_metadata=None)
    return None


# (op, argument, what, new value: fn(good kwargs, layout) -> value)
BAD = [
    ("dynamic_quant", "x", "dtype", lambda a, l: a["x"].to(I32)),
    ("dynamic_quant", "x", "rank", lambda a, l: torch.tensor(1.0, device=device())),
    ("dynamic_quant", "quant_dtype", "int4", lambda a, l: torch.quint4x2),
    ("dynamic_quant", "quant_dtype", "fp8", lambda a, l: torch.float8_e4m3fn),
    ("dynamic_quant", "quant_granularity", "per_tensor", lambda a, l: "PER_TENSOR"),
    ("linear_w8a8", "a", "dtype", lambda a, l: a["a"].to(F16)),
    ("linear_w8a8", "a", "rank", lambda a, l: torch.tensor(1, dtype=torch.int8, device=device())),
    ("linear_w8a8", "b", "size", lambda a, l: _i8(48, 63)),
    ("linear_w8a8", "b", "rank", lambda a, l: _i8(64)),
    ("linear_w8a8", "b", "dtype", lambda a, l: a["b"].to(I32)),
    ("linear_w8a8", "b", "device", lambda a, l: _meta(a["b"])),
    ("linear_w8a8", "rms_scale", "tokens", lambda a, l: torch.ones(T + 1, 1, device=device())),
    ("linear_w8a8", "rms_scale", "cols", lambda a, l: torch.ones(T, 2, device=device())),
    ("linear_w8a8", "rms_scale", "dtype", lambda a, l: a["rms_scale"].to(F16)),
    ("linear_w8a8", "rms_scale", "device", lambda a, l: _meta(a["rms_scale"])),
    ("linear_w8a8", "linear_scale", "size", lambda a, l: torch.ones(47, device=device())),
    ("linear_w8a8", "linear_scale", "row", lambda a, l: torch.ones(1, 48, device=device())),
    ("linear_w8a8", "linear_scale", "dtype", lambda a, l: a["linear_scale"].to(torch.float64)),
    ("linear_w8a8", "linear_scale", "device", lambda a, l: _meta(a["linear_scale"])),
    ("linear_w8a8", "out_dtype", "int32", lambda a, l: I32),
    ("linear_w8a8", "quant_dtype", "int4", lambda a, l: torch.quint4x2),
    ("linear_w8a8", "bias", "size", lambda a, l: _r(47, dtype=F16)),
    ("linear_w8a8", "bias", "dtype", lambda a, l: a["bias"].to(I32)),
    ("linear_w8a8", "bias", "device", lambda a, l: _meta(a["bias"])),
    ("rms_norm_w8a8", "hidden_states", "dtype", lambda a, l: a["hidden_states"].to(torch.int8)),
    ("rms_norm_w8a8", "weight", "size", lambda a, l: _r(63)),
    ("rms_norm_w8a8", "weight", "device", lambda a, l: _meta(a["weight"])),
    ("rms_norm_w8a8", "epsilon", "negative", lambda a, l: -1.0),
    ("rms_norm_w8a8", "quant_dtype", "uint8", lambda a, l: torch.uint8),
    ("add_rms_norm_w8a8", "residual", "size", lambda a, l: _r(T, 63)),
    ("add_rms_norm_w8a8", "residual", "dtype", lambda a, l: a["residual"].to(F16)),
    ("add_rms_norm_w8a8", "residual", "device", lambda a, l: _meta(a["residual"])),
    ("add_rms_norm_w8a8", "weight", "size", lambda a, l: _r(65)),
    ("add_rms_norm_w8a8", "quant_dtype", "int4", lambda a, l: torch.quint4x2),
    ("fused_moe_w8a8", "hidden_states", "rank", lambda a, l: _r(32)),
    ("fused_moe_w8a8", "hidden_states", "dtype", lambda a, l: a["hidden_states"].to(torch.int8)),
    ("fused_moe_w8a8", "gate_up_weights", "float", lambda a, l: _r(4, 96, 32)),
    ("fused_moe_w8a8", "gate_up_weights", "hidden", lambda a, l: _i8(4, 96, 31)),
    ("fused_moe_w8a8", "gate_up_weights", "odd_rows", lambda a, l: _i8(4, 95, 32)),
    ("fused_moe_w8a8", "gate_up_weights", "device", lambda a, l: _meta(a["gate_up_weights"])),
    ("fused_moe_w8a8", "gate_up_scales", "rows", lambda a, l: _r(4, 95)),
    ("fused_moe_w8a8", "gate_up_scales", "cols", lambda a, l: _r(4, 96, 2)),
    ("fused_moe_w8a8", "gate_up_scales", "dtype", lambda a, l: a["gate_up_scales"].to(I32)),
    ("fused_moe_w8a8", "gate_up_scales", "device", lambda a, l: _meta(a["gate_up_scales"])),
    ("fused_moe_w8a8", "down_weights", "inter", lambda a, l: _i8(4, 32, 47)),
    ("fused_moe_w8a8", "down_weights", "experts", lambda a, l: _i8(3, 32, 48)),
    ("fused_moe_w8a8", "down_weights", "float", lambda a, l: _r(4, 32, 48)),
    ("fused_moe_w8a8", "down_scales", "experts", lambda a, l: _r(3, 32)),
    ("fused_moe_w8a8", "down_scales", "device", lambda a, l: _meta(a["down_scales"])),
    ("fused_moe_w8a8", "topk_weights", "tokens", lambda a, l: torch.full((T + 1, 2), 0.5, device=device())),
    ("fused_moe_w8a8", "topk_ids", "dtype", lambda a, l: a["topk_ids"].to(F32)),
    ("fused_moe_w8a8", "topk_ids", "k", lambda a, l: a["topk_ids"][:, :1].contiguous()),
    ("fused_moe_w8a8", "topk", "mismatch", lambda a, l: 3),
]

# Value checks (DLINFER_CHECK_VALUES=1).
BAD_VALUES = [
    ("fused_moe_w8a8", "topk_ids", "id_past_experts",
     lambda a, l: torch.tensor([[0, 1], [2, 3], [1, 0], [3, 4], [0, 2]], dtype=I64, device=device())),
    ("fused_moe_w8a8", "topk_ids", "negative_id",
     lambda a, l: torch.tensor([[0, 1], [2, -1], [1, 0], [3, 2], [0, 2]], dtype=I32, device=device())),
]
