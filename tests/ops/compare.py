"""Assert helpers with verbose mismatch reports (count, worst index, worst error, the values there)."""

import torch

from .tolerances import tolerance


def _index(flat_idx, shape):
    idx = []
    for size in reversed(shape):
        idx.append(flat_idx % size)
        flat_idx //= size
    return tuple(reversed(idx))


def assert_close(actual, expected, op, dtype=None, name="output"):
    """actual (any dtype / device) against an fp64 reference, with the table's (atol, rtol).

    dtype picks the tolerance row; it defaults to actual's dtype.
    """
    assert isinstance(actual, torch.Tensor), f"{op} {name}: expected a tensor, got {type(actual)}"
    dtype = actual.dtype if dtype is None else dtype
    atol, rtol = tolerance(op, dtype)
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{op} {name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    a = actual.detach().to(device="cpu", dtype=torch.float64)
    e = expected.detach().to(device="cpu", dtype=torch.float64)
    if a.numel() == 0:
        return
    err = (a - e).abs()
    bound = atol + rtol * e.abs()
    bad = ~(err <= bound)  # NaN counts as bad
    both_nan = a.isnan() & e.isnan()
    bad &= ~both_nan
    n_bad = int(bad.sum())
    if n_bad == 0:
        return
    ratio = torch.where(err.isnan(), torch.full_like(err, float("inf")), err / bound)
    worst = int(ratio.reshape(-1).argmax())
    widx = _index(worst, a.shape)
    max_abs = float(torch.nan_to_num(err, nan=float("inf")).max())
    first = _index(int(bad.reshape(-1).nonzero()[0]), a.shape)
    raise AssertionError(
        f"{op} {name} ({dtype}, atol={atol:.3g}, rtol={rtol:.3g}): {n_bad} / {a.numel()} elements "
        f"mismatch, shape {tuple(a.shape)}\n"
        f"  worst at {widx}: actual {float(a[widx])!r}, expected {float(e[widx])!r}, "
        f"abs err {float(err[widx]):.4g} (allowed {float(bound[widx]):.4g})\n"
        f"  max abs err {max_abs:.4g}; first mismatch at {first}: actual {float(a[first])!r}, "
        f"expected {float(e[first])!r}")


def assert_equal(actual, expected, op, name="output"):
    """Bit-exact equality (same dtype, same shape, same values; NaNs compared by bits)."""
    assert isinstance(actual, torch.Tensor), f"{op} {name}: expected a tensor, got {type(actual)}"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{op} {name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    assert actual.dtype == expected.dtype, f"{op} {name}: dtype {actual.dtype}, expected {expected.dtype}"
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
    raise AssertionError(
        f"{op} {name}: {n_bad} / {a.numel()} elements differ (exact comparison), shape {tuple(a.shape)}, "
        f"{a.dtype}\n  first at {first}: actual {a[first].item()!r}, expected {e[first].item()!r}\n"
        f"  last at {last}: actual {a[last].item()!r}, expected {e[last].item()!r}")


def assert_caches_untouched(before, after, op):
    for i, (b, a) in enumerate(zip(before, after)):
        assert_equal(a, b, op, name=f"cache {i} after a rejected call")
