"""Argument checks shared by the ops. They read metadata only (no device sync), except the
value checks, which run when DLINFER_CHECK_VALUES=1."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from dlinfer import envs
from dlinfer.errors import InvalidArgumentError
from dlinfer.ops._compile_time import Opaque

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


_check_values: Optional[bool] = None  # None: read DLINFER_CHECK_VALUES at the next op call


def set_value_checks(enabled: Optional[bool]) -> None:
    """Turn the value checks on or off for this process; None re-reads DLINFER_CHECK_VALUES
    (otherwise read once, when the first op runs)."""
    global _check_values
    _check_values = enabled


def check_values_enabled() -> bool:
    # Value checks read tensor data: under torch.compile they would be data-dependent graph
    # breaks (fullgraph=True fails), so they run in eager mode only.
    global _check_values
    if torch.compiler.is_compiling():
        return False
    if _check_values is None:
        _check_values = (envs.get("DLINFER_CHECK_VALUES") or "0") not in ("0", "false", "False")
    return _check_values


def describe(t) -> str:
    if isinstance(t, Opaque):
        return t.type_name
    if not isinstance(t, torch.Tensor):
        return f"{type(t).__name__} {t!r}"[:120]
    return f"tensor{list(t.shape)} {str(t.dtype).replace('torch.', '')} on {t.device}"


def _spec(dims) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def tensor(
    op: str,
    name: str,
    t,
    dims: Sequence,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """Check that `t` is a tensor of rank len(dims) whose sizes match `dims`.

    dims: one entry per dimension: an int or SymInt (exact size), or a str (a name, any size). The names
    make the error readable: ("T", "Hq", "D"). The success path formats nothing (it runs for
    every op call).
    """
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(op, name, f"a tensor {_spec(dims)}", describe(t))
    if t.dim() != len(dims):
        raise InvalidArgumentError(op, name, f"rank {len(dims)} {_spec(dims)}", describe(t))
    # zip, not enumerate: while torch.compile traces, Dynamo runs its Python polyfill of enumerate
    # bytecode by bytecode (a seventh of a SmolLM2 decode graph's traced instructions)
    i = 0
    for d, size in zip(dims, t.shape):
        if d.__class__ is not str and size != d:  # d: an int or SymInt (a size), or a str (a name)
            raise InvalidArgumentError(op, name, f"size {d} in dim {i} of {_spec(dims)}", describe(t))
        i += 1
    if dtypes is not None:
        dtype_in(op, name, t, dtypes)
    if device is not None and t.device != device:
        raise InvalidArgumentError(op, name, f"device {device}", describe(t))
    return t


def rank_at_least(op: str, name: str, t, rank: int, spec: str) -> int:
    """t.dim() of a tensor of rank >= `rank` (spec names the expected shape in the error)."""
    if not isinstance(t, torch.Tensor) or t.dim() < rank:
        raise InvalidArgumentError(op, name, f"a tensor {spec}", describe(t))
    return t.dim()


def dtype_in(op: str, name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype]) -> None:
    if t.dtype not in dtypes:
        names = "/".join(str(d).replace("torch.", "") for d in dtypes)
        raise InvalidArgumentError(op, name, f"dtype {names}", describe(t))


def same_dtype(op: str, name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    if t.dtype != ref.dtype:
        raise InvalidArgumentError(op, name, f"dtype {ref.dtype} (same as {ref_name})", describe(t))


def length_tensor(op: str, name: str, t, size, device: torch.device) -> torch.Tensor:
    """A 1-D int32/int64 length tensor on the CPU or on `device`."""
    tensor(op, name, t, (size,), INDEX_DTYPES)
    if t.device != device and t.device.type != "cpu":
        raise InvalidArgumentError(op, name, f"device cpu or {device}", describe(t))
    return t


def integer(op: str, name: str, value, minimum: int = 0) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int) and not _is_symint(value):
        raise InvalidArgumentError(op, name, f"an int >= {minimum}", describe(value))
    if not _is_symint(value) and value < minimum:
        raise InvalidArgumentError(op, name, f"an int >= {minimum}", str(value))
    return value


def _is_symint(value) -> bool:
    return isinstance(value, torch.SymInt)
