"""The cpu vendor: selection, which path each call takes, and what bad metadata cannot do.

Its numerics are covered by the op parity suite (tests/ops runs every available vendor); this file
checks what is particular to it.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import dlinfer.vendor
from dlinfer.vendor import kv_layouts, registry, selection
from dlinfer.vendor.cpu import build

HAS_COMPILER = build.find_compiler() is not None


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: the cpu vendor cannot be built here")
def test_cpu_vendor_loads_where_a_compiler_exists():
    """Where it can be built it must: otherwise the parity suite would quietly leave it out."""
    assert "cpu" in dlinfer.vendor.available(), registry.failures().get("cpu")


needs_cpu_vendor = pytest.mark.skipif("cpu" not in dlinfer.vendor.available(),
                                      reason=f"cpu vendor cannot load here: {registry.failures().get('cpu')}")


def _run(code: str, **env) -> str:
    full_env = {**os.environ, **env}
    for key, value in env.items():
        if value is None:
            full_env.pop(key)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@needs_cpu_vendor
def test_default_vendor_on_cpu_is_cpu_and_env_overrides_it():
    code = "import dlinfer.vendor as V, dlinfer.ops as ops, torch; ops.rms_norm(torch.ones(1, 8), torch.ones(8)); " \
           "print(V.vendor_name, V.current('cpu').name)"
    assert _run(code, DLINFER_VENDOR=None) == "cpu cpu"
    assert _run(code, DLINFER_VENDOR="torch") == "torch torch"


@needs_cpu_vendor
def test_a_cpu_vendor_that_cannot_build_leaves_the_torch_vendor_with_a_warning(monkeypatch):
    def broken():
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(registry, "_loaded", {k: v for k, v in registry._loaded.items() if k != "cpu"})
    monkeypatch.setattr(registry, "_failures", {})
    real = registry._load_uncached
    monkeypatch.setattr(registry, "_load_uncached", lambda name: broken() if name == "cpu" else real(name))
    selection.reset()
    try:
        with pytest.warns(UserWarning, match=r"vendor 'cpu' cannot load \(RuntimeError: no C\+\+ compiler\)"):
            assert selection.current("cpu").name == "torch"
        assert "cpu" not in registry.available()
    finally:
        selection.reset()


@needs_cpu_vendor
def test_linear_path_choice():
    from dlinfer.vendor.cpu import kernels

    w = torch.randn(5, 7)
    for rows in range(kernels.MAX_ROWS + 1):
        assert kernels.uses_few_rows(torch.randn(rows, 7), w, None)
    assert kernels.MAX_ROWS == 8
    assert not kernels.uses_few_rows(torch.randn(kernels.MAX_ROWS + 1, 7), w, None)  # BLAS beyond
    for dtype in (torch.bfloat16, torch.float16):  # 16-bit: csrc/linear_16bit.cpp
        assert kernels.uses_few_rows(torch.randn(8, 7, dtype=dtype), w.to(dtype), torch.randn(5, dtype=dtype))
        assert not kernels.uses_few_rows(torch.randn(9, 7, dtype=dtype), w.to(dtype), None)
        assert not kernels.uses_few_rows(torch.randn(1, 7, dtype=dtype), w, None)  # mixed dtypes: torch's rules
        assert not kernels.uses_few_rows(torch.randn(1, 7, dtype=dtype), w.to(dtype), torch.randn(5))
    assert not kernels.uses_few_rows(torch.randn(1, 7, dtype=torch.float64), w.double(), None)
    assert not kernels.uses_few_rows(torch.randn(1, 7), torch.randn(7, 5).t(), None)  # strided weight
    assert not kernels.uses_few_rows(torch.randn(1, 7, requires_grad=True), w, None)  # autograd records it
    with torch.inference_mode():
        assert kernels.uses_few_rows(torch.randn(1, 7, requires_grad=True), w, None)
    x = torch.randn(3, 20)[:, 2:9]  # row stride 20: rows need only be dense
    assert kernels.uses_few_rows(x, w, torch.randn(5))
    torch.testing.assert_close(kernels.linear(x, w, None), x.double().matmul(w.double().t()).float())


@needs_cpu_vendor
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_norm_weights_and_rotary_tables_are_read_as_stored(dtype):
    """The norm weight (also of the fused norm + quantisation ops) and cos / sin reach the kernels in the
    activation dtype, no float32 copy
    per call; widening them is exact, so the results equal those from float32 copies bit for bit."""
    from dlinfer.vendor.cpu import kernels

    g = torch.Generator().manual_seed(5)
    x, r = (torch.randn(3, 72, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(72, generator=g).to(dtype)
    assert torch.equal(torch.ops.dlinfer_cpu.rms_norm(x, w, 1e-6), torch.ops.dlinfer_cpu.rms_norm(x, w.float(), 1e-6))
    for a, b in zip(torch.ops.dlinfer_cpu.add_rms_norm(x, r, w, 1e-6),
                    torch.ops.dlinfer_cpu.add_rms_norm(x, r, w.float(), 1e-6)):
        assert torch.equal(a, b)
    q, k = torch.randn(3, 4, 40, generator=g).to(dtype), torch.randn(3, 2, 40, generator=g).to(dtype)
    cos, sin = torch.randn(3, 36, generator=g).to(dtype), torch.randn(3, 36, generator=g).to(dtype)
    for a, b in zip(torch.ops.dlinfer_cpu.apply_rotary_pos_emb(q, k, cos, sin),
                    torch.ops.dlinfer_cpu.apply_rotary_pos_emb(q, k, cos.float(), sin.float())):
        assert torch.equal(a, b)
    assert torch.equal(kernels.rms_norm(x, w, 1e-6), torch.ops.dlinfer_cpu.rms_norm(x, w.float(), 1e-6))
    # the fused norm + int8 quantisation ops read the weight the same way
    kernel = torch.ops.dlinfer_cpu.rms_norm_w8a8
    for a, b in zip(kernel(x, w, 1e-6), kernel(x, w.float(), 1e-6)):
        assert torch.equal(a, b)
    for a, b in zip(torch.ops.dlinfer_cpu.add_rms_norm_w8a8(x, r, w, 1e-6),
                    torch.ops.dlinfer_cpu.add_rms_norm_w8a8(x, r, w.float(), 1e-6)):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match=r"rms_norm_w8a8: hidden_states \[N, H\], weight \[H\] float32 or"):
        torch.ops.dlinfer_cpu.rms_norm_w8a8(x, w.double(), 1e-6)
    with pytest.raises(RuntimeError, match=r"rms_norm: weight must be \[72\] float32 or"):
        torch.ops.dlinfer_cpu.rms_norm(x, w.double(), 1e-6)
    with pytest.raises(RuntimeError, match=r"rotary: cos/sin must be dense \[T, R\], float32 or"):
        torch.ops.dlinfer_cpu.apply_rotary_pos_emb(q, k, cos.double(), sin.double())


@needs_cpu_vendor
@pytest.mark.parametrize("tokens,kv_heads,longest,threads,splits", [
    (1, 1, 1901, 2, 4),    # tests/ops "b1_long_..._split": 4 splits on this 2-thread machine
    (2, 1, 1301, 2, 2),    # "b2_long_..._split"
    (1, 1, 200, 2, 1),     # too short to split (< 256 keys a split)
    (1, 3, 4000, 2, 2),    # 3 items for 2 threads
    (8, 8, 4000, 16, 1),   # enough items
    (0, 8, 0, 2, 1),
])
def test_decode_split_rule(tokens, kv_heads, longest, threads, splits):
    assert torch.ops.dlinfer_cpu.decode_num_splits(tokens, kv_heads, longest, 16, threads) == splits


@needs_cpu_vendor
def test_parity_suite_exercises_the_split_kernel():
    assert torch.get_num_threads() >= 1
    for tokens, longest in ((1, 1901), (2, 1301)):
        assert torch.ops.dlinfer_cpu.decode_num_splits(tokens, 1, longest, 16, torch.get_num_threads()) > 1


@needs_cpu_vendor
@pytest.mark.parametrize("layout", kv_layouts.KV_LAYOUTS)
def test_garbage_block_ids_and_slots_stay_inside_the_caches(layout):
    """Value checks off (the op layer would reject these): the kernels themselves must clamp
    block ids and skip slots outside the cache rather than touch memory they do not own."""
    vendor = dlinfer.vendor.load("cpu")
    nb, bs, h, d = 3, 4, 2, 16
    k_cache = torch.randn(nb, *kv_layouts.block_shape(layout, bs, h, d))
    v_cache = torch.randn(nb, *kv_layouts.block_shape(layout, bs, h, d))
    before_k, before_v = k_cache.clone(), v_cache.clone()
    key, value = torch.randn(4, h, d), torch.randn(4, h, d)
    slots = torch.tensor([-1, nb * bs, 2**40, 5])
    vendor.ops["fill_kv_cache"](key, value, k_cache, v_cache, slots, layout)
    kv_layouts.canonical(before_k, layout)[1, 1] = key[3]  # slot 5 = block 1, offset 1
    kv_layouts.canonical(before_v, layout)[1, 1] = value[3]
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)

    q = torch.randn(2, 4, d)
    out = torch.full((2, 4, d), float("nan"))
    table = torch.tensor([[2**30, -5, 1], [0, 7, 2**20]], dtype=torch.int64)
    vendor.ops["paged_decode_attention"](q, k_cache, v_cache, table, torch.tensor([0, 1, 2], dtype=torch.int32),
                                         torch.tensor([12, 9], dtype=torch.int32), 12, d ** -0.5, None, out,
                                         layout)
    assert torch.isfinite(out).all()


@needs_cpu_vendor
def test_kernels_are_built_for_the_detected_instruction_set():
    assert build.module_name().endswith(build.isa().lower())
    assert build.isa() in ("AVX512", "AVX2", "DEFAULT")
    assert "-ffp-contract=off" in build.flags()


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler here")
def test_find_compiler_names_the_compiler_and_its_version():
    path, version = build.find_compiler()
    assert os.path.isabs(path) and os.access(path, os.X_OK)
    assert version and "\n" not in version


@pytest.mark.parametrize("cxx,looked_for", [
    (None, "looked for $CXX, c++, g++, clang++"),
    ("/nonexistent/dlinfer-test-c++", "looked for $CXX=/nonexistent/dlinfer-test-c++"),
])
def test_no_compiler_is_one_line_before_any_build(tmp_path, cxx, looked_for):
    """A machine without a compiler gets one line naming what was looked for, not a ninja log."""
    bare = tmp_path / "bin"  # PATH: no compiler, no ninja
    bare.mkdir()
    extensions = tmp_path / "torch_extensions"
    env = {**os.environ, "PATH": str(bare), "TORCH_EXTENSIONS_DIR": str(extensions)}
    env.pop("CXX", None)
    if cxx is not None:
        env["CXX"] = cxx
    code = textwrap.dedent("""
        from dlinfer.errors import VendorError
        from dlinfer.vendor.cpu import build
        try:
            build.build()
        except VendorError as exc:
            print(exc)
        else:
            print("built")
    """)
    done = subprocess.run([os.path.abspath(sys.executable), "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"no C++ compiler found ({looked_for})"), done.stdout
    assert "install g++" in lines[0]
    log = (done.stdout + done.stderr).lower()
    for build_output in ("ninja", "error building", "failed:", "[dlinfer] building", "-c /"):
        assert build_output not in log, log
    assert not extensions.exists() or not any(extensions.iterdir())  # nothing was attempted


def test_a_build_lock_left_by_a_killed_build_is_removed_and_said(tmp_path, capsys):
    """torch's builder waits, with no limit, for the `lock` file of a build in progress: one killed
    half-way (a stopped test run did it here) left every later process hanging in silence."""
    (tmp_path / "lock").touch()
    with build._builder_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert "a build of the cpu vendor's kernels was stopped before it ended" in capsys.readouterr().err


def test_a_live_builder_is_waited_for_and_its_lock_kept(tmp_path, capsys):
    """Another process building now holds the flock and torch's `lock`: this one waits for it to
    end (it removes its own `lock`), and removes nothing."""
    script = textwrap.dedent(f"""
        import fcntl, sys, time, pathlib
        folder = pathlib.Path({str(tmp_path)!r})
        with open(folder / "dlinfer.flock", "a") as h:
            fcntl.flock(h, fcntl.LOCK_EX)
            (folder / "lock").touch()
            print("holding", flush=True)
            time.sleep(1.5)
            (folder / "lock").unlink()
    """)
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        import time

        start = time.perf_counter()
        with build._builder_lock(tmp_path):
            waited = time.perf_counter() - start
        assert waited > 0.5, waited
    finally:
        holder.wait(timeout=30)
    assert "stopped before it ended" not in capsys.readouterr().err
