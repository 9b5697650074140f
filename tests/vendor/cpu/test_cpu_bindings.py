"""The cpu vendor's kernels as extension-module functions (csrc/bindings.cpp): the same results as
their torch.ops registrations, tensors off the CPU refused by name, C++ errors raised as torch
raises them (a ValueError stays a ValueError), every entry point declared in entry_points.h bound, and the GIL
released while a kernel runs."""

import threading
import time

import pytest
import torch

from dlinfer.vendor.cpu import build


@pytest.fixture(scope="module")
def kernels():
    return build.module()


def _cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g)
    r = torch.randn(3, 64, generator=g)
    w = torch.randn(64, generator=g)
    q = torch.randn(3, 4, 32, generator=g)
    k = torch.randn(3, 2, 32, generator=g)
    cos, sin = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g)
    a8 = torch.randint(-128, 128, (3, 64), dtype=torch.int8, generator=g)
    b8 = torch.randint(-128, 128, (40, 64), dtype=torch.int8, generator=g)
    return [
        ("rms_norm", (x, w, 1e-6)),
        ("add_rms_norm", (x, r, w, 1e-6)),
        ("apply_rotary_pos_emb", (q, k, cos, sin)),
        ("silu_and_mul", (x,)),
        ("dynamic_quant", (x,)),
        ("rms_norm_w8a8", (x, w, 1e-6)),
        ("add_rms_norm_w8a8", (x, r, w, 1e-6)),
        ("linear_few_rows", (x, torch.randn(40, 64, generator=g), None)),
        ("int8_matmul", (a8, b8, -1)),
        ("linear_w8a8", (a8, b8, torch.rand(3, generator=g), torch.rand(40, generator=g), torch.bfloat16, None, -1)),
    ]


CASES = _cases()


@pytest.mark.parametrize("name,args", CASES, ids=[name for name, _ in CASES])
def test_module_function_equals_the_registered_op(kernels, name, args):
    got = getattr(kernels, name)(*args)
    want = getattr(torch.ops.dlinfer_cpu, name)(*args)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_in_place_kernel_writes_its_output(kernels):
    """fill_kv_cache through the module writes the caches in place, as the registered op does."""
    key, value = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    caches = [torch.zeros(4, 4, 2, 8) for _ in range(4)]
    slots = torch.tensor([5, 9])
    kernels.fill_kv_cache(key, value, caches[0], caches[1], slots, None, None, None, None)
    torch.ops.dlinfer_cpu.fill_kv_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(caches[0].view(16, 2, 8)[5], key[0])


def test_tensor_off_the_cpu_is_refused_by_name(kernels):
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match=r"dlinfer_cpu\.rms_norm: expected CPU tensors, got one on meta"):
        kernels.rms_norm(x, torch.randn(16, device="meta"), 1e-6)
    with pytest.raises(RuntimeError, match=r"dlinfer_cpu\.linear_few_rows: expected CPU tensors, got one on meta"):
        kernels.linear_few_rows(x, torch.randn(8, 16), torch.randn(8, device="meta"))  # an optional argument too


def test_errors_keep_their_python_type(kernels):
    with pytest.raises(RuntimeError, match="rms_norm: weight must be"):
        kernels.rms_norm(torch.randn(2, 16), torch.randn(16, dtype=torch.float64), 1e-6)
    strided_last = torch.zeros(4, 4, 2, 16)[..., ::2]  # a cache whose last dim is strided: a ValueError
    with pytest.raises(ValueError):
        kernels.fill_kv_cache(torch.randn(1, 2, 8), torch.randn(1, 2, 8), strided_last, strided_last,
                              torch.tensor([0]), None, None, None, None)


def test_gil_is_released_while_a_kernel_runs(kernels):
    """A thread running a long kernel leaves the interpreter to the others: the main thread's loop
    keeps turning (gaps of a few ms at most) instead of stopping for the kernel's whole run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernel on one core, the loop on the other
    try:
        tokens = 512
        while True:  # a kernel call of at least 0.1 s
            g = torch.Generator().manual_seed(1)
            q, kv = torch.randn(tokens, 8, 64, generator=g), torch.randn(tokens, 8, 64, generator=g)
            cu, out = torch.tensor([0, tokens], dtype=torch.int32), torch.empty_like(q)
            start = time.perf_counter()
            kernels.prefill_attention(q, kv, kv, cu, 0.125, None, out, 0, 0.0)
            one_run = time.perf_counter() - start
            if one_run >= 0.1:
                break
            tokens *= 2
        worker = threading.Thread(target=kernels.prefill_attention, args=(q, kv, kv, cu, 0.125, None, out, 0, 0.0))
        stamps = [time.perf_counter()]
        worker.start()
        while worker.is_alive():
            stamps.append(time.perf_counter())
        worker.join()
    finally:
        torch.set_num_threads(threads)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert len(stamps) > 100
    assert stamps[-1] - stamps[0] > one_run / 2  # the loop ran while the kernel did
    assert max(gaps) < one_run / 2, (max(gaps), one_run)  # held, the GIL would stop it for a whole call


def test_every_declared_entry_point_is_listed_and_bound(kernels):
    """entry_points.h declares each kernel function and lists it once in DLINFER_CPU_ENTRY_POINTS,
    from which bindings.cpp binds them all: the list and the declarations hold the same names, and
    the module has each as a function; build.py compiles every csrc/*.cpp."""
    import re

    header = (build.CSRC / "entry_points.h").read_text()
    body = header.split("#define DLINFER_CPU_ENTRY_POINTS", 1)
    declared = set(re.findall(r"^[\w:<>, ]+?[ &*](\w+)\(", body[0], re.M))
    listed = re.findall(r"X\((\w+)\)", body[1])
    assert len(listed) == len(set(listed)), "an entry point is listed twice"
    assert set(listed) == declared, (sorted(declared - set(listed)), sorted(set(listed) - declared))
    assert all(callable(getattr(kernels, name, None)) for name in listed)
    assert set(build.SOURCES) == {p.name for p in build.CSRC.glob("*.cpp")}


def test_the_vendor_notes_match_its_op_table():
    """One NOTES entry per op of the cpu vendor's table, none for an op it lacks; an op the vendor
    takes from the torch vendor says so, and one of its own C++ kernels says C++."""
    from dlinfer.vendor import registry
    from dlinfer.vendor.cpu import NOTES

    vendor = registry.load("cpu")
    assert set(NOTES) == set(vendor.ops)
    for op, fn in vendor.ops.items():
        borrowed = fn.__module__.startswith("dlinfer.vendor.torch")
        assert NOTES[op].startswith("the torch vendor's") == borrowed, (op, fn.__module__, NOTES[op][:40])
        if not borrowed:
            assert NOTES[op].startswith("C++"), (op, NOTES[op][:40])
