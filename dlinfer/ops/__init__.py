"""dlinfer's op interface: coarse fused ops with fixed dimension semantics.

Every op validates its arguments (InvalidArgumentError names the op, the argument, what was
expected and what came) before any kernel runs or any cache is written, then dispatches to the
active vendor (`dlinfer.vendor`). Each op also exists as `torch.ops.dlinfer.<name>`.

Value checks (slots inside the cache, lengths inside the block table: they read tensor data, a
device sync off the CPU) run when DLINFER_CHECK_VALUES=1, read when the first op runs;
`set_value_checks(True | False | None)` changes that at run time (None: re-read the variable).
"""

from dlinfer.ops import _custom_ops  # noqa: F401  (defines torch.ops.dlinfer.*; patches nothing)
from dlinfer.ops._checks import set_value_checks
from dlinfer.ops.activation import silu_and_mul
from dlinfer.ops.attention import paged_decode_attention, paged_prefill_attention, prefill_attention
from dlinfer.ops.kv_cache import fill_kv_cache
from dlinfer.ops.linear import linear
from dlinfer.ops.moe import fused_moe, moe_gating_topk_softmax
from dlinfer.ops.norm import add_rms_norm, rms_norm
from dlinfer.ops.rotary import apply_rotary_pos_emb

__all__ = [
    "set_value_checks",
    "rms_norm",
    "add_rms_norm",
    "apply_rotary_pos_emb",
    "fill_kv_cache",
    "prefill_attention",
    "paged_prefill_attention",
    "paged_decode_attention",
    "moe_gating_topk_softmax",
    "fused_moe",
    "silu_and_mul",
    "linear",
]
