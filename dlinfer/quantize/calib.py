"""Calibration samples: token windows cut from a local text file (never downloaded)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_CORPUS = Path(__file__).with_name("data") / "calibration.txt"


def samples(tokenizer, path: Path | None, seqlen: int, max_samples: int):
    """Token ids `[S, seqlen]` (int64): consecutive windows of the tokenised text, S <= max_samples.
    The default corpus (data/calibration.txt, written for this project) is used when `path` is None."""
    import torch

    from dlinfer.quantize.source import QuantizeInputError

    path = DEFAULT_CORPUS if path is None else Path(path)
    if not path.is_file():
        raise QuantizeInputError(f"quantize: --calib {str(path)!r} is not a file.")
    text = path.read_text(encoding="utf-8", errors="replace")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    count = min(max_samples, len(ids) // seqlen)
    if count < 1:
        raise QuantizeInputError(f"quantize: the calibration text {str(path)!r} has {len(ids)} tokens, fewer than "
                                 f"one sample of --calib-seqlen {seqlen}.")
    return torch.tensor(ids[:count * seqlen], dtype=torch.long).view(count, seqlen)
