"""The op table: every dlinfer op, written once (docs/design.md, "The op table").

Each entry gives an op's name, the schema of its *canonical* signature (what a vendor function
takes, after `dlinfer.ops` has validated and normalised the caller's arguments), the arguments
it writes in place (read off the schema's `(a!)` marks), its fake implementation (shapes and
dtypes of the outputs, for torch.compile) and the shapes of its arguments. Derived from it:
the `torch.ops.dlinfer.*` registrations (`dlinfer/ops/_custom_ops.py`), the op names of the
vendor protocol (`OP_NAMES`, `dlinfer/vendor/base.py`), `python -m dlinfer env`'s counts and the
tests' op lists.

Integer arguments that vary from step to step (`max_*`, `topk`) are `SymInt` in the schemas, so
torch.compile keeps them symbolic instead of recompiling for every new value.

Notation: T tokens, B sequences, Hq / Hkv heads, D / Dv head dims, NB blocks, BS block size, M max
blocks per sequence, E experts, K top-k. Canonical conventions: 2-D activations [N, H]; length
tensors `cu_seqlens_q` [B+1] (cumulative starts and ends) and `kv_seq_len` [B] are int32 on the
query's device; `max_*` are upper bounds (grids may be sized by them); `kv_layout` is
"token_major" or "head_major" (`dlinfer/vendor/kv_layouts.py`); index tensors (kv_indices,
block_table) are int32 or int64 as the caller gave them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch

NAMESPACE = "dlinfer"


@dataclass(frozen=True)
class OpSpec:
    """One op of the contract.

    name: the op's name (`dlinfer.ops.<name>`, `torch.ops.dlinfer.<name>`, vendor table key).
    schema: the canonical signature as a torch.library schema, "(args) -> returns".
    fake: computes output metadata from canonical arguments (torch.compile's fake tensors).
    doc: argument shapes, one line per argument or group.
    options: the schema's last arguments that are optional features (SCORE_OPTIONS): a vendor
        function gets each as a keyword, and only when it is set (not 0), so a vendor without
        the feature keeps its signature.
    """

    name: str
    schema: str
    fake: Callable
    doc: str
    options: Tuple[str, ...] = ()

    @property
    def mutates(self) -> Tuple[str, ...]:
        """Names of the arguments the op writes in place."""
        return tuple(re.findall(r"Tensor\([a-z]!\)\??\s+(\w+)", self.schema))

    @property
    def arg_names(self) -> Tuple[str, ...]:
        inside = self.schema[self.schema.index("(") + 1:self.schema.rindex(") ->")]
        return tuple(part.split("=")[0].split()[-1] for part in inside.split(","))

    @property
    def takes_kv_cache(self) -> bool:
        return "kv_layout" in self.arg_names


def _none(*args):
    return None


def _like_first(x, *args):
    return torch.empty_like(x)


def _pair_like(a, b, *args):
    return torch.empty_like(a), torch.empty_like(b)


def _add_rms_norm_fake(hidden_states, residual, weight, epsilon):
    return torch.empty_like(hidden_states), torch.empty_like(hidden_states)


def _topk_fake(router_logits, topk):
    shape = (router_logits.shape[0], topk)
    return (router_logits.new_empty(shape, dtype=torch.float32), router_logits.new_empty(shape, dtype=torch.int64))


def _silu_and_mul_fake(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _linear_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _dynamic_quant_fake(x):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _linear_w8a8_fake(a, b, rms_scale, linear_scale, out_dtype, bias):
    return a.new_empty((*a.shape[:-1], b.shape[0]), dtype=out_dtype)


def _linear_w8a8_static_fake(x, weight, input_scale, input_offset, deq_scale, out_dtype, quant_bias):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype)


def _rms_norm_w8a8_fake(hidden_states, weight, epsilon):
    return _dynamic_quant_fake(hidden_states)


def _add_rms_norm_w8a8_fake(hidden_states, residual, weight, epsilon):
    return (*_dynamic_quant_fake(hidden_states), torch.empty_like(hidden_states))


def _weight_quant_matmul_fake(x, qweight, scale, offset, bias, group_size):
    return x.new_empty((x.shape[0], scale.shape[1]))


def _fused_moe_w8a8_fake(hidden_states, *args):
    return torch.empty_like(hidden_states)


# The int8 KV cache (quant_bits=8, dlinfer/ops/kv_quant.py): per-head float32 scales and zeros,
# all four None for a cache in the activation dtype.
KV_QUANT_ARGS = ", Tensor? k_scale=None, Tensor? k_zero=None, Tensor? v_scale=None, Tensor? v_zero=None"
# The attention ops' optional score changes (dlinfer/ops/attention.py): 0 means off.
SCORE_OPTIONS = ("sliding_window", "logit_softcapping")
SCORE_ARGS = ", int sliding_window=0, float logit_softcapping=0.0"
SCORE_DOC = "; sliding_window (0: none), logit_softcapping (0: none), keywords to the vendor when set"
KV_QUANT_DOC = ("k_scale / k_zero / v_scale / v_zero [Hkv] float32 or None: int8 caches holding "
                "clamp(round(x / scale + zero), -128, 127), read as (q - zero) * scale")

_TABLE = (
    OpSpec(
        "rms_norm",
        "(Tensor hidden_states, Tensor weight, float epsilon) -> Tensor",
        _like_first,
        "hidden_states [N, H], weight [H] -> [N, H] in hidden_states' dtype",
    ),
    OpSpec(
        "add_rms_norm",
        "(Tensor hidden_states, Tensor residual, Tensor weight, float epsilon) -> (Tensor, Tensor)",
        _add_rms_norm_fake,
        "hidden_states [N, H], residual [N, H], weight [H] -> (rms_norm(h + r) [N, H], h + r [N, H])",
    ),
    OpSpec(
        "apply_rotary_pos_emb",
        "(Tensor query, Tensor key, Tensor cos, Tensor sin) -> (Tensor, Tensor)",
        _pair_like,
        "query [T, Hq, D], key [T, Hkv, D], cos [T, R], sin [T, R] (R <= D, even) -> (q, k) new tensors",
    ),
    OpSpec(
        "apply_rotary_pos_emb_interleaved",
        "(Tensor x, Tensor cos, Tensor sin, bool return_native_layout) -> Tensor",
        _like_first,
        "x [T, H, D] (adjacent pairs), cos [T, D], sin [T, D] (half layout: entries i and i + D/2 hold angle i) -> "
        "new [T, H, D]: pairs rotated, in the front/back-half layout (return_native_layout) or adjacent pairs",
    ),
    OpSpec(
        "fill_kv_cache",
        "(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor kv_indices, "
        "str kv_layout"
        + KV_QUANT_ARGS + ") -> ()",
        _none,
        "key [T, Hkv, D], value [T, Hkv, Dv], key_cache / value_cache in kv_layout (written), "
        "kv_indices [T] slots (outside [0, NB*BS): skipped); " + KV_QUANT_DOC,
    ),
    OpSpec(
        "prefill_attention",
        "(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, SymInt max_q_seq_len, float softmax_scale, "
        "Tensor? alibi_slopes, Tensor(a!) out" + SCORE_ARGS + ") -> ()",
        _none,
        "query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, Dv], cu_seqlens_q [B+1], alibi_slopes [Hq]?, "
        "out [T, Hq, Dv] (written)" + SCORE_DOC,
        SCORE_OPTIONS,
    ),
    OpSpec(
        "paged_prefill_attention",
        "(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, Tensor cu_seqlens_q, "
        "Tensor kv_seq_len, SymInt max_q_seq_len, SymInt max_kv_seq_len, float softmax_scale, Tensor? alibi_slopes, "
        "Tensor(a!) out, str kv_layout" + KV_QUANT_ARGS + SCORE_ARGS + ") -> ()",
        _none,
        "query [T, Hq, D], caches in kv_layout, block_table [B, M], cu_seqlens_q [B+1], kv_seq_len [B], "
        "alibi_slopes [Hq]?, out [T, Hq, Dv] (written); " + KV_QUANT_DOC + SCORE_DOC,
        SCORE_OPTIONS,
    ),
    OpSpec(
        "paged_decode_attention",
        "(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, Tensor cu_seqlens_q, "
        "Tensor kv_seq_len, SymInt max_kv_seq_len, float softmax_scale, Tensor? alibi_slopes, Tensor(a!) out, "
        "str kv_layout" + KV_QUANT_ARGS + SCORE_ARGS + ") -> ()",
        _none,
        "query [T, Hq, D], caches in kv_layout, block_table [B, M], cu_seqlens_q [B+1], kv_seq_len [B], "
        "alibi_slopes [Hq]?, out [T, Hq, Dv] (written); " + KV_QUANT_DOC + SCORE_DOC,
        SCORE_OPTIONS,
    ),
    OpSpec(
        "moe_gating_topk_softmax",
        "(Tensor router_logits, SymInt topk) -> (Tensor, Tensor)",
        _topk_fake,
        "router_logits [T, E] -> (weights [T, K] float32, ids [T, K] int64)",
    ),
    OpSpec(
        "fused_moe",
        "(Tensor hidden_states, Tensor gate_up_weights, Tensor down_weights, Tensor topk_weights, "
        "Tensor topk_ids, bool renormalize) -> Tensor",
        _like_first,
        "hidden_states [T, H], gate_up_weights [E, 2I, H], down_weights [E, H, I], topk_weights [T, K], "
        "topk_ids [T, K] -> [T, H]",
    ),
    OpSpec(
        "silu_and_mul",
        "(Tensor x) -> Tensor",
        _silu_and_mul_fake,
        "x [N, 2I] -> [N, I]",
    ),
    OpSpec(
        "linear",
        "(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
        _linear_fake,
        "x [N, K], weight [Nout, K], bias [Nout]? -> [N, Nout]",
    ),
    # W8A8: int8 symmetric, per token (activations) / per output channel (weights); the public
    # functions validate quant_dtype (int8) and granularity (PER_TOKEN), the canonical form fixes them.
    OpSpec(
        "dynamic_quant",
        "(Tensor x) -> (Tensor, Tensor)",
        _dynamic_quant_fake,
        "x [N, K] float -> (xq [N, K] int8, scale [N] float32): scale = amax|x| / 127, xq = round(x / scale)",
    ),
    OpSpec(
        "linear_w8a8",
        "(Tensor a, Tensor b, Tensor rms_scale, Tensor linear_scale, ScalarType out_dtype, Tensor? bias) -> Tensor",
        _linear_w8a8_fake,
        "a [N, K] int8, b [Nout, K] int8, rms_scale [N] float32, linear_scale [Nout] or [Nout, 1] float32 "
        "(contiguous), bias [Nout]? float "
        "-> [N, Nout] out_dtype = (a @ b.T, exact int32) * rms_scale[:, None] * linear_scale (+ bias)",
    ),
    OpSpec(
        "linear_w8a8_static",
        "(Tensor x, Tensor weight, Tensor input_scale, Tensor input_offset, Tensor deq_scale, ScalarType out_dtype, "
        "Tensor? quant_bias) -> Tensor",
        _linear_w8a8_static_fake,
        "x [N, K] float, weight [Nout, K] int8, input_scale [1] float32, input_offset [1] float32, deq_scale [Nout] "
        "float32, quant_bias [Nout] int32? -> [N, Nout] out_dtype = (clamp(round(x / input_scale + input_offset)) @ "
        "weight.T, exact, + quant_bias) * deq_scale (ModelSlim static W8A8)",
    ),
    OpSpec(
        "rms_norm_w8a8",
        "(Tensor hidden_states, Tensor weight, float epsilon) -> (Tensor, Tensor)",
        _rms_norm_w8a8_fake,
        "hidden_states [N, H], weight [H] -> dynamic_quant(rms_norm(h, w)) (the norm rounded to h's dtype first)",
    ),
    OpSpec(
        "add_rms_norm_w8a8",
        "(Tensor hidden_states, Tensor residual, Tensor weight, float epsilon) -> (Tensor, Tensor, Tensor)",
        _add_rms_norm_w8a8_fake,
        "hidden_states [N, H], residual [N, H], weight [H] -> (xq [N, H] int8, scale [N] float32, h + r [N, H])",
    ),
    # W4A16: LMDeploy's AWQ gemm layout (dlinfer/vendor/w4_layouts.py); group_size resolved (0 -> K).
    OpSpec(
        "weight_quant_matmul",
        "(Tensor x, Tensor qweight, Tensor scale, Tensor? offset, Tensor? bias, SymInt group_size) -> Tensor",
        _weight_quant_matmul_fake,
        "x [M, K], qweight int32 [K, N/8] (or a repacked layout: column_tiled, k_interleaved), "
        "scale [K/g, N] in x's dtype or float16, "
        "offset int32 [K/g, N/8]? (None: zero point 8), bias [N]?, group_size g (K % g == 0) "
        "-> [M, N] = x @ ((q - z) * s) (+ bias)",
    ),
    OpSpec(
        "fused_moe_w8a8",
        "(Tensor hidden_states, Tensor gate_up_weights, Tensor gate_up_scales, Tensor down_weights, "
        "Tensor down_scales, Tensor topk_weights, Tensor topk_ids, bool renormalize) -> Tensor",
        _fused_moe_w8a8_fake,
        "hidden_states [T, H] float, gate_up_weights [E, 2I, H] int8, gate_up_scales [E, 2I] float32, "
        "down_weights [E, H, I] int8, down_scales [E, H] float32, topk_weights [T, K], topk_ids [T, K] -> [T, H]: "
        "fused_moe with x and silu(gate) * up (float32) quantised per token (dynamic_quant) before each int8 GEMM",
    ),
)

OPS: Dict[str, OpSpec] = {spec.name: spec for spec in _TABLE}
OP_NAMES: Tuple[str, ...] = tuple(OPS)
