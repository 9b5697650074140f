"""Freeing a thread's OpenMP worker pool (dlinfer.utils.openmp)."""

import threading

import torch

from dlinfer.utils import openmp


def _parallel_sum() -> float:
    x = torch.arange(1 << 22, dtype=torch.float64)  # large enough for a parallel region
    return float(x.sum())


def test_release_then_parallel_ops_still_correct():
    expected = (1 << 22) * ((1 << 22) - 1) / 2
    assert _parallel_sum() == expected
    freed = openmp.release_thread_pool()
    if torch.backends.openmp.is_available() and openmp._libgomp() is not None:
        assert freed  # libgomp (torch's Linux builds): the pool was freed
    assert _parallel_sum() == expected  # the next parallel region starts a new pool


def test_release_on_another_thread_leaves_this_one_working():
    expected = (1 << 22) * ((1 << 22) - 1) / 2
    results = []

    def work():
        results.append(_parallel_sum())
        openmp.release_thread_pool()
        results.append(_parallel_sum())

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert results == [expected, expected]
    assert _parallel_sum() == expected


def test_finds_the_libgomp_torch_uses():
    lib = openmp._libgomp()
    if lib is None:  # not Linux, or another OpenMP runtime: nothing to free, nothing to find
        return
    assert hasattr(lib, "omp_pause_resource_all")
