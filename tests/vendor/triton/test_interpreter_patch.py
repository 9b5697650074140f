"""tests/support/triton_interpreter.py (installed by tests/conftest.py under TRITON_INTERPRET=1): a
kernel whose every program calls a `@triton.jit` helper and triton.language standard functions gives
the float64 sums it should, reads the language modules a bounded number of times a launch instead
of at every helper call, and leaves triton.language's builtins as shipped once the launch is over."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from support import triton_interpreter  # noqa: E402

pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's CPU interpreter only")]

PROGRAMS = 16


@triton.jit
def _double_then_sum(x_ptr, offs):
    return tl.sum(tl.load(x_ptr + offs) * 2.0, axis=0)


@triton.jit
def _kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + pid, _double_then_sum(x_ptr, offs) + tl.max(tl.zeros([BLOCK], tl.float32), axis=0))


def _launch_counting_swaps(monkeypatch):
    calls = []
    real = inspect.getmembers
    monkeypatch.setattr(inspect, "getmembers", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.arange(PROGRAMS * 8, dtype=torch.float32)
    out = torch.empty(PROGRAMS, dtype=torch.float32)
    _kernel[(PROGRAMS,)](x, out, BLOCK=8)
    monkeypatch.undo()
    return out, len(calls)


def test_the_patch_keeps_the_values_and_swaps_once_a_launch(monkeypatch):
    from triton.runtime import interpreter

    if not getattr(interpreter._patch_lang, "dlinfer_patched_once", False):
        assert os.environ.get("DLINFER_TEST_PLAIN_INTERPRETER") == "1" or not triton.__version__.startswith(
            triton_interpreter.CHECKED_VERSION), "conftest installs the patch on the Triton it was read against"
        pytest.skip("the patch is not installed here (another Triton, or DLINFER_TEST_PLAIN_INTERPRETER=1)")
    expected = torch.arange(PROGRAMS * 8, dtype=torch.float64).view(PROGRAMS, 8).sum(1) * 2
    _launch_counting_swaps(monkeypatch)  # the first launch reads each module's builtins
    out, swaps = _launch_counting_swaps(monkeypatch)
    assert torch.equal(out.double(), expected)
    assert swaps <= 5, swaps  # as shipped: 356 (5 modules at every helper call of 16 programs)
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.arange)  # put back after the launch


SCALARS = ["int1", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "bfloat16",
           "float32", "float64", "float8e5", "float8e5b16", "float8e4nv", "float8e4b8", "float8e4b15"]


def test_the_memoised_numpy_dtypes_are_the_shipped_ones():
    from triton.runtime import interpreter

    np_dtype = interpreter._get_np_dtype
    if getattr(np_dtype, "shipped", None) is None:
        pytest.skip("the patch is not installed here (another Triton, or DLINFER_TEST_PLAIN_INTERPRETER=1)")
    shipped = np_dtype.shipped
    for name in SCALARS:
        ty = getattr(tl, name)
        for t in (ty, tl.block_type(ty, [4, 8]), tl.pointer_type(ty), tl.block_type(tl.pointer_type(ty), [16])):
            for _ in range(2):  # asked, then from the memo
                assert np_dtype(t) == shipped(t), (t, np_dtype(t), shipped(t))
    with pytest.raises(KeyError):
        shipped(tl.void)  # no numpy dtype holds it: the memo raises as the shipped function does
    with pytest.raises(KeyError):
        np_dtype(tl.void)
