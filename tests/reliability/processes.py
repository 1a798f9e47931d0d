"""Helpers of the reliability suite: real `train` processes, their process trees, their sockets."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import TINY

# A 2-rank DDP run long enough to be interrupted (tiny model: ~10 ms a step), logging every step.
LONG_DDP = [
    *TINY,
    "launcher=local",
    "launcher.nproc=2",
    "parallel=ddp",
    "train.max_steps=5000",
    "train.eval_every=null",
    "checkpoint.every=1000",
]


def start_train(args: list[str], cwd: Path) -> subprocess.Popen:
    """`train ARGS` in its own session (as a terminal's foreground job would be), output to files."""
    return subprocess.Popen(
        [sys.executable, "-m", "launcher", *args],
        cwd=cwd,
        stdout=open(cwd / "train.out", "w"),  # noqa: SIM115 - the child owns it
        stderr=open(cwd / "train.err", "w"),  # noqa: SIM115
        start_new_session=True,
    )


def wait_for_steps(run_dir: Path, steps: int, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    """Wait until metrics.jsonl has a record of step `steps` or more (the ranks are training)."""
    deadline = time.monotonic() + timeout_s
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, (proc.returncode, (run_dir.parent / "train.err").read_text()[-3000:])
        if path.is_file():
            lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if any(r.get("step", 0) >= steps for r in lines):
                return
        time.sleep(0.2)
    raise AssertionError(f"no step {steps} within {timeout_s} s")


def rank_pids(run_dir: Path) -> list[int]:
    """The pids the ranks wrote into logs/rank_R.pid."""
    return [int(p.read_text()) for p in sorted((run_dir / "logs").glob("rank_*.pid"))]


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    todo, found = [pid], []
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def _address(hex_address: str) -> tuple[str, int]:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # four 32-bit words, each little-endian
        ip = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return ip, int(port, 16)


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket the processes hold (/proc/net/tcp{,6} + fds)."""
    listening: dict[int, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                listening[int(fields[9])] = _address(fields[1])
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and int(link[8:-1]) in listening:
                found.append((pid, *listening[int(link[8:-1])]))
    return found


def send(proc: subprocess.Popen, number: signal.Signals) -> None:
    """Send a signal to the `train` process alone (ranks get it through the launcher)."""
    os.kill(proc.pid, number)


def mount_tmpfs(path: Path, size_bytes: int) -> None:
    """A small tmpfs at `path` (made here) for a disk that fills up; the test skips where it cannot mount."""
    import pytest

    path.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes // 1024}k", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (root and mount are needed): {result.stderr.strip()}")


def stale_lock(run_dir: Path, **fields: object) -> int:
    """Leave a run lock whose holder is gone (a process that already exited); its pid. `fields` add to the record."""
    from launcher.launch import run_lock

    gone = subprocess.Popen(["true"])
    gone.wait()
    record = {"pid": gone.pid, "pid_start": 1, "host": socket.gethostname(), "slurm_job": None, **fields}
    run_lock.lock_path(run_dir).write_text(json.dumps(record))
    return gone.pid
