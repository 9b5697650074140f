"""Comparisons that fail with a verbose, structured report: `Mismatch` carries the count of bad
elements, the worst absolute and relative errors and where (the index); its message is the
readable form tests print. Failures other than element mismatches raise `CheckFailed`. Both are
AssertionErrors (pytest shows them as test failures) and neither relies on `assert` (they work
under `python -O`)."""

from __future__ import annotations

from typing import Optional

import torch

from dlinfer.conformance.tolerances import tolerance


class CheckFailed(AssertionError):
    """A conformance check found the op's behaviour wrong (not an element mismatch)."""


class Mismatch(CheckFailed):
    """Elements of an output differ from the reference beyond the tolerance (or at all, exactly)."""

    def __init__(self, message: str, *, op: str, output: str, mismatches: int, elements: int, shape: tuple,
                 max_abs_err: float, max_rel_err: float, worst_index: tuple, actual: float, expected: float,
                 atol: Optional[float] = None, rtol: Optional[float] = None):
        super().__init__(message)
        self.details = dict(op=op, output=output, mismatches=mismatches, elements=elements, shape=list(shape),
                            max_abs_err=max_abs_err, max_rel_err=max_rel_err, worst_index=list(worst_index),
                            actual=actual, expected=expected, atol=atol, rtol=rtol)


def expect(condition, message: str) -> None:
    """Raise CheckFailed(message) unless condition holds."""
    if not condition:
        raise CheckFailed(message)


def _index(flat_idx, shape):
    idx = []
    for size in reversed(shape):
        idx.append(flat_idx % size)
        flat_idx //= size
    return tuple(reversed(idx))


def _errors(a, e):
    """(abs err, rel err), NaN where either side is NaN (and not both), inf relative where e == 0."""
    err = (a - e).abs()
    err = torch.where(a.isnan() & e.isnan(), torch.zeros_like(err), err)
    rel = err / e.abs()
    rel = torch.where(err == 0, torch.zeros_like(rel), rel)
    return err, rel


def _max(t):
    return float(torch.nan_to_num(t, nan=float("inf")).max())


def assert_close(actual, expected, op, dtype=None, name="output", slack=None):
    """actual (any dtype / device) against an fp64 reference, with the table's (atol, rtol).

    dtype picks the tolerance row; it defaults to actual's dtype. slack: an fp64 tensor shaped like
    expected, added to each element's bound: an allowance the reference computed element by element
    (fused_moe_w8a8's one-step quantisation ties), never a looser table entry.
    """
    expect(isinstance(actual, torch.Tensor), f"{op} {name}: expected a tensor, got {type(actual)}")
    dtype = actual.dtype if dtype is None else dtype
    atol, rtol = tolerance(op, dtype)
    expect(tuple(actual.shape) == tuple(expected.shape),
           f"{op} {name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    a = actual.detach().to(device="cpu", dtype=torch.float64)
    e = expected.detach().to(device="cpu", dtype=torch.float64)
    if a.numel() == 0:
        return
    err = (a - e).abs()
    bound = atol + rtol * e.abs()
    if slack is not None:
        bound = bound + slack.detach().to(device="cpu", dtype=torch.float64)
    bad = ~(err <= bound)  # NaN counts as bad
    both_nan = a.isnan() & e.isnan()
    bad &= ~both_nan
    n_bad = int(bad.sum())
    if n_bad == 0:
        return
    ratio = torch.where(err.isnan(), torch.full_like(err, float("inf")), err / bound)
    worst = int(ratio.reshape(-1).argmax())
    widx = _index(worst, a.shape)
    abs_err, rel_err = _errors(a[bad], e[bad])
    max_abs, max_rel = _max(abs_err), _max(rel_err)
    first = _index(int(bad.reshape(-1).nonzero()[0]), a.shape)
    raise Mismatch(
        f"{op} {name} ({dtype}, atol={atol:.3g}, rtol={rtol:.3g}): {n_bad} / {a.numel()} elements "
        f"mismatch, shape {tuple(a.shape)}\n"
        f"  worst at {widx}: actual {float(a[widx])!r}, expected {float(e[widx])!r}, "
        f"abs err {float(err[widx]):.4g} (allowed {float(bound[widx]):.4g})\n"
        f"  max abs err {max_abs:.4g}, max rel err {max_rel:.4g}; first mismatch at {first}: "
        f"actual {float(a[first])!r}, expected {float(e[first])!r}",
        op=op, output=name, mismatches=n_bad, elements=a.numel(), shape=tuple(a.shape), max_abs_err=max_abs,
        max_rel_err=max_rel, worst_index=widx, actual=float(a[widx]), expected=float(e[widx]), atol=atol, rtol=rtol)


def assert_equal(actual, expected, op, name="output"):
    """Bit-exact equality (same dtype, same shape, same values; NaNs compared by bits)."""
    expect(isinstance(actual, torch.Tensor), f"{op} {name}: expected a tensor, got {type(actual)}")
    expect(tuple(actual.shape) == tuple(expected.shape),
           f"{op} {name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    expect(actual.dtype == expected.dtype, f"{op} {name}: dtype {actual.dtype}, expected {expected.dtype}")
    a = actual.detach().cpu()
    e = expected.detach().cpu()
    if a.numel() == 0:
        return
    if a.is_floating_point():
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        bad = a.view(bits) != e.view(bits)
    else:
        bad = a != e
    n_bad = int(bad.sum())
    if n_bad == 0:
        return
    flat = bad.reshape(-1).nonzero().reshape(-1)
    first = _index(int(flat[0]), a.shape)
    last = _index(int(flat[-1]), a.shape)
    abs_err, rel_err = _errors(a[bad].double(), e[bad].double())
    max_abs = _max(abs_err)
    worst = _index(int(flat[int(torch.nan_to_num(abs_err, nan=float("inf")).argmax())]), a.shape)
    raise Mismatch(
        f"{op} {name}: {n_bad} / {a.numel()} elements differ (exact comparison), shape {tuple(a.shape)}, "
        f"{a.dtype}\n  first at {first}: actual {a[first].item()!r}, expected {e[first].item()!r}\n"
        f"  last at {last}: actual {a[last].item()!r}, expected {e[last].item()!r}; max abs err {max_abs:.4g}",
        op=op, output=name, mismatches=n_bad, elements=a.numel(), shape=tuple(a.shape), max_abs_err=max_abs,
        max_rel_err=_max(rel_err), worst_index=worst, actual=float(a[worst].item()),
        expected=float(e[worst].item()))
