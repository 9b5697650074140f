"""DLINFER_OP_CAPTURE=DIR / `dlinfer.tools.capture(DIR)`: save every op call (its canonical
arguments before the call, its results and the in-place arguments after it) for
`python -m dlinfer replay DIR` (docs/tools.md, "Capture").

DIR/calls.jsonl   one JSON line per saved call: call number (the order of all op calls), op,
                  vendor, device, file, bytes, and each argument's dtype and shape (or value)
DIR/calls/N.pt    the call (torch.save; read back with weights_only=True)
DIR/blobs/H.pt    tensors of 64 KiB or more and KV-cache blocks, by content hash, stored once
DIR/summary.json  counts saved and dropped per op, the limits, written when the capture stops

Limits keep a long run from filling the disk: `limit` calls (DLINFER_OP_CAPTURE_LIMIT, default
10000), `max_bytes` (DLINFER_OP_CAPTURE_BYTES, default 2 GiB: the capture stops at the first
call that would pass it) and an op filter with optional per-op counts (DLINFER_OP_CAPTURE_OPS=
paged_decode_attention:50,rms_norm). The first call a limit drops prints one message; the
counts of dropped calls go to summary.json and the closing summary. `skip` (DLINFER_OP_CAPTURE_SKIP)
leaves out the first N calls the capture sees, e.g. an engine's warm-up.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import threading
from typing import Dict, Mapping, Optional, Tuple, Union

import torch

from dlinfer.tools import _record
from dlinfer.tools._hook import Call, Tool, describe, result_names, results_of, say

DEFAULT_LIMIT = 10000
DEFAULT_BYTES = 2 << 30


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _serialise(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class _Writer:
    """One capture directory: calls.jsonl, calls/, blobs/ (each blob written once)."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        if os.path.exists(os.path.join(self.root, "calls.jsonl")):
            for name in ("calls", "blobs"):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
            for name in ("calls.jsonl", "summary.json"):
                if os.path.exists(os.path.join(self.root, name)):
                    os.remove(os.path.join(self.root, name))
            self.replaced = True
        else:
            self.replaced = False
        os.makedirs(os.path.join(self.root, "calls"), exist_ok=True)
        os.makedirs(os.path.join(self.root, "blobs"), exist_ok=True)
        self.known: set = set()
        self.index = open(os.path.join(self.root, "calls.jsonl"), "a")

    def prepare(self, call: Call, record: dict, pending: _record.Pending) -> Tuple[int, list]:
        """(bytes, [(path, serialised bytes, blob hash or None)]) of what saving the call adds: its
        file and the blobs not stored yet. Serialised in memory first: the byte limit counts exact
        sizes."""
        files = []
        for key, tensor in pending.blobs.items():
            if key not in self.known:
                files.append((os.path.join("blobs", f"{key}.pt"), _serialise(tensor), key))
        files.append((os.path.join("calls", f"{call.index:07d}.pt"), _serialise(record), None))
        return sum(len(data) for _, data, _ in files), files

    def write(self, files: list, meta: dict) -> None:
        """Write the files `prepare` gave and the call's index line."""
        for name, data, key in files:
            with open(os.path.join(self.root, name), "wb") as f:
                f.write(data)
            if key is not None:
                self.known.add(key)
        meta = dict(meta, file=files[-1][0], bytes=sum(len(data) for _, data, _ in files))
        self.index.write(json.dumps(meta) + "\n")
        self.index.flush()

    def close(self, summary: dict) -> None:
        self.index.close()
        with open(os.path.join(self.root, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)


def _cache_positions(call: Call) -> tuple:
    if not call.spec.takes_kv_cache:
        return ()
    return tuple(call.names.index(n) for n in _record.CACHE_ARGS)


def _encode_outputs(call: Call, result, written_after: Mapping, pending: _record.Pending):
    """(result refs, {in-place argument: ref}) of a call: caches as per-block blobs."""
    results = [pending.ref(r) for r in results_of(result)]
    written = {name: pending.cache(v) if name in _record.CACHE_ARGS else pending.ref(v)
               for name, v in written_after.items()}
    return results, written


def write_single(folder: str, call: Call, args: list, result, written_after: Mapping) -> None:
    """One call as a capture directory of its own (compare's dumps); caches already compacted."""
    writer = _Writer(folder)
    pending = _record.Pending()
    spans, entries = _record.encode_args(args, _cache_positions(call), pending)
    results, written = _encode_outputs(call, result, written_after, pending)
    record, meta = _build_meta(call, None, spans, entries, results, written, result)
    writer.write(writer.prepare(call, record, pending)[1], meta)
    writer.close({"saved": 1, "note": "one call dumped by DLINFER_OP_COMPARE: its arguments, and the "
                                      "results of the vendor that left tolerance"})


OpsArg = Union[None, str, list, tuple, set, frozenset, Mapping[str, Optional[int]]]


def parse_ops(spec: OpsArg) -> Optional[Dict[str, Optional[int]]]:
    """op filter -> {op: per-op call limit or None}; "a,b:10" or an iterable or a mapping."""
    if spec is None:
        return None
    if isinstance(spec, Mapping):
        return dict(spec)
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: Dict[str, Optional[int]] = {}
    for item in items:
        item = item.strip()
        if not item:
            continue
        name, _, count = item.partition(":")
        try:
            out[name.strip()] = int(count) if count.strip() else None
        except ValueError:
            raise ValueError(f"{item!r}: expected an op name or op:N") from None
    return out


class Capture(Tool):
    """Save every call (of `ops`) under `directory`; see the module docstring for the format and
    the limits (`limit` calls, `max_bytes`; 0 or None: no limit; the first `skip` calls are left
    out). `kv="full"` saves whole KV caches instead of the blocks each call touches."""

    name = "capture"

    def __init__(self, directory: str, limit: Optional[int] = DEFAULT_LIMIT, max_bytes: Optional[int] = DEFAULT_BYTES,
                 ops: OpsArg = None, kv: str = "blocks", skip: int = 0):
        self.op_limits = parse_ops(ops)
        super().__init__(None if self.op_limits is None else list(self.op_limits))
        if kv not in ("blocks", "full"):
            raise ValueError(f"dlinfer.tools.capture: kv must be 'blocks' or 'full', got {kv!r}")
        self.directory, self.limit, self.max_bytes, self.kv = directory, limit or None, max_bytes or None, kv
        self.skip = skip
        self.skipped = 0
        self.env_names = {"limit": "limit", "bytes": "max_bytes", "op": "ops"}  # how messages name the limits
        self._writer: Optional[_Writer] = None
        self.seen = 0
        self.saved = 0
        self.bytes = 0
        self._pending = 0
        self.per_op: Dict[str, Dict[str, int]] = {}
        self.dropped: Dict[str, int] = {}  # reason -> calls
        self._stopped: Optional[str] = None  # "bytes" once the byte limit was hit
        self._closed = threading.Event()

    # -- lifecycle

    def start(self) -> "Capture":
        if self._writer is None:
            self._writer = _Writer(self.directory)
            if self._writer.replaced:
                say(self.name, f"{self._writer.root} held a capture: replaced")
        return super().start()

    def close(self) -> None:
        with self.lock:
            if self._writer is None or self._closed.is_set():
                return
            self._closed.set()
            self._writer.close(self.summary_dict())

    # -- the hook

    def _drop(self, call: Call, reason: str, message: str) -> None:
        first = reason not in self.dropped
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        self.per_op.setdefault(call.op, {"saved": 0, "dropped": 0})["dropped"] += 1
        if first:
            say(self.name, f"{message} at {call.title()}: later calls are not saved (counted as dropped in "
                           f"{os.path.join(self._writer.root, 'summary.json')})")

    def before(self, call: Call):
        with self.lock:
            if self._closed.is_set():
                return None
            self.seen += 1
            if self.seen <= self.skip:
                self.skipped += 1
                return None
            op_stats = self.per_op.setdefault(call.op, {"saved": 0, "dropped": 0})
            op_limit = self.op_limits.get(call.op) if self.op_limits else None
            if self._stopped == "bytes":
                self._drop(call, "bytes", "")
                return None
            if self.limit is not None and self.saved + self._pending >= self.limit:
                self._drop(call, "limit", f"call limit {self.limit} ({self.env_names['limit']}) reached")
                return None
            if op_limit is not None and op_stats["saved"] + op_stats.get("pending", 0) >= op_limit:
                self._drop(call, f"op:{call.op}", f"limit of {op_limit} {call.op} calls ({self.env_names['op']}) "
                                                  f"reached")
                return None
            self._pending += 1
            op_stats["pending"] = op_stats.get("pending", 0) + 1
        try:
            args, blocks = _record.compacted_args(call, self.kv)
            pending = _record.Pending()
            # the arguments as they are before the call (in-place ones change): copied now
            spans, entries = _record.encode_args(args, _cache_positions(call), pending)
        except BaseException:
            self._unreserve(call)
            raise
        return blocks, pending, spans, entries

    def _unreserve(self, call: Call) -> None:
        with self.lock:
            self._pending -= 1
            self.per_op[call.op]["pending"] -= 1

    def after(self, call: Call, result, state) -> None:
        blocks, pending, spans, entries = state
        try:
            written_after = {}
            for name in call.spec.mutates:
                value = call.arg(name)
                written_after[name] = _record.cache_after(value, blocks) if name in _record.CACHE_ARGS else value
            results, written = _encode_outputs(call, result, written_after, pending)
            record, meta = _build_meta(call, blocks, spans, entries, results, written, result)
        except BaseException:
            self._unreserve(call)
            raise
        with self.lock:
            self._pending -= 1
            op_stats = self.per_op[call.op]
            op_stats["pending"] -= 1
            if self._closed.is_set():
                return
            size, files = self._writer.prepare(call, record, pending)
            if self.max_bytes is not None and self.bytes + size > self.max_bytes:
                self._stopped = "bytes"
                self._drop(call, "bytes", f"byte limit {_size(self.max_bytes)} ({self.env_names['bytes']}) reached "
                                          f"({_size(self.bytes)} saved, this call needs {_size(size)})")
                return
            self._writer.write(files, meta)
            self.bytes += size
            self.saved += 1
            op_stats["saved"] += 1

    # -- reports

    def summary_dict(self) -> dict:
        per_op = {op: {"saved": s["saved"], "dropped": s["dropped"]} for op, s in sorted(self.per_op.items())}
        return {
            "format": _record.FORMAT, "directory": self._writer.root if self._writer else self.directory,
            "calls_seen": self.seen, "skipped": self.skipped, "saved": self.saved, "bytes": self.bytes,
            "dropped": dict(self.dropped),
            "per_op": per_op, "limits": {"calls": self.limit, "bytes": self.max_bytes, "ops": self.op_limits},
            "kv": self.kv,
        }

    def summary(self) -> str:
        dropped = sum(self.dropped.values())
        reasons = ", ".join(f"{k}: {v}" for k, v in self.dropped.items())
        why = f"; {dropped} dropped by limits ({reasons})" if dropped else ""
        root = self._writer.root if self._writer else self.directory
        return f"[dlinfer capture] {self.saved} calls saved to {root} ({_size(self.bytes)}){why}"


def _build_meta(call: Call, blocks, spans, entries, results, written, result):
    nb = None
    if blocks is not None:
        nb = _record.blocks_and_size(call.arg("key_cache"), call.arg("kv_layout"))[0]
    record = {
        "format": _record.FORMAT, "call": call.index, "op": call.op, "vendor": call.vendor,
        "device": str(call.device), "spans": spans, "args": entries, "results": results, "written": written,
        "kv_blocks": None if blocks is None else blocks.tolist(), "kv_nb": nb,
    }
    meta = {
        "call": call.index, "op": call.op, "vendor": call.vendor, "device": str(call.device),
        "args": {n: describe(a) for n, a in zip(call.names, call.args)},
        "results": {n: describe(r) for n, r in zip(result_names(call.spec), results_of(result))},
        "written": list(call.spec.mutates),
    }
    if blocks is not None:
        meta["kv"] = f"{blocks.numel()} of {nb} blocks saved"
    return record, meta
