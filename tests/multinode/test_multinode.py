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


def _two_nodes(
    hosts: Hosts, run_dir: Path, extra: list[str], timeout_s: int = 60, nproc: int = 1
) -> list[str]:
    """The arguments every node gets (each adds its launcher.node_rank)."""
    return [
        *SHORT,
        *extra,
        f"launcher.nproc={nproc}",
        "launcher.nnodes=2",
        f"launcher.rdzv_endpoint={hosts.addresses[0]}:{_free_port(hosts)}",
        f"launcher.timeout_s={timeout_s}",
        f"run_dir={run_dir}",
    ]


def _one_node(args: list[str], cwd: Path) -> subprocess.Popen:
    """`train ARGS` on this machine's loopback: the one-node reference, started alongside the nodes."""
    env = {**os.environ, **ONE_THREAD}
    cmd = [sys.executable, "-m", "launcher", *args]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: int = 240) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def _only_when_selected(request: pytest.FixtureRequest, what: str) -> None:
    """Skip a test that is too slow for the default suite unless `-m netns` asked for these tests."""
    if "netns" not in (request.config.option.markexpr or ""):
        pytest.skip(f"{what}: too slow for the default suite, it runs with `-m netns`")


@pytest.mark.parametrize(
    ("parallel", "nproc"), [("ddp", 1), ("ddp", 2), ("fsdp", 2)], ids=["ddp-2x1", "ddp-2x2", "fsdp-2x2"]
)
def test_two_nodes_match_one_node_of_the_same_world_size(hosts, tmp_path, request, parallel, nproc) -> None:
    if nproc > 1:
        _only_when_selected(request, f"2 nodes x 2 ranks of {parallel} (about 50 s here)")
    strategy = [f"parallel={parallel}"]
    one = [*SHORT, *strategy, f"launcher.nproc={2 * nproc}", f"run_dir={tmp_path / 'one'}"]
    reference = _one_node(one, tmp_path)  # one node, the same world size
    args = _two_nodes(hosts, tmp_path / "two", strategy, nproc=nproc)
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
    ranks = {int(p.stem.split("_")[1]) for p in (tmp_path / "two" / "logs").glob("rank_*.pid")}
    assert ranks == set(range(2 * nproc))
    print(f"two nodes x {nproc} rank(s) of {parallel}: {wall_s:.1f} s wall")


def test_a_node_that_never_joins_is_named_and_the_rendezvous_listens_on_node_0s_address_only(
    hosts, tmp_path
) -> None:
    args = _two_nodes(hosts, tmp_path / "alone", ["parallel=ddp"], timeout_s=8)
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


def test_a_rank_killed_on_one_node_restarts_every_node_and_ends_at_the_uninterrupted_losses(
    hosts, tmp_path, request
) -> None:
    _only_when_selected(request, "a rank killed on one node (about 30-40 s here)")
    ddp = ["parallel=ddp", "train.max_steps=20", "train.eval_every=10", "checkpoint.every=5"]
    reference = _one_node([*SHORT, *ddp, "launcher.nproc=2", f"run_dir={tmp_path / 'one'}"], tmp_path)
    run_dir = tmp_path / "restarted"
    args = _two_nodes(hosts, run_dir, [*ddp, "launcher.max_restarts=1"])
    nodes = [_node(hosts, 0, args, tmp_path), _node(hosts, 1, args, tmp_path)]
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoints" / "step_5").is_dir():
        assert all(p.poll() is None for p in nodes) and time.monotonic() < deadline, "ended before step 5"
        time.sleep(0.01)
    os.kill(int((run_dir / "logs" / "rank_1.pid").read_text()), 9)  # SIGKILL: no checkpoint, no goodbye
    results = [_finish(p) for p in nodes]
    for k, (code, text) in enumerate(results):
        assert code == 0, f"node {k}: {text[-3000:]}"
    assert any(
        "restart 1 of 1: rank 1 " in text and "killed by signal SIGKILL" in text for _, text in results
    )
    code, text = _finish(reference)
    assert code == 0, text[-3000:]
    summary = yaml.safe_load((run_dir / "summary.json").read_text())
    assert "step_" in str(summary["resumed_from"]) and summary["steps"] == 20
    assert losses(run_dir) == losses(tmp_path / "one")  # every step, the resumed ones included: bitwise


def test_preflight_names_the_node_of_each_rank_that_did_not_arrive(monkeypatch) -> None:
    """6 ranks on 3 nodes of 2: rank 3 is missing on node 1 (whose rank 2 came), node 2's ranks never came."""
    import torch.distributed as dist

    from launcher.rank import preflight

    store = dist.HashStore()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "3")

    def check_in(rank: int, node: int) -> str:
        """Rank `rank` of node `node` checks in (and gives up waiting for the others at once)."""
        monkeypatch.setenv("LAUNCHER_NODE_RANK", str(node))
        monkeypatch.setenv("LAUNCHER_NODE_ADDR", f"10.0.0.{node + 1}")
        monkeypatch.setenv("GROUP_RANK", str(node))
        with pytest.raises(preflight.PreflightError) as failure:
            preflight.check_arrival(store, rank, 6, 0.05)
        return str(failure.value)

    check_in(2, node=1)
    check_in(1, node=0)
    message = check_in(0, node=0)
    assert (
        "rank(s) 3, 4, 5 of 6 (rank 3 on node 1 (10.0.0.2), rank 4 on the node of group rank 2, "
        "rank 5 on the node of group rank 2) did not join" in message
    ), message
