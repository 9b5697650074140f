"""scripts/smollm2.py builds the SmolLM2 folder once even when two processes ask for it at once
(the suite's two workers on a fresh clone): the second waits, then uses the first one's folder.
The conversion is replaced by a stub that records its calls; the lock is the real one."""

from __future__ import annotations

import threading
import time

import smollm2


def test_two_builders_at_once_convert_once(tmp_path, monkeypatch):
    calls = []

    def convert(gguf, out, log):
        calls.append(out)
        time.sleep(0.5)  # long enough for the other builder to arrive while this one holds the lock
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(smollm2, "_convert", convert)
    monkeypatch.setattr(smollm2, "gguf_path", lambda: tmp_path / "unused.gguf")
    folder = tmp_path / "models" / "SmolLM2"
    results = []
    builders = [threading.Thread(target=lambda: results.append(smollm2.build_smollm2(folder, log=lambda _: None)))
                for _ in range(2)]
    for b in builders:
        b.start()
    for b in builders:
        b.join(timeout=30)
    assert results == [folder, folder]
    assert len(calls) == 1, calls
    assert (folder / "config.json").is_file() and smollm2._is_built(folder)
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(".smollm2-")] == []  # no staging left
