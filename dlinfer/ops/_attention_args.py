"""The three attention ops' shared arguments (dlinfer/ops/attention.py): their checks, and the
lengths and kernel keywords the op bodies derive from them.

The `check_*` functions run once per call, eagerly or natively while torch.compile traces
(dlinfer/ops/_compile_time.py); `scale_value`, `option_kwargs` and the two length memos run in
the op bodies, which Dynamo traces. Shapes: query [T, Hq, D]; cumulative offsets cu [B + 1]; per-sequence
lengths [B].
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from dlinfer.errors import InvalidArgumentError
from dlinfer.ops import _checks as C
from dlinfer.ops._dispatch import require
from dlinfer.ops.kv_cache import token_rows
from dlinfer.utils.memo import LastCallMemo
from dlinfer.vendor.base import FEATURE_ALIBI, FEATURE_SLIDING_WINDOW, FEATURE_SOFTCAP


def check_query(op: str, query) -> Tensor:
    return C.tensor(op, "query", token_rows(query), ("T", "Hq", "D"), C.FLOAT_DTYPES)


def check_heads(op: str, query: Tensor, num_q_heads, num_kv_heads) -> int:
    hq = query.shape[1]
    C.integer(op, "num_q_heads", num_q_heads, 1)
    C.integer(op, "num_kv_heads", num_kv_heads, 1)
    if num_q_heads != hq:
        raise InvalidArgumentError(op, "num_q_heads", f"query's head count {hq}", str(num_q_heads))
    if hq % num_kv_heads:
        raise InvalidArgumentError(op, "num_kv_heads", f"a divisor of num_q_heads={hq}", str(num_kv_heads))
    return num_kv_heads


def check_output(op: str, query: Tensor, head_size_v: int, attn_output) -> None:
    """A given attn_output: [T, Hq, Dv] (or [1, T, Hq, Dv]) like query, on its device."""
    t, hq, _ = query.shape
    attn_output = token_rows(attn_output)
    C.tensor(op, "attn_output", attn_output, (t, hq, head_size_v), None, query.device)
    C.same_dtype(op, "attn_output", attn_output, query, "query")


def check_scale(op: str, softmax_scale) -> None:
    if softmax_scale is None:
        return
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (float, int)) or not softmax_scale > 0:
        raise InvalidArgumentError(op, "softmax_scale", "a float > 0 or None", C.describe(softmax_scale))


def check_alibi(op: str, vendor, alibi_slopes, query: Tensor) -> None:
    if alibi_slopes is None:
        return
    require(vendor, op, FEATURE_ALIBI)
    C.tensor(op, "alibi_slopes", alibi_slopes, (query.shape[1],), (torch.float32,), query.device)


def check_score_options(op: str, vendor, sliding_window, logit_softcapping) -> None:
    """Checks a window and a soft cap (and that the vendor runs the ones set)."""
    if sliding_window is not None and sliding_window != -1:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise InvalidArgumentError(op, "sliding_window", "an int >= 1, or None / -1 for no window",
                                       C.describe(sliding_window))
        require(vendor, op, FEATURE_SLIDING_WINDOW)
    if logit_softcapping is not None and logit_softcapping != 0:
        if (isinstance(logit_softcapping, bool) or not isinstance(logit_softcapping, (int, float))
                or not logit_softcapping > 0 or logit_softcapping == float("inf")):
            raise InvalidArgumentError(op, "logit_softcapping", "a finite float > 0, or None / 0 for none",
                                       C.describe(logit_softcapping))
        require(vendor, op, FEATURE_SOFTCAP)


def scale_value(softmax_scale, head_dim: int) -> float:
    """The softmax scale a checked `softmax_scale` gives: head_dim ** -0.5 for None."""
    return head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)


def option_kwargs(sliding_window, logit_softcapping) -> dict:
    """The kernel keywords of a checked window and soft cap that are set (an empty dict for neither)."""
    kwargs = {}
    if sliding_window is not None and sliding_window != -1:
        kwargs["sliding_window"] = int(sliding_window)
    if logit_softcapping is not None and logit_softcapping != 0:
        kwargs["logit_softcapping"] = float(logit_softcapping)
    return kwargs


def _on_device_int32(t: Tensor, device: torch.device) -> Tensor:
    # Always a new tensor: these results are memoised across calls, and the caller may edit its
    # own length tensors in place later.
    return t.to(device=device, dtype=torch.int32, non_blocking=True, copy=True)


def _cu_from_ends(ends: Tensor, device: torch.device) -> Tensor:
    return F.pad(_on_device_int32(ends, device), (1, 0))


def _paged_lengths(q_seq_len: Tensor, kv_seq_len: Tensor, device: torch.device):
    return _cu_from_ends(q_seq_len, device), _on_device_int32(kv_seq_len, device)


def _prefill_lengths(q_seq_len: Tensor, actual_seq_lengths_cpu: Optional[Tensor], device: torch.device):
    if actual_seq_lengths_cpu is not None:
        return _cu_from_ends(actual_seq_lengths_cpu, device)
    return F.pad(torch.cumsum(_on_device_int32(q_seq_len, device), 0, dtype=torch.int32), (1, 0))


# Every layer of a step passes the same lengths: derive the canonical ones once per step.
paged_lengths = LastCallMemo(_paged_lengths)
prefill_lengths = LastCallMemo(_prefill_lengths)


def check_cu_values(op: str, name: str, cu: Tensor, t: int) -> None:
    cu = cu.cpu()
    if bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) != t:
        raise InvalidArgumentError(op, name, f"non-decreasing cumulative ends finishing at T={t}", str(cu[1:].tolist()))


def check_paged_values(op, cu: Tensor, kv_seq_len: Tensor, block_table: Tensor, nb: int, bs: int, t: int) -> None:
    """The lengths and the used block ids against the cache (DLINFER_CHECK_VALUES=1)."""
    check_cu_values(op, "q_seq_len", cu, t)
    m = block_table.shape[1]
    kv_cpu, n_cpu = kv_seq_len.cpu().long(), (cu[1:] - cu[:-1]).cpu().long()
    if bool((kv_cpu < n_cpu).any()) or bool((kv_cpu > m * bs).any()):
        raise InvalidArgumentError(op, "kv_seq_len", f"per sequence >= its new tokens and <= M*BS = {m * bs}",
                                   str(kv_cpu.tolist()))
    used = torch.arange(m).unsqueeze(0) < ((kv_cpu + bs - 1) // bs).unsqueeze(1)
    ids = block_table.cpu().long()[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= nb):
        raise InvalidArgumentError(op, "block_table", f"block ids in [0, {nb}) for used entries",
                                   f"ids in [{int(ids.min())}, {int(ids.max())}]")


def check_bounds(op: str, cu: Tensor, kv: Tensor, max_q: Optional[int], max_kv: int) -> None:
    n = (cu[1:] - cu[:-1]).cpu()
    if max_q is not None and int(n.max()) > max_q:
        raise InvalidArgumentError(op, "max_q_seq_len", f">= {int(n.max())}", str(max_q))
    if int(kv.max()) > max_kv:
        raise InvalidArgumentError(op, "max_kv_seq_len", f">= {int(kv.max())}", str(max_kv))
