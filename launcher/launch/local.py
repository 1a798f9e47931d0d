"""The local backend: N ranks on this machine, started and watched by torch's elastic agent.

The agent (torch.distributed.launcher.api) runs in the `train` process: it hosts the rendezvous
store (on launcher.master_addr only, 127.0.0.1 by default), starts the ranks, restarts the whole
group on a failure up to launcher.max_restarts times (each restart resumes from the newest
checkpoint, see worker.resume_candidates, and says so on the console), and stops every rank when
one dies. A rank dies with the launching process (no orphans). SIGINT/SIGTERM: see
launcher.launch.local_agent. Each rank's output goes to the run directory.

Several nodes (launcher.nnodes > 1, torchrun's semantics): one `train` per node, each with its
launcher.node_rank; node 0 hosts the rendezvous store on the host of launcher.rdzv_endpoint only, the
others join it (launcher.launch.nodes). Global ranks are assigned by torch's c10d rendezvous (nodes in
the order of their addresses), as under torchrun. A failure on any node restarts the ranks of every
node (up to launcher.max_restarts), all resuming from the newest checkpoint of the shared run_dir.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import traceback
from pathlib import Path

from rich.console import Console

from launcher.components import collector
from launcher.exits import ExitStatus, for_signal
from launcher.launch import nodes
from launcher.launch.local_agent import (
    RestartReporter,
    StopForwarder,
    agent_logs,
    die_with_parent,
    log_paths,
    loopback_interface,
    make_logs_specs,
    rendezvous_store,
    rotate_logs,
)
from launcher.launch.semaphores import detach_resource_tracker
from launcher.spec import RunSpec


def rendezvous_endpoint(spec: RunSpec) -> str:
    """host:port of the agent's rendezvous store; port 0 lets the agent bind a free one itself."""
    host, port = nodes.endpoint(spec.launcher)
    return f"{host}:{port}"


def describe(spec: RunSpec, run_dir: Path) -> str:
    """What `launch` would do, for the dry run."""
    lc = spec.launcher
    where = f"node {lc.node_rank} of {lc.nnodes}, " if lc.nnodes > 1 else ""
    return (
        f"local: {where}{lc.nproc} rank(s) on this machine under torch's elastic agent "
        f"(rendezvous {rendezvous_endpoint(spec)}, {'nccl' if _on_gpu(spec) else 'gloo'}, "
        f"max_restarts={lc.max_restarts}, timeout {lc.timeout_s:g} s), each running "
        f"`launcher.rank.worker.run({run_dir / 'spec.yaml'})`; logs in {run_dir / 'logs'}"
    )


def _on_gpu(spec: RunSpec) -> bool:
    from launcher.components.device import resolve_device

    return resolve_device(spec.launcher.device) == "cuda"


def rank_main(
    spec_path: str, num_threads: int, parent_pid: int, loopback: bool, node: tuple[int, str] | None = None
) -> int:
    """One rank: the entry the agent starts in each process (module level so that spawn can pickle it)."""
    collector.pause()  # the rank's imports and build (as inline's); the loop collects at its own pauses
    import torch

    from launcher.rank import worker

    die_with_parent(parent_pid)  # no rank outlives the launching process
    # A session of its own, as torchrun's ranks have: off the terminal (a Ctrl-C reaches the launcher, which
    # passes it on once), and its own share of the CPU where the kernel's autogroup scheduler shares it
    # between sessions (Linux's default on desktops and many servers): in the launching session, the
    # ranks shared one share with every other process of that shell and ran at a fraction of a plain
    # torchrun script's speed on a busy machine (docs/performance.md).
    try:
        os.setsid()
    except OSError:  # already a session or group leader: a group of its own still keeps Ctrl-C away
        os.setpgrp()
    if loopback and (interface := loopback_interface()):  # one node: collectives stay on loopback too
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    if node is not None:  # several nodes: collectives over the interface that reaches the other nodes
        os.environ["LAUNCHER_NODE_RANK"], os.environ["LAUNCHER_NODE_ADDR"] = str(node[0]), node[1]
        if interface := nodes.interface_of(node[1]):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(num_threads)  # share the cores instead of oversubscribing them
    logs = Path(spec_path).parent / "logs"
    logs.mkdir(exist_ok=True)
    (logs / f"rank_{os.environ['RANK']}.pid").write_text(f"{os.getpid()}\n")  # to find or signal a rank
    try:
        return worker.run_process(Path(spec_path))
    except Exception:
        traceback.print_exc()  # into this rank's .err log; the agent reports only the last line
        raise


def launch(spec: RunSpec, run_dir: Path) -> int:
    """Start the ranks and wait: 0 when every rank finished, the ranks' own status (3, 4, 130, 143)
    when they stopped on purpose, 1 when one failed."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.launcher.api import elastic_launch

    lc, console = spec.launcher, Console(stderr=True, highlight=False, soft_wrap=True)
    rotated = rotate_logs(run_dir) if lc.node_rank == 0 else None  # the logs folder is shared by the nodes
    if rotated is not None:
        console.print(f"logs of the previous session moved to {rotated}", markup=False)
    threads = max(1, (os.cpu_count() or 1) // lc.nproc)
    host, port = nodes.endpoint(lc)
    serve = lc.node_rank == 0  # node 0 (the only one of a single-node job) hosts the rendezvous
    try:
        address = host if serve else nodes.address_towards(host, port)
        loopback = lc.nnodes == 1 and ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except OSError as err:
        console.print(f"error: node {lc.node_rank} finds no route to the rendezvous {host}:{port}: {err}")
        return ExitStatus.FAILED
    run_id = nodes.job_id(lc, str(run_dir)) if lc.nnodes > 1 else f"train-{os.getpid()}"
    stops, store, endpoint = StopForwarder(run_dir, console), None, f"{host}:{port}"
    try:
        with (
            rendezvous_store(host, port, serve=serve, timeout_s=lc.timeout_s) as (endpoint, store),
            stops,
            agent_logs(RestartReporter(run_dir, console)),
        ):
            nodes.check_in(store, run_id, lc.node_rank, address)
            config = _launch_config(spec, run_dir, run_id=run_id, endpoint=endpoint, address=address)
            detach_resource_tracker()  # the ranks' semaphores are unlinked even after a SIGKILL of this group
            node = (lc.node_rank, address) if lc.nnodes > 1 else None
            codes = elastic_launch(config, rank_main)(
                str(run_dir / "spec.yaml"), threads, os.getpid(), loopback, node
            )
    except SignalException as err:  # a second SIGINT/SIGTERM: the agent stopped every rank
        console.print(f"stopped at once ({err}); completed checkpoints are intact.", markup=False)
        return for_signal(int(err.sigval))
    except ChildFailedError as err:
        if stops.first is not None:  # a rank interrupted while it could not finish its step
            console.print(failure_message(err, run_dir), markup=False, soft_wrap=True)
            return for_signal(int(stops.first))
        console.print(failure_message(err, run_dir), markup=False, soft_wrap=True)
        return ExitStatus.FAILED
    except RendezvousTimeoutError:
        console.print(nodes.missing_message(store, lc, run_id, endpoint), markup=False, soft_wrap=True)
        return ExitStatus.FAILED
    except Exception as err:  # the agent itself failed (rendezvous port taken, node 0 unreachable, ...)
        where = "" if store is not None or serve else f" (node 0's rendezvous at {endpoint} did not answer)"
        console.print(f"error: the local launch failed{where}: {type(err).__name__}: {err}", markup=False)
        return ExitStatus.FAILED
    return max(codes.values(), default=0)


def _launch_config(
    spec: RunSpec, run_dir: Path, *, run_id: str, endpoint: str, address: str
):  # -> LaunchConfig
    """torch's launch settings: this node's ranks, the c10d rendezvous at `endpoint`, restarts, logs."""
    from torch.distributed.launcher.api import LaunchConfig

    lc = spec.launcher
    return LaunchConfig(
        min_nodes=lc.nnodes,
        max_nodes=lc.nnodes,
        nproc_per_node=lc.nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={
            "timeout": int(lc.timeout_s),
            "join_timeout": int(lc.timeout_s),
            "read_timeout": max(60, int(lc.timeout_s)),
            "is_host": lc.node_rank == 0,
        },
        max_restarts=lc.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",  # the agent's own threads are running: fork could copy a held lock
        local_addr=address,
        logs_specs=make_logs_specs(run_dir),
        shutdown_timeout=10,
        log_line_prefix_template="[rank ${rank}] ",
        signals_to_handle="SIGHUP,SIGQUIT",  # SIGINT and SIGTERM are StopForwarder's
    )


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
        f"error: rank {rank} (pid {first.pid}) failed: {_error_text(first).rstrip('.')}.",
        f"  The job was stopped; its log: {errlog} (stderr) and {out} (stdout).",
    ]
    if others:
        lines.append(f"  Also stopped: rank(s) {', '.join(map(str, others))}.")
    lines.append(
        "  Completed checkpoints are intact: continue with `resume=auto` (and a fixed run_dir), "
        "or set launcher.max_restarts to restart automatically."
    )
    return "\n".join(lines)
