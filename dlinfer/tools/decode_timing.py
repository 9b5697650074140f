"""How dlinfer times an LMDeploy engine's decoding: shared by `python -m dlinfer bench` (bench.py)
and benchmarks/e2e_cpu.py, so that both report the same quantity the same way.

- Decode tokens/s of a batch of B prompts: B * (N - 1) / (T(N) - T(1)), where T(n) is the wall
  time to generate exactly n new tokens for the whole batch (greedy, end of sequence banned:
  `ignore_eos=True`); the prefill and the first token cancel out. Each T is the best of the
  repeats.
- Time to first token: the wall time of one greedy token for one prompt of exactly n token ids
  (`prompt_ids`), the same ids on every side.
- The bytes a decode step reads (`step_bytes`): every parameter and buffer of the engine's model
  once, the embedding table only where the LM head reads it; weights GB/s = bytes x tokens/s at
  batch 1, compared with the read-bandwidth probe (dlinfer/vendor/cpu/read_probe.py).
"""

from __future__ import annotations

import warnings
from typing import Callable, List, Optional, Sequence

import torch

QUESTIONS = (
    "What is the capital of France?",
    "Give three tips for staying healthy.",
    "Explain in two sentences what a CPU cache is.",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "Name three primary colors.",
    "What does a compiler do?",
    "Describe a cat in one sentence.",
)


def chat_prompts(tokenizer, count: int = len(QUESTIONS)) -> List[str]:
    """`count` prompts as the model's chat template writes them (the questions as they are for a
    tokenizer without a template); cycled past the 8 questions."""
    prompts = []
    for i in range(count):
        question = QUESTIONS[i % len(QUESTIONS)]
        if getattr(tokenizer, "chat_template", None):
            prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                         add_generation_prompt=True))
        else:
            prompts.append(question)
    return prompts


def prompt_ids(tokenizer, n: int, prompts: Sequence[str]) -> List[int]:
    """n token ids: the prompts' tokens one after another, repeated."""
    pool = [i for p in prompts for i in tokenizer(p, add_special_tokens=False).input_ids]
    return (pool * (n // max(1, len(pool)) + 1))[:n]


def generator(pipe) -> Callable:
    """run(batch, n, ids=None) -> token ids [batch][n]: exactly n greedy new tokens for the first
    `batch` prompts given at the call (`prompts=`) or for one prompt of token ids, through the
    pipeline's own request path."""
    from lmdeploy import GenerationConfig

    def run(batch: int, n: int, prompts: Optional[Sequence[str]] = None, ids: Optional[List[int]] = None) -> list:
        gen = GenerationConfig(max_new_tokens=n, do_sample=False, ignore_eos=True)
        if ids is not None:  # token ids in: the pipeline's request path with input_ids instead of messages
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Pipeline._infer is marked deprecated in 0.18
                request = dict(session_id=pipe.session_mgr.get(), messages=None, input_ids=list(ids), gen_config=gen,
                               stream_response=False)
                out = None
                for piece in next(iter(pipe._infer(iter([request]), multiplex=False))):
                    out = out.extend(piece) if out else piece
            if len(out.token_ids) != n:
                raise RuntimeError(f"asked for {n} tokens, got {len(out.token_ids)} ({out.finish_reason})")
            return [list(out.token_ids)]
        outs = pipe.infer(list(prompts[:batch]), gen_config=gen, do_preprocess=False)
        if not all(len(o.token_ids) == n for o in outs):
            raise RuntimeError(f"asked for {n} tokens each, got {[len(o.token_ids) for o in outs]}")
        return [list(o.token_ids) for o in outs]

    return run


def decode_rate(batch: int, new_tokens: int, t_n: float, t_1: float) -> float:
    """Decode tokens/s from the best wall times of N and of 1 new tokens for a batch."""
    return batch * (new_tokens - 1) / (t_n - t_1) if t_n > t_1 else float("nan")


def step_bytes(pipe) -> Optional[int]:
    """Bytes of weights a decode step of the engine's model reads: every parameter and buffer once
    (by its own data, not its storage: on CPU the engine moves all of them into one huge-page
    arena), less the input embedding table unless the LM head reads that table (a tied float head;
    the int8 and int4 heads of a tied model keep the table as their `weight` but read their own
    quantised copy, backend/lm_head.py), and less the canonical scales and zero points of a W4A16 layer whose weight
    is in the k_interleaved layout (which carries its own copy in the stream, dlinfer/vendor/
    w4_layouts.py); a lookup reads only its rows. None when the model is not in this process (the
    engine's ranks run in processes of their own: tp > 1)."""
    agent = getattr(pipe.async_engine.engine.executor, "model_agent", None)
    if agent is None:
        return None
    runner = agent.patched_model
    model = runner.get_model() if hasattr(runner, "get_model") else runner
    unread = set()
    for module in model.modules():
        qweight = getattr(module, "qweight", None)
        if isinstance(qweight, torch.Tensor) and qweight.dtype == torch.uint8 and qweight.dim() == 3:
            unread.update(t.data_ptr() for t in (getattr(module, "scales", None), getattr(module, "qzeros", None))
                          if isinstance(t, torch.Tensor))
    spans = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in unread:
            spans[t.data_ptr()] = max(spans.get(t.data_ptr(), 0), t.numel() * t.element_size())
    embed = next((m.weight for name, m in model.named_modules() if name.endswith("embed_tokens")), None)
    head = next((m for name, m in model.named_modules() if name.endswith("lm_head")), None)
    head_weight = getattr(head, "weight", None)
    quantised_head = getattr(head, "qweight", None) is not None
    if embed is not None and (quantised_head or head_weight is None or head_weight.data_ptr() != embed.data_ptr()):
        spans.pop(embed.data_ptr(), None)
    return sum(spans.values())
