"""Several nodes for real: each node a network namespace with its own address (scripts/netns_hosts.sh),
one `train launcher=local launcher.nnodes=2 ...` per node, a run directory they share (/tmp).

Run alone with `python -m pytest -m netns tests/multinode`; skipped, naming the reason, where network
namespaces cannot be made (not root, no `ip`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import TINY, losses

pytestmark = pytest.mark.netns

SCRIPT = Path(__file__).parents[2] / "scripts" / "netns_hosts.sh"
SUBNET = "10.77.0"
SHORT = [  # 6 steps, checkpoints at 3 and 6: the nodes' start-up dominates, not the steps
    *TINY,
    "train.max_steps=6",
    "train.eval_every=3",
    "checkpoint.every=3",
    "launcher=local",
    "parallel=ddp",
]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # the same intra-op threads on one node and on two: bitwise losses


@dataclass(frozen=True)
class Hosts:
    """The namespaces of the test bed: host k (0-based) is `names[k]` at `addresses[k]`."""

    names: list[str]
    addresses: list[str]
    env: dict[str, str]


def _why_no_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); this test runs as a user"
    if shutil.which("ip") is None:
        return "network namespaces need the `ip` command (iproute2), which is not installed"
    return None


@pytest.fixture(scope="session")
def hosts() -> Iterator[Hosts]:
    """Two hosts (network namespaces on one bridge), named after this process so parallel sessions differ."""
    reason = _why_no_namespaces()
    if reason:
        pytest.skip(reason)
    tag = os.getpid()
    env = {**os.environ, "NETNS_PREFIX": f"t{tag}n", "NETNS_BRIDGE": f"tb{tag}", "NETNS_SUBNET": SUBNET}
    up = subprocess.run(["bash", str(SCRIPT), "up", "2"], env=env, capture_output=True, text=True)
    if up.returncode != 0:
        subprocess.run(["bash", str(SCRIPT), "down"], env=env, capture_output=True)
        pytest.skip(f"network namespaces cannot be made here: {up.stderr.strip()[-300:]}")
    try:
        yield Hosts([f"t{tag}n1", f"t{tag}n2"], [f"{SUBNET}.1", f"{SUBNET}.2"], env)
    finally:
        subprocess.run(["bash", str(SCRIPT), "down"], env=env, capture_output=True)


def _free_port(hosts: Hosts) -> int:
    """A port free on host 0 (the bed's addresses are new, so a free loopback port is free there too)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _node(hosts: Hosts, k: int, args: list[str], cwd: Path) -> subprocess.Popen:
    """`train ARGS launcher.node_rank=k` inside host k."""
    cmd = [
        "ip",
        "netns",
        "exec",
        hosts.names[k],
        sys.executable,
        "-m",
        "launcher",
        *args,
        f"launcher.node_rank={k}",
    ]
    env = {**os.environ, **ONE_THREAD}
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _two_nodes(hosts: Hosts, run_dir: Path, extra: list[str], timeout_s: int = 60) -> list[str]:
    return [
        *SHORT,
        *extra,
        "launcher.nproc=1",
        "launcher.nnodes=2",
        f"launcher.rdzv_endpoint={hosts.addresses[0]}:{_free_port(hosts)}",
        f"launcher.timeout_s={timeout_s}",
        f"run_dir={run_dir}",
    ]


def _finish(proc: subprocess.Popen, timeout: int = 240) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def test_two_nodes_of_one_rank_match_one_node_of_two_ranks(hosts, tmp_path) -> None:
    reference = subprocess.Popen(  # one node, two ranks, on loopback: started alongside the two nodes
        [sys.executable, "-m", "launcher", *SHORT, "launcher.nproc=2", f"run_dir={tmp_path / 'one'}"],
        cwd=tmp_path,
        env={**os.environ, **ONE_THREAD},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    args = _two_nodes(hosts, tmp_path / "two", [])
    started = time.monotonic()
    nodes = [_node(hosts, 0, args, tmp_path), _node(hosts, 1, args, tmp_path)]
    results = [_finish(p) for p in nodes]
    wall_s = time.monotonic() - started
    for k, (code, text) in enumerate(results):
        assert code == 0, f"node {k}: {text[-3000:]}"
    code, text = _finish(reference)
    assert code == 0, text[-3000:]
    two, one = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert two.keys() == one.keys() == set(range(1, 7))
    assert two == one, (two, one)  # the same global batch, the same reduction: bitwise
    spec = yaml.safe_load((tmp_path / "two" / "spec.yaml").read_text())
    assert spec["launcher"]["node_rank"] == 0 and spec["launcher"]["nnodes"] == 2  # one spec for every node
    assert not (tmp_path / "two" / "run.lock").exists()  # node 0 held it and let it go
    hosts_of = {int(p.stem.split("_")[1]) for p in (tmp_path / "two" / "logs").glob("rank_*.pid")}
    assert hosts_of == {0, 1}
    print(f"two nodes x 1 rank: {wall_s:.1f} s wall")


def test_a_node_that_never_joins_is_named_and_the_rendezvous_listens_on_node_0s_address_only(
    hosts, tmp_path
) -> None:
    args = _two_nodes(hosts, tmp_path / "alone", [], timeout_s=8)
    port = int(next(a for a in args if a.startswith("launcher.rdzv_endpoint=")).rpartition(":")[2])
    node0 = _node(hosts, 0, args, tmp_path)  # node 1 never comes
    try:
        assert _connects(hosts.names[1], hosts.addresses[0], port, wait_s=60), (
            "node 0's rendezvous never listened"
        )
        assert not _connects(hosts.names[0], "127.0.0.1", port)  # not on loopback
        subprocess.run(  # another address of node 0's host
            ["ip", "-n", hosts.names[0], "addr", "add", f"{SUBNET}.101/24", "dev", "eth0"], check=True
        )
        assert not _connects(hosts.names[1], f"{SUBNET}.101", port)
    finally:
        code, text = _finish(node0, timeout=120)
    message = " ".join(text.split())
    assert code == 1, message
    assert "node(s) 1 of 2 (launcher.node_rank) did not join the rendezvous" in message, message
    assert "within 8 s (launcher.timeout_s)" in message, message
    assert "Traceback" not in message


def _connects(namespace: str, address: str, port: int, wait_s: float = 0.0) -> bool:
    """Whether a TCP connection from inside `namespace` to address:port succeeds (retried for `wait_s`)."""
    probe = (
        "import socket, sys, time\n"
        f"deadline = time.monotonic() + {wait_s}\n"
        "while True:\n"
        "    try:\n"
        f"        socket.create_connection(({address!r}, {port}), timeout=2).close()\n"
        "        sys.exit(0)\n"
        "    except OSError:\n"
        "        if time.monotonic() > deadline:\n"
        "            sys.exit(1)\n"
        "        time.sleep(0.1)\n"
    )
    result = subprocess.run(
        ["ip", "netns", "exec", namespace, sys.executable, "-c", probe], timeout=wait_s + 30
    )
    return result.returncode == 0
