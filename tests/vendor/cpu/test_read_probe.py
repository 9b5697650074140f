"""The read-bandwidth probe (csrc/read_probe.cpp, dlinfer/vendor/cpu/read_probe.py): every byte
read exactly once whatever the split, arguments checked, the exploration's choice consistent."""

import pytest
import torch

from dlinfer.vendor import registry

pytestmark = pytest.mark.skipif(registry.try_load("cpu") is None, reason="the cpu vendor does not load here")


def _kernel():
    from dlinfer.vendor.cpu import build

    return build.module().read_probe


@pytest.mark.parametrize("n", [1, 63, 64, 255, 4096, 100_003, (1 << 20) + 17])
@pytest.mark.parametrize("threads,streams", [(1, 1), (2, 1), (2, 3), (1, 8), (3, 4)])
@pytest.mark.parametrize("prefetch,hint", [(0, 0), (1024, 0), (4096, 1)])
def test_the_checksum_is_the_sum_of_every_byte(n, threads, streams, prefetch, hint):
    g = torch.Generator().manual_seed(n)
    buf = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    expected = int(buf.to(torch.int64).sum())  # < 2^63: the kernel's uint64 sum cannot wrap here
    assert _kernel()(buf, threads, streams, prefetch, hint) == expected


@pytest.mark.parametrize("args,message", [
    ((torch.zeros(64, dtype=torch.int32), 1, 1, 0, 0), "dense uint8"),
    ((torch.zeros(128, dtype=torch.uint8)[::2], 1, 1, 0, 0), "dense uint8"),
    ((torch.zeros(64, dtype=torch.uint8), 0, 1, 0, 0), "threads must be >= 1"),
    ((torch.zeros(64, dtype=torch.uint8), 1, 5, 0, 0), "streams must be"),
    ((torch.zeros(64, dtype=torch.uint8), 1, 1, -1, 0), "prefetch_bytes must be >= 0"),
    ((torch.zeros(64, dtype=torch.uint8), 1, 1, 0, 2), "hint must be 0"),
])
def test_bad_arguments_are_named(args, message):
    with pytest.raises(RuntimeError, match=message):
        _kernel()(*args)


def test_the_exploration_reports_its_best_configuration():
    from dlinfer.vendor.cpu import read_probe

    probe = read_probe.ReadProbe(nbytes=32 << 20)
    exploration = probe.explore(rounds=1, threads=[1, 2])
    assert exploration.best in exploration.rates
    assert exploration.rate == max(exploration.rates.values())
    threads = {c.threads for c in exploration.rates}
    streams = {c.streams for c in exploration.rates}
    assert threads == {1, 2} and streams == set(read_probe.STREAMS)
    assert {c.huge_pages for c in exploration.rates} == {True, False}
    assert probe.measure() > 0
    line = read_probe.summary(exploration)
    assert line.startswith(f"{exploration.rate / 1e9:.1f} GB/s (") and exploration.best.describe() in line
    probe.release()


def test_the_buffer_is_at_least_twice_the_last_level_cache(monkeypatch):
    from dlinfer.utils import machine
    from dlinfer.vendor.cpu import read_probe

    monkeypatch.setattr(machine, "last_level_cache_bytes", lambda: 700 << 20)
    assert read_probe.buffer_bytes() == 1400 << 20
    monkeypatch.setattr(machine, "last_level_cache_bytes", lambda: None)
    assert read_probe.buffer_bytes() == read_probe.GIB
