"""patches/greedy_sampling.py: an all-greedy batch's argmax on CPU logits as max(-1).indices."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lmdeploy")


def _adversarial_logits(dtype, rows, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (rows, vocab), generator=g).float()  # many ties for the maximum
    x[0, torch.randint(0, vocab, (2,), generator=g)] = float("nan")
    x[rows - 1, torch.randint(0, vocab, (2,), generator=g)] = float("inf")
    if rows > 2:
        x[1] = float("-inf")
        x[2, :5] = float("nan")
    return x.to(dtype)


def test_greedy_sampling_is_patched():
    from lmdeploy.pytorch.engine.logits_process import FusedLogitsProcessor

    import dlinfer.framework.lmdeploy_ext  # noqa: F401
    from dlinfer.framework.lmdeploy_ext import patching

    assert patching.is_patched(FusedLogitsProcessor.__dict__["sampling"])
    assert patching.applied("dlinfer.framework.lmdeploy_ext.patches.greedy_sampling") == (1, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,vocab", [(1, 7), (3, 49152), (8, 128256), (4, 33)])
def test_greedy_indices_equal_argmax(dtype, rows, vocab):
    from lmdeploy.pytorch.engine.logits_process import FusedLogitsProcessor

    import dlinfer.framework.lmdeploy_ext  # noqa: F401

    greedy = SimpleNamespace(sampling_inputs=SimpleNamespace(max_top_k=1))
    for seed in range(3):
        logits = _adversarial_logits(dtype, rows, vocab, seed)
        got = FusedLogitsProcessor.sampling(greedy, logits)
        assert got.dtype == torch.int64 and got.shape == (rows,)
        assert torch.equal(got, logits.argmax(-1))
        # plain random logits too (no ties: the common case)
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)).to(dtype)
        assert torch.equal(FusedLogitsProcessor.sampling(greedy, logits), logits.argmax(-1))


def test_other_sampling_goes_to_lmdeploy():
    """max_top_k != 1 (top-k / top-p sampling) runs the original sampling; greedy does not."""
    from dlinfer.framework.lmdeploy_ext.patches.greedy_sampling import _patch_sampling

    calls = []
    wrapper = _patch_sampling(lambda self, logits: calls.append(logits) or "lmdeploy")
    logits = torch.randn(2, 50)
    assert wrapper(SimpleNamespace(sampling_inputs=SimpleNamespace(max_top_k=40)), logits) == "lmdeploy"
    assert calls == [logits]
    greedy = wrapper(SimpleNamespace(sampling_inputs=SimpleNamespace(max_top_k=1)), logits)
    assert torch.equal(greedy, logits.argmax(-1)) and calls == [logits]
