"""Run greedy generation through `lmdeploy.pipeline` on CPU and through HF transformers.

Both sides see exactly the same token ids: LMDeploy's tokenizer encodes each prompt as its
pipeline does (`do_preprocess=False`: no chat template), HF `generate` gets those ids. With
`ignore_eos=True` LMDeploy bans its stop tokens (they become bad words); HF bans the same ids
through `bad_words_ids`, so both produce every requested token under the same rule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

# Smallest gap between HF's best and second-best logit along a reference path for the path to
# count as a fair test: float32 implementations that sum in different orders differ by ~1e-6.
MIN_TOP2_MARGIN = 1e-4


@contextlib.contextmanager
def cpu_pipeline(model_dir: Path, *, trust_remote_code: bool = False, **engine_kwargs) -> Iterator:
    """An `lmdeploy.pipeline` on device_type="cpu" (closed on exit).

    Defaults keep tests small and fast: eager steps (graph mode is tested in tests/graph),
    16-token blocks and a 128-block KV cache (2048 tokens), unless `engine_kwargs` say otherwise.
    `trust_remote_code`: the checkpoint's own config module may run (remote-code InternVL).
    """
    from lmdeploy import PytorchEngineConfig, pipeline

    import dlinfer.framework.lmdeploy_ext  # noqa: F401

    kwargs = dict(device_type="cpu", eager_mode=True, block_size=16, num_gpu_blocks=128, max_batch_size=32)
    kwargs.update(engine_kwargs)
    pipe = pipeline(str(model_dir), backend_config=PytorchEngineConfig(**kwargs), log_level="ERROR",
                    trust_remote_code=trust_remote_code)
    try:
        yield pipe
    finally:
        pipe.close()


class OpCalls:
    """Counts the calls of the named `dlinfer.ops` functions (LMDeploy looks them up on every call)
    for which `where(name, args, kwargs)` holds (every call without `where`), through monkeypatch."""

    def __init__(self, monkeypatch, *names: str, where=None):
        import dlinfer.ops

        self.count = 0
        for name in names:
            original = getattr(dlinfer.ops, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                if where is None or where(_name, args, kwargs):
                    self.count += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(dlinfer.ops, name, counted)


@dataclass
class Generated:
    input_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    banned_ids: list[int]


def greedy_generate(pipe, prompts: Sequence[str], max_new_tokens: int) -> list[Generated]:
    """Greedy tokens of every prompt, all submitted to the engine at once (one batch)."""
    from lmdeploy import GenerationConfig

    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, ignore_eos=True)
    outputs = pipe.infer(list(prompts), gen_config=gen, do_preprocess=False)
    results = []
    for prompt, out in zip(prompts, outputs):
        ids = pipe.async_engine.tokenizer.encode(prompt, add_bos=True)
        assert out.input_token_len == len(ids), (out.input_token_len, len(ids))
        resolved = pipe.async_engine._determine_gen_config(ids, gen)
        banned = sorted(set(resolved.stop_token_ids or []) | set(resolved.bad_token_ids or []))
        results.append(Generated(ids, list(out.token_ids), out.finish_reason, banned))
    return results


class HFReference:
    """HF transformers greedy generation of one checkpoint in float32 (one prompt at a time)."""

    def __init__(self, model_dir: Path):
        from transformers import AutoConfig, AutoModelForCausalLM

        # transformers' SDPA attention (its default) drops Gemma 2's attention soft cap: only its
        # eager attention computes the model as defined.
        capped = getattr(AutoConfig.from_pretrained(model_dir), "attn_logit_softcapping", None)
        kwargs = {"attn_implementation": "eager"} if capped else {}
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()
        self._memo: dict[tuple, tuple[list[int], float]] = {}

    def greedy(self, input_ids: Sequence[int], max_new_tokens: int,
               banned_ids: Sequence[int]) -> tuple[list[int], float]:
        """(new tokens, smallest top-1/top-2 logit gap along the path)."""
        key = (tuple(input_ids), max_new_tokens, tuple(banned_ids))
        if key not in self._memo:
            with torch.inference_mode():
                out = self.model.generate(
                    torch.tensor([list(input_ids)]),
                    attention_mask=torch.ones(1, len(input_ids), dtype=torch.long),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    bad_words_ids=[[i] for i in banned_ids] or None,
                    output_scores=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                )
            tokens = out.sequences[0, len(input_ids):].tolist()
            top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values
            margin = float((top2[:, 0] - top2[:, 1]).min())
            self._memo[key] = (tokens, margin)
        return self._memo[key]


def assert_matches_hf(results: Sequence[Generated], reference: HFReference, max_new_tokens: int) -> None:
    """Every result has `max_new_tokens` tokens equal to HF's greedy tokens for the same ids."""
    for i, res in enumerate(results):
        expected, margin = reference.greedy(res.input_ids, max_new_tokens, res.banned_ids)
        assert margin > MIN_TOP2_MARGIN, (f"prompt {i}: HF's reference path has a near tie ({margin:.2e}); "
                                          "pick other prompts")
        assert len(set(expected)) > 1, f"prompt {i}: HF's reference repeats one token; the test would not discriminate"
        assert res.token_ids == expected, (
            f"prompt {i} ({len(res.input_ids)} tokens): LMDeploy on CPU differs from HF\n"
            f"  lmdeploy: {res.token_ids}\n  hf:       {expected}\n"
            f"  first difference at new token {first_difference(res.token_ids, expected)}"
        )


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first index where two token lists differ (the shorter one's length if one is a prefix of the other)."""
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
