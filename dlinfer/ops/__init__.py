"""dlinfer's op interface: coarse fused ops with fixed dimension semantics.

Every op validates its arguments (InvalidArgumentError names the op, the argument, what was
expected and what came) before any kernel runs or any cache is written, then dispatches to the
active vendor (`dlinfer.vendor`). Each op also exists as `torch.ops.dlinfer.<name>`. The list of
ops, their canonical signatures and fake implementations: the op table,
`dlinfer/vendor/op_table.py` (docs/design.md, "The op table").

Value checks (slots inside the cache, lengths inside the block table: they read tensor data, a
device sync off the CPU) run when DLINFER_CHECK_VALUES=1, read when the first op runs;
`set_value_checks(True | False | None)` changes that at run time (None: re-read the variable).

The op tools (capture, replay, compare, timing, overflow: dlinfer/tools, docs/tools.md) see every
op call once enabled by DLINFER_OP_* variables or `dlinfer.tools` context managers.
"""

from dlinfer.ops import _custom_ops  # noqa: F401  (defines torch.ops.dlinfer.*; patches nothing)
from dlinfer.ops._checks import set_value_checks
from dlinfer.ops.activation import silu_and_mul
from dlinfer.ops.attention import paged_decode_attention, paged_prefill_attention, prefill_attention
from dlinfer.ops.kv_cache import fill_kv_cache
from dlinfer.ops.linear import linear
from dlinfer.ops.moe import fused_moe, fused_moe_w8a8, moe_gating_topk_softmax
from dlinfer.ops.norm import add_rms_norm, rms_norm
from dlinfer.ops.quant import add_rms_norm_w8a8, dynamic_quant, linear_w8a8, linear_w8a8_static, rms_norm_w8a8
from dlinfer.ops.rotary import apply_rotary_pos_emb, apply_rotary_pos_emb_interleaved
from dlinfer.ops.weight_quant import repack_weight_quant, weight_quant_matmul
from dlinfer.tools.env import from_env as _tools_from_env
from dlinfer.vendor.op_table import OP_NAMES
from dlinfer.vendor.selection import on_first_resolve as _on_first_resolve

# The op tools' environment variables (DLINFER_OP_CAPTURE, _COMPARE, _TIMING, _OVERFLOW;
# docs/tools.md) are read when the first op resolves, like DLINFER_VENDOR.
_on_first_resolve(_tools_from_env)

# Every op of the table, by the public name (tests/ops/test_suites.py checks each is defined here),
# and the load-time weight repack (not an op: called once per layer, never traced).
__all__ = ["set_value_checks", "repack_weight_quant", *OP_NAMES]
