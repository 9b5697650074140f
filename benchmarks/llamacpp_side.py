"""The llama.cpp side of `benchmarks/e2e_cpu.py`: greedy decoding of a batch of prompts through
llama.cpp's C API (the `llama-cpp-python` bindings, an optional install; never needed by the
README's commands).

The prompts arrive as token ids from the HF tokenizer, so llama.cpp decodes exactly the inputs
the other sides decode. A batch of B prompts is one `llama_decode` of all prompt tokens (B
sequences in one batch), then one `llama_decode` of B tokens per step: llama.cpp's own continuous
batching, as its server and `llama-batched-bench` do it. Greedy is an argmax over each sequence's
logits with the end-of-sequence token banned (the other sides use `ignore_eos` / `min_new_tokens`).
Threads: all cores, as llama.cpp's tools default to on this machine.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path


def _quiet_logs(ll) -> None:
    """llama.cpp logs every load to stderr; keep the benchmark's output readable."""
    global _LOG_CALLBACK  # the C side keeps the pointer: the callback must outlive the model
    _LOG_CALLBACK = ll.llama_log_callback(lambda level, text, user_data: None)
    ll.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


_LOG_CALLBACK = None


class LlamaCppGreedy:
    """run(token_ids_per_prompt, n) -> n greedy new tokens per prompt, from one GGUF file."""

    def __init__(self, gguf: Path, max_batch: int = 8, ctx_per_seq: int = 512, threads: int | None = None):
        import llama_cpp as ll
        import numpy as np

        self.ll, self.np = ll, np
        _quiet_logs(ll)
        ll.llama_backend_init()
        self.model = ll.llama_model_load_from_file(str(gguf).encode(), ll.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = ll.llama_context_default_params()
        threads = threads or os.cpu_count()
        params.n_ctx = max_batch * ctx_per_seq
        params.n_batch = params.n_ctx
        params.n_seq_max = max_batch
        params.n_threads = params.n_threads_batch = threads
        self.ctx = ll.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        vocab = ll.llama_model_get_vocab(self.model)
        self.n_vocab = ll.llama_vocab_n_tokens(vocab)
        self.eos = ll.llama_vocab_eos(vocab)
        self.max_batch, self.capacity = max_batch, params.n_ctx
        self.batch = ll.llama_batch_init(self.capacity, 0, max_batch)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants_logits)."""
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(entries)
        status = self.ll.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def _argmax(self, index: int) -> int:
        logits = self.np.ctypeslib.as_array(self.ll.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,))
        logits = logits.copy()
        logits[self.eos] = -self.np.inf
        return int(logits.argmax())

    def run(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        if len(prompts) > self.max_batch or sum(map(len, prompts)) > self.capacity:
            raise ValueError(f"{len(prompts)} prompts do not fit the context ({self.max_batch} sequences)")
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)
        entries, last = [], []
        for seq, ids in enumerate(prompts):
            entries += [(tok, pos, seq, pos == len(ids) - 1) for pos, tok in enumerate(ids)]
            last.append(len(entries) - 1)
        self._decode(entries)
        out = [[self._argmax(i)] for i in last]
        for step in range(1, n):
            self._decode([(out[seq][-1], len(ids) + step - 1, seq, True) for seq, ids in enumerate(prompts)])
            for seq in range(len(prompts)):
                out[seq].append(self._argmax(seq))
        return out

    def close(self) -> None:
        self.ll.llama_batch_free(self.batch)
        self.ll.llama_free(self.ctx)
        self.ll.llama_model_free(self.model)
