"""Calibration and tuning samples: token windows cut from local text files (never downloaded)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_CORPUS = Path(__file__).with_name("data") / "calibration.txt"
# Written for the project (narrative, dialogue, explanations, instructions, news, lists, Markdown,
# code in several languages; none of it in the held-out texts of benchmarks/data): the tuning of
# the scales and norms reads it after DEFAULT_CORPUS (docs/quantize.md, "The tuning (awq)").
TUNING_CORPUS = Path(__file__).with_name("data") / "tuning.txt"


class CalibrationTextWarning(UserWarning):
    """The calibration file is mostly not UTF-8 text."""


def _read(path: Path) -> str:
    from dlinfer.quantize.source import QuantizeInputError

    if not path.is_file():
        raise QuantizeInputError(f"quantize: --calib {str(path)!r} is not a file.")
    raw = path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    unreadable = text.count("\ufffd") + raw.count(b"\0")
    if unreadable > 0.01 * max(1, len(text)):  # calibrating on bytes the tokenizer never sees in use
        import warnings

        warnings.warn(f"quantize: --calib {str(path)!r} does not look like text ({unreadable} of {len(text)} "
                      "characters are not UTF-8 or are NUL); the scales will fit those bytes, not the model's "
                      "inputs.", CalibrationTextWarning, stacklevel=2)
    return text


def _windows(tokenizer, text: str, where: str, seqlen: int, max_samples: int):
    import torch

    from dlinfer.quantize.source import QuantizeInputError

    # verbose=False: a text longer than the model's context is expected here (it is cut into windows)
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    count = min(max_samples, len(ids) // seqlen)
    if count < 1:
        raise QuantizeInputError(f"quantize: the calibration text {where} has {len(ids)} tokens, fewer than "
                                 f"one sample of --calib-seqlen {seqlen}.")
    return torch.tensor(ids[:count * seqlen], dtype=torch.long).view(count, seqlen)


def samples(tokenizer, path: Path | None, seqlen: int, max_samples: int):
    """Token ids `[S, seqlen]` (int64): consecutive windows of the tokenised text, S <= max_samples.
    The default corpus (data/calibration.txt, written for this project) is used when `path` is None."""
    path = DEFAULT_CORPUS if path is None else Path(path)
    return _windows(tokenizer, _read(path), repr(str(path)), seqlen, max_samples)


def tuning_samples(tokenizer, path: Path | None, seqlen: int, max_samples: int):
    """The tuning's samples, `[S, seqlen]`: the windows of `path` when given (the calibration text a
    user passed), else of the default corpus followed by data/tuning.txt."""
    if path is not None:
        return samples(tokenizer, path, seqlen, max_samples)
    text = _read(DEFAULT_CORPUS) + "\n\n" + _read(TUNING_CORPUS)
    return _windows(tokenizer, text, f"{DEFAULT_CORPUS.name} + {TUNING_CORPUS.name}", seqlen, max_samples)
