"""Tensor parallel over LMDeploy's Ray executor across two Ray nodes on this machine: the second
node in a network namespace the test makes itself (docs/lmdeploy.md, "Across machines").

The namespace and a veth pair with addresses of their own (10.231.<n>.1 here, .2 inside) are made
with iproute2 and removed at the end; the head node listens on the first address, the other node
runs inside the namespace on the second, so the ranks' step connections, Ray's traffic and gloo's
all-reduce all cross the veth pair. No packet leaves this machine. Needs root (or CAP_NET_ADMIN)
and `ip`: skipped, saying why, where either is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from support.api_server import free_port
from support.engine_helpers import Generated, assert_matches_hf

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
PROMPTS = ["The model token cache", "One two three four five six seven"]
NEW_TOKENS = 12
# The processes' environment: Ray's own settings for a cluster no other machine reaches, but not
# the suite's loopback-only switch (tests/conftest.py), which would put every node on 127.0.0.1.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # SIGTERM stops a node at once (tests/conftest.py)
           # glibc's resolver: one second and one try for each name server, where the machine's own
           # may not answer (a machine with no network): the rank outside the namespace looks up
           # the address of its peer inside (gloo: "hostname of the client socket cannot be retrieved").
           "RES_OPTIONS": "timeout:1 attempts:1"}
CHILD_TIMEOUT_S = 300  # ~60 s on a 2-core VM


def _ip(*args, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", "netns", "exec", netns, "ip", *args] if netns else ["ip", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=check)


def _die_with_parent():
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@pytest.fixture(scope="module")
def network_namespace():
    """(namespace, host-side address, namespace-side address, host-side and inside interface)."""
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip`")
    tag = secrets.token_hex(2)  # names of at most 15 characters; unlike the pid, not reused by a later run
    ns, outside, inside = f"dlray{tag}", f"dlra{tag}", f"dlrb{tag}"
    used = _ip("-4", "addr").stdout
    subnet = next((f"10.231.{n}" for n in range(7, 250) if f"10.231.{n}." not in used), None)
    made = _ip("netns", "add", ns, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {made.stderr.strip()}")
    # `ip netns exec` puts /etc/netns/<ns>/resolv.conf in place of /etc/resolv.conf: inside, the
    # machine's name server is unreachable, and every name lookup there (gloo's, Ray's) waited for
    # its timeouts; a server on the namespace's own loopback answers "refused" at once.
    config = Path("/etc/netns") / ns
    # Its own hosts file too (mounted in the same way), naming both ends of the veth pair: the
    # lookups of the two nodes' addresses inside are answered from it, not by a name server.
    hosts = Path("/etc/hosts").read_text(errors="replace") if Path("/etc/hosts").exists() else ""
    try:
        config.mkdir(parents=True, exist_ok=True)
        (config / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        (config / "hosts").write_text(f"{hosts.rstrip()}\n{subnet}.1 dlray-head\n{subnet}.2 dlray-node\n")
    except OSError:
        pass  # not root-writable here: lookups inside then wait as before
    try:
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", ns)
        _ip("addr", "add", f"{subnet}.1/24", "dev", outside)
        _ip("link", "set", outside, "up")
        _ip("addr", "add", f"{subnet}.2/24", "dev", inside, netns=ns)
        _ip("link", "set", inside, "up", netns=ns)
        _ip("link", "set", "lo", "up", netns=ns)
        yield ns, f"{subnet}.1", f"{subnet}.2", outside, inside
    finally:
        _ip("link", "del", outside, check=False)  # takes its peer with it
        _ip("netns", "del", ns, check=False)
        shutil.rmtree(config, ignore_errors=True)
        with contextlib.suppress(OSError):
            config.parent.rmdir()  # /etc/netns, if this made it and nothing else is in it


def _start_node(argv: list[str], log: Path, env: dict) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent)


def _failure_report(child_stderr: str, temp: Path) -> str:
    """What a failed run leaves to read: the end of the driver's stderr (with its threads' stacks
    where it hung: the child dumps them before its limit) and of each Ray worker's stderr on both
    nodes (the ranks' own logs), which the cluster's folder removed at the end would lose."""
    parts = [f"driver:\n{child_stderr[-6000:]}"]
    for log in sorted(temp.glob("*/session_2*/logs/worker-*.err")):  # not session_latest, a link to one
        text = log.read_text(errors="replace").strip()
        if text:
            parts.append(f"{log.relative_to(temp)}:\n{text[-3000:]}")
    return "\n\n".join(parts)


def _stop(nodes: list[subprocess.Popen]) -> list[psutil.Process]:
    """SIGTERM each `ray start --block` (it stops its node), then kill what is left; returns what
    did not end."""
    started = []
    for node in nodes:
        try:
            started += [psutil.Process(node.pid)] + psutil.Process(node.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        try:
            os.killpg(node.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    _, alive = psutil.wait_procs(started, timeout=15)
    for proc in alive:
        proc.kill()
    _, alive = psutil.wait_procs(alive, timeout=10)
    return alive


def test_tp2_across_two_ray_nodes_gives_hfs_greedy_tokens(network_namespace, model_dir, hf_reference, tmp_path):
    ns, head_ip, node_ip, outside, inside = network_namespace
    ray_cli = str(Path(sys.executable).parent / "ray")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    env.update(RAY_ENV)
    port = free_port()
    temp = Path(tempfile.mkdtemp(prefix="dlr", dir="/tmp"))  # Ray's socket paths must stay under 108 bytes
    common = ["--num-cpus=1", "--num-gpus=0", "--disable-usage-stats", "--block"]
    nodes = [_start_node([ray_cli, "start", "--head", f"--node-ip-address={head_ip}", f"--port={port}",
                          "--include-dashboard=false", f"--temp-dir={temp / 'h'}", *common],
                         tmp_path / "head.log", dict(env, GLOO_SOCKET_IFNAME=outside))]
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in (tmp_path / "head.log").read_text(errors="replace"):
            assert nodes[0].poll() is None and time.monotonic() < deadline, (tmp_path / "head.log").read_text()[-3000:]
            time.sleep(0.5)
        nodes.append(_start_node(["ip", "netns", "exec", ns, ray_cli, "start", f"--address={head_ip}:{port}",
                                  f"--node-ip-address={node_ip}", f"--temp-dir={temp / 'n'}", *common],
                                 tmp_path / "node.log", dict(env, GLOO_SOCKET_IFNAME=inside)))
        while "Ray runtime started" not in (tmp_path / "node.log").read_text(errors="replace"):
            assert nodes[1].poll() is None and time.monotonic() < deadline, (tmp_path / "node.log").read_text()[-3000:]
            time.sleep(0.5)
        try:
            child = subprocess.run([sys.executable, str(HERE / "ray_two_node_child.py"), str(model_dir("llama")),
                                    str(NEW_TOKENS), *PROMPTS],
                                   env=dict(env, RAY_ADDRESS=f"{head_ip}:{port}",
                                            DLINFER_TEST_STACKS_AFTER_S=str(CHILD_TIMEOUT_S - 20)),
                                   capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as hung:  # its stack dump did not end it
            stderr = hung.stderr.decode(errors="replace") if isinstance(hung.stderr, bytes) else hung.stderr or ""
            pytest.fail(f"the driver ran past {CHILD_TIMEOUT_S} s\n{_failure_report(stderr, temp)}")
        assert child.returncode == 0, _failure_report(child.stderr, temp)
        out = json.loads(child.stdout.strip().splitlines()[-1])
        assert sorted(out["node_ips"]) == [head_ip, node_ip]  # one rank on each node
        assert out["steps"] == "StepChannels"  # the steps went over the step connections
        assert_matches_hf([Generated(**r) for r in out["results"]], hf_reference("llama"), NEW_TOKENS)
    finally:
        left = _stop(nodes)
        shutil.rmtree(temp, ignore_errors=True)
    assert left == []
