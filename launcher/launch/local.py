"""The local backend: N ranks on this machine, started and watched by torch's elastic agent.

The agent (torch.distributed.launcher.api) runs in the `train` process: it hosts the rendezvous
store, starts the ranks, restarts the whole group on a failure up to launcher.max_restarts times
(each restart resumes from the newest checkpoint, see worker.resume_candidates), and stops every
rank when one dies, so no process outlives the job. Each rank's output goes to the run directory.
"""

from __future__ import annotations

import logging
import os
import traceback
from pathlib import Path

from rich.console import Console

from launcher.exits import ExitStatus
from launcher.spec import RunSpec


def log_paths(run_dir: Path, rank: int, restart: int = 0) -> tuple[Path, Path]:
    """(stdout, stderr) log files of `rank` in attempt `restart` (0 is the first start)."""
    stem = f"rank_{rank}" if restart == 0 else f"rank_{rank}.restart_{restart}"
    return run_dir / "logs" / f"{stem}.log", run_dir / "logs" / f"{stem}.err"


def _make_logs_specs(run_dir: Path):  # -> LogsSpecs (torch imported lazily)
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


def rendezvous_endpoint(spec: RunSpec) -> str:
    """host:port of the agent's rendezvous store; port 0 lets the agent bind a free one itself."""
    return f"{spec.launcher.master_addr}:{spec.launcher.master_port or 0}"


def describe(spec: RunSpec, run_dir: Path) -> str:
    """What `launch` would do, for the dry run."""
    lc = spec.launcher
    return (
        f"local: {lc.nproc} rank(s) on this machine under torch's elastic agent "
        f"(rendezvous {rendezvous_endpoint(spec)}, {'nccl' if _on_gpu(spec) else 'gloo'}, "
        f"max_restarts={lc.max_restarts}, timeout {lc.timeout_s:g} s), each running "
        f"`launcher.rank.worker.run({run_dir / 'spec.yaml'})`; logs in {run_dir / 'logs'}"
    )


def _on_gpu(spec: RunSpec) -> bool:
    from launcher.groups.device import resolve_device

    return resolve_device(spec.launcher.device) == "cuda"


def rank_main(spec_path: str, num_threads: int) -> int:
    """One rank: the entry the agent starts in each process (module level so that spawn can pickle it)."""
    import torch

    from launcher.rank import worker

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(num_threads)  # share the cores instead of oversubscribing them
    logs = Path(spec_path).parent / "logs"
    logs.mkdir(exist_ok=True)
    (logs / f"rank_{os.environ['RANK']}.pid").write_text(f"{os.getpid()}\n")  # to find or signal a rank
    try:
        return worker.run(Path(spec_path))
    except Exception:
        traceback.print_exc()  # into this rank's .err log; the agent reports only the last line
        raise


def launch(spec: RunSpec, run_dir: Path) -> int:
    """Start the ranks and wait; 0 when every rank finished, the ranks' status or 1 otherwise."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    lc, console = spec.launcher, Console(stderr=True, highlight=False)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=lc.nproc,
        run_id=f"train-{os.getpid()}",
        rdzv_backend="c10d",
        rdzv_endpoint=rendezvous_endpoint(spec),
        rdzv_configs={"timeout": int(lc.timeout_s), "join_timeout": int(lc.timeout_s)},
        max_restarts=lc.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",  # the agent's own threads are running: fork could copy a held lock
        local_addr=lc.master_addr,
        logs_specs=_make_logs_specs(run_dir),
        shutdown_timeout=10,
        log_line_prefix_template="[rank ${rank}] ",
    )
    threads = max(1, (os.cpu_count() or 1) // lc.nproc)
    levels = _silence_agent_logs()
    try:
        codes = elastic_launch(config, rank_main)(str(run_dir / "spec.yaml"), threads)
    except ChildFailedError as err:
        console.print(failure_message(err, run_dir), markup=False, soft_wrap=True)
        return ExitStatus.FAILED
    except Exception as err:  # the agent itself failed (rendezvous port taken, interrupted, ...)
        console.print(f"error: the local launch failed: {type(err).__name__}: {err}", markup=False)
        return ExitStatus.FAILED
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    return max(codes.values(), default=0)


def _silence_agent_logs() -> dict[str, int]:
    """Mute the agent's and spawn's own logs (a failure is reported once, by `failure_message`)."""
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    names = [n for n in logging.root.manager.loggerDict if n.startswith(prefixes)]
    levels = {n: logging.getLogger(n).level for n in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    return levels


def _error_text(failure) -> str:
    """The exception line a rank recorded, or the signal that killed it."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    if failure.exitcode < 0:
        return f"killed by signal {failure.signal_name()}"
    text = str(message).strip().splitlines()
    if not text or text[-1].startswith("To enable traceback"):
        return f"exited with status {failure.exitcode}"
    return text[-1]


def _newest_logs(run_dir: Path, rank: int) -> tuple[Path, Path]:
    """The (stdout, stderr) logs of the newest attempt of `rank`."""
    attempts = sorted((run_dir / "logs").glob(f"rank_{rank}*.err"), key=lambda p: p.stat().st_mtime)
    if not attempts:
        return log_paths(run_dir, rank)
    return attempts[-1].with_suffix(".log"), attempts[-1]


def failure_message(err, run_dir: Path) -> str:
    """One paragraph: which rank failed first and why, the other ranks, and where the logs are."""
    rank, first = err.get_first_failure()
    others = sorted(r for r in err.failures if r != rank)
    out, errlog = _newest_logs(run_dir, rank)
    lines = [
        f"error: rank {rank} (pid {first.pid}) failed: {_error_text(first)}.",
        f"  The job was stopped; its log: {errlog} (stderr) and {out} (stdout).",
    ]
    if others:
        lines.append(f"  Also stopped: rank(s) {', '.join(map(str, others))}.")
    lines.append(
        "  Completed checkpoints are intact: continue with `resume=auto` (and a fixed run_dir), "
        "or set launcher.max_restarts to restart automatically."
    )
    return "\n".join(lines)
