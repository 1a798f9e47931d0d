"""What the local backend adds around torch's elastic agent, in the `train` process.

- Per-rank log files under RUN_DIR/logs (rank 0's stdout also on this console); a new session
  moves the previous session's logs into logs/session_K/ first, so nothing old is replayed.
- The rendezvous store listens on the rendezvous host only (127.0.0.1 for one node, the host of
  launcher.rdzv_endpoint on node 0 of several; the other nodes are its clients): the agent's
  own TCPStore is created here on a socket bound to that address, and the c10d rendezvous shares
  it (multi_tenant); the agent creates no second store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE), so
  rank 0 hosts the ranks' store on the same address (launcher.rank.preflight).
- SIGINT and SIGTERM are handled here, not by the agent: the first is passed on once to every
  rank (each finishes its step, writes a checkpoint, exits 130 or 143), a second stops everything
  at once. The ranks run in their own process group, so a terminal's Ctrl-C reaches them once,
  through here.
- A line on the console for each restart: which rank failed and how, restart k of n, and the
  checkpoint the ranks resume from.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console

from launcher.components import checkpoint

_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


def log_paths(run_dir: Path, rank: int, restart: int = 0) -> tuple[Path, Path]:
    """(stdout, stderr) log files of `rank` in attempt `restart` (0 is the first start)."""
    stem = f"rank_{rank}" if restart == 0 else f"rank_{rank}.restart_{restart}"
    return run_dir / "logs" / f"{stem}.log", run_dir / "logs" / f"{stem}.err"


def rotate_logs(run_dir: Path) -> Path | None:
    """Move an earlier session's log files into logs/session_K/; the folder they went to, if any."""
    logs = run_dir / "logs"
    files = [p for p in logs.iterdir() if p.is_file()] if logs.is_dir() else []
    if not files:
        return None
    num_sessions = len([p for p in logs.iterdir() if p.is_dir() and p.name.startswith("session_")])
    target = logs / f"session_{num_sessions}"
    target.mkdir()
    for path in files:
        path.replace(target / path.name)
    return target


def make_logs_specs(run_dir: Path):  # -> LogsSpecs (torch imported lazily)
    """Per-rank log files under run_dir/logs; rank 0's stdout is also shown on this console."""
    from torch.distributed.elastic.multiprocessing import LogsSpecs
    from torch.distributed.elastic.multiprocessing.api import LogsDest

    class RunDirLogs(LogsSpecs):
        """logs/rank_R.log (stdout), logs/rank_R.err (stderr), logs/rank_R.error.json per attempt."""

        def __init__(self) -> None:
            super().__init__(log_dir=str(run_dir / "logs"))

        @property
        def root_log_dir(self) -> str:
            return str(run_dir / "logs")

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            dest = LogsDest()
            for local_rank, env in envs.items():
                rank, restart = int(env["RANK"]), int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
                out, err = log_paths(run_dir, rank, restart)
                out.parent.mkdir(parents=True, exist_ok=True)
                error_file = out.with_suffix(".error.json")
                error_file.unlink(missing_ok=True)
                dest.stdouts[local_rank], dest.stderrs[local_rank] = str(out), str(err)
                dest.error_files[local_rank] = str(error_file)
                env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
                if rank == 0:
                    dest.tee_stdouts[local_rank] = str(out)
            return dest

    return RunDirLogs()


@contextlib.contextmanager
def rendezvous_store(
    host: str, port: int | None, *, serve: bool = True, timeout_s: float = 300.0
) -> Iterator[tuple[str, Any]]:
    """A TCPStore on `host` only, which the agent's c10d rendezvous shares; yields its host:port and the store.

    serve=False (the other nodes of a multi-node job): a client of the store node 0 serves there.
    """
    from datetime import timedelta

    import torch.distributed as dist

    from launcher.rank.preflight import listen_fd  # torch: only when the agent starts ranks, never a dry run

    if serve:
        fd, bound_port = listen_fd(host, port or 0)
        store = dist.TCPStore(
            host, bound_port, is_master=True, multi_tenant=True, master_listen_fd=fd, wait_for_workers=False
        )
    else:
        bound_port = int(port or 0)
        store = dist.TCPStore(
            host, bound_port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
    previous = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # no second store on every interface
    try:
        yield f"{host}:{bound_port}", store
    finally:
        if previous is None:
            os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        else:
            os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = previous
        del store


def rank_pids(run_dir: Path) -> list[int]:
    """The pids the ranks of the current attempt wrote into logs/rank_R.pid."""
    pids = []
    for path in (run_dir / "logs").glob("rank_*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pids.append(int(path.read_text()))
    return pids


def _rank_of_pid(run_dir: Path, pid: int) -> int | None:
    """The global rank whose logs/rank_R.pid names `pid`, None when none does."""
    for path in (run_dir / "logs").glob("rank_*.pid"):
        with contextlib.suppress(OSError, ValueError):
            if int(path.read_text()) == pid:
                return int(path.stem.removeprefix("rank_"))
    return None


def _parent_of(pid: int) -> int | None:
    """The parent pid of process `pid`, None when it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


class StopForwarder:
    """SIGINT/SIGTERM in the launching process: the first passed on to every rank, a second stops at once."""

    def __init__(self, run_dir: Path, console: Console) -> None:
        self.run_dir, self.console = run_dir, console
        self.first: signal.Signals | None = None
        """The first stop signal that arrived, if any."""
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopForwarder:
        for number in (signal.SIGINT, signal.SIGTERM):
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)

    def _forward(self, number: signal.Signals) -> None:
        for pid in rank_pids(self.run_dir):
            if _parent_of(pid) != os.getpid():  # another node's rank (a shared run_dir), or a stale pid
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, number)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        number = signal.Signals(signum)
        self._forward(number)
        if self.first is None:
            self.first = number
            self.console.print(
                f"{number.name}: every rank finishes its step and writes a checkpoint; "
                f"{number.name} again stops at once.",
                markup=False,
            )
            return
        raise SignalException(f"stopped at once on a second {number.name}", sigval=number)


class RestartReporter(logging.Handler):
    """Turns the elastic agent's failure and restart records into one console line per restart."""

    def __init__(self, run_dir: Path, console: Console) -> None:
        super().__init__(level=logging.INFO)
        self.run_dir, self.console = run_dir, console
        self._failure = "a rank failed"

    def emit(self, record: logging.LogRecord) -> None:
        message, args = str(record.msg), record.args
        if not isinstance(args, tuple):
            return
        if message.startswith("failed (exitcode") and len(args) >= 3:
            code, local_rank, pid = args[0], args[1], args[2]
            how = (
                f"was killed by signal {signal.Signals(-int(code)).name}"
                if int(code) < 0
                else f"exited with status {code}"
            )
            rank = _rank_of_pid(
                self.run_dir, int(pid)
            )  # the agent names the local rank: on node 1 of 2, not the rank
            self._failure = f"rank {local_rank if rank is None else rank} (pid {pid}) {how}"
        elif "attempts left" in message and len(args) >= 4:
            remaining, total = int(args[2]), int(args[3])
            good = checkpoint.resolve_resume("auto", self.run_dir, warn=False)  # what the ranks will try
            resume = (
                f"resuming from {good[0]} (step {checkpoint.step_of(good[0])})" if good else "starting over"
            )
            self.console.print(
                f"restart {total - remaining + 1} of {total}: {self._failure}; all ranks restart, {resume}.",
                markup=False,
                soft_wrap=True,
            )


@contextlib.contextmanager
def agent_logs(reporter: RestartReporter) -> Iterator[None]:
    """Keep the agent's own log lines off the console (a failure is reported once, by the backend),
    passing its records to `reporter` only."""
    from torch.distributed.elastic.agent.server import api  # noqa: F401 - its loggers exist from here on

    tops = [logging.getLogger(name) for name in _AGENT_LOGGERS]
    children = [  # torch sets each module logger's own level (WARNING): INFO records must get through
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith(_AGENT_LOGGERS)
    ]
    saved = [(lg, lg.level, lg.propagate) for lg in {*tops, *children}]
    for lg in children:
        lg.setLevel(logging.INFO)
    for lg in tops:
        lg.setLevel(logging.INFO)
        lg.propagate = False
        lg.addHandler(reporter)
    try:
        yield
    finally:
        for lg in tops:
            lg.removeHandler(reporter)
        for lg, level, propagate in saved:
            lg.setLevel(level)
            lg.propagate = propagate


def die_with_parent(parent_pid: int) -> None:
    """Make the kernel kill this process when the launching process dies (no orphan ranks; Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the line above ran
        os._exit(1)


def loopback_interface() -> str | None:
    """The name of the loopback interface (lo on Linux), None where there is none."""
    for _, name in socket.if_nameindex():
        if name == "lo" or name.startswith("lo"):
            return name
    return None
