"""The per-step metadata memo never returns a stale result."""

import torch

from dlinfer.utils.memo import LastCallMemo


def _memo():
    calls = []

    def f(a, b, n):
        calls.append(1)
        return (a.sum() + b.sum() + n).item()

    return LastCallMemo(f), calls


def test_hit_on_equal_cpu_tensors_and_views():
    memo, calls = _memo()
    base = torch.arange(5)
    b = torch.ones(3)
    assert memo(base[1:], b, 2) == 10 + 3 + 2
    assert memo(base[1:], b, 2) == 15  # a fresh view of the same data: hit
    assert memo(torch.arange(5)[1:].clone(), b.clone(), 2) == 15  # equal contents: hit
    assert len(calls) == 1


def test_miss_on_in_place_edit_new_values_and_other_scalars():
    memo, calls = _memo()
    a, b = torch.arange(4), torch.ones(2)
    memo(a, b, 0)
    a[0] = 100
    assert memo(a, b, 0) == a.sum().item() + 2
    assert memo(a, b, 1) == a.sum().item() + 3
    assert memo(a[:3], b, 1) == a[:3].sum().item() + 3
    assert len(calls) == 4


def test_inference_tensors_are_compared_by_value():
    memo, calls = _memo()
    with torch.inference_mode():
        a, b = torch.arange(4), torch.ones(2)
        memo(a, b, 0)
        a.add_(1)  # no version counter in inference mode: contents decide
        assert memo(a, b, 0) == a.sum().item() + 2
        assert memo(a, b, 0) == a.sum().item() + 2
    assert len(calls) == 2


def test_large_cpu_tensors_compared_by_contents():
    """Beyond _LIST_LIMIT elements the memo keeps a private copy and compares with torch.equal."""
    memo, calls = _memo()
    a, b = torch.arange(1000), torch.ones(300)
    expected = a.sum().item() + 300
    assert memo(a, b, 0) == expected
    assert memo(a.clone(), b.clone(), 0) == expected  # equal contents: hit
    assert len(calls) == 1
    a[999] = 0  # an in-place edit of the remembered argument itself is seen
    assert memo(a, b, 0) == a.sum().item() + 300
    assert len(calls) == 2
