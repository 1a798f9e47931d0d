"""Preflight: every rank proves it can join before training, and a rank that cannot is named.

Without it, a missing rank shows up as a collective that hangs until the job's timeout with no
name attached. Here each rank first checks in on the job's store (rank 0's TCPStore, or the
elastic agent's); every rank waits a short time for all check-ins and names the ranks that never
came. After the process group exists, a monitored barrier (gloo) and an all-reduce of ones prove
that collectives work between every pair of ranks.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from launcher.config.parallel import ParallelConfig
from launcher.parallel.dims import DistContext, ParallelDims, init_process_group

MAX_WAIT_S = 60.0


class PreflightError(RuntimeError):
    """A rank did not join the job, or collectives between ranks do not work."""


def wait_s(timeout_s: float) -> float:
    """How long preflight waits for ranks: the job's timeout, capped at MAX_WAIT_S."""
    return min(timeout_s, MAX_WAIT_S)


def set_comm_env(device_type: str, timeout_s: float) -> None:
    """On GPUs: NCCL errors and timeouts tear the job down instead of hanging (user settings win)."""
    if device_type != "cuda":
        return
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "1")
    # The heartbeat monitor kills a rank whose watchdog is stuck; give collectives their timeout first.
    os.environ.setdefault("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", str(int(timeout_s) + 60))


def listen_fd(host: str, port: int) -> tuple[int, int]:
    """A TCP socket listening on `host` only (never every interface); (its fd, its port).

    The fd is handed to a TCPStore server (`master_listen_fd`), which then owns it.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(1024)
    bound_port = sock.getsockname()[1]
    return sock.detach(), bound_port


def job_store(rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """The job's key-value store: the elastic agent's if it shares one, else rank 0 hosts it on MASTER_ADDR only."""
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    hosts = rank == 0 and not agent_hosts
    try:
        store = dist.TCPStore(
            addr,
            port,
            world_size,
            is_master=hosts,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listen_fd(addr, port)[0] if hosts else None,
        )
    except Exception as err:
        who = "the launcher's rendezvous store" if agent_hosts or rank == 0 else "rank 0's store"
        raise PreflightError(
            f"rank {rank} could not reach {who} at {addr}:{port} within {timeout_s:g} s ({err}). "
            "Check launcher.master_addr/master_port and that rank 0 started."
        ) from err
    # The agent's store outlives a restart, so each attempt keys its own; rank 0's dies with it. Across
    # nodes the restart counts differ (a node that did not fail restarts without counting), so only the
    # agent's store needs (and may use) the count.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if agent_hosts else "0"
    return dist.PrefixStore(f"/launcher/attempt_{attempt}", store)


def check_arrival(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Check in, then wait for every rank's check-in; raise naming the ranks that never came."""
    store.set(f"arrived/{rank}", f"{socket.gethostname()}:{os.getpid()}")
    if "LAUNCHER_NODE_RANK" in os.environ:  # a multi-node local job: which node holds this group of ranks
        node = f"node {os.environ['LAUNCHER_NODE_RANK']} ({os.environ.get('LAUNCHER_NODE_ADDR', '?')})"
        store.set(f"node_of_group/{os.environ.get('GROUP_RANK', '0')}", node)
    deadline = time.monotonic() + timeout_s
    missing = list(range(world_size))
    while True:
        missing = [r for r in missing if not store.check([f"arrived/{r}"])]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if missing:
        names = ", ".join(str(r) for r in missing)
        raise PreflightError(
            f"preflight: rank(s) {names} of {world_size}{_nodes_of(store, missing)} did not join within {timeout_s:g} s "
            f"(seen from rank {rank}). Those processes did not start or cannot reach "
            f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '?')}; "
            "check their logs, the hosts and the network, or raise launcher.timeout_s."
        )


def _nodes_of(store: dist.Store, ranks: list[int]) -> str:
    """Where missing ranks run in a multi-node job: ' (rank 3 on node 1 (10.0.0.2), ...)'; '' on one node."""
    nproc, num_nodes = (
        int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        int(os.environ.get("GROUP_WORLD_SIZE", "1")),
    )
    if num_nodes <= 1 or "LAUNCHER_NODE_RANK" not in os.environ:
        return ""
    where = []
    for rank in ranks:
        group = rank // nproc
        key = f"node_of_group/{group}"
        node = store.get(key).decode() if store.check([key]) else f"the node of group rank {group}"
        where.append(f"rank {rank} on {node}")
    return f" ({', '.join(where)})"


def check_collectives(ctx: DistContext, timeout_s: float) -> None:
    """A monitored barrier (gloo: names a silent rank) and an all-reduce of ones that must sum to N."""
    if dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        except RuntimeError as err:
            raise PreflightError(f"preflight: the barrier failed on rank {ctx.rank}: {err}") from err
    ones = torch.ones(1, device=ctx.device)
    dist.all_reduce(ones)
    if int(ones.item()) != ctx.world_size:
        raise PreflightError(
            f"preflight: an all-reduce of ones over {ctx.world_size} ranks gave {int(ones.item())} "
            f"on rank {ctx.rank}: the process group is broken."
        )


def join(
    device_type: str, timeout_s: float, *, parallel: ParallelConfig, one_rank_group: bool = False
) -> DistContext:
    """Join the job (launcher.parallel.dims.init_process_group), checking first that every rank arrives and can talk.

    `parallel` gives the mesh degrees, laid out over the job's world size; `one_rank_group` asks for
    a process group even when the job has a single rank (strategies that always need one).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dims = ParallelDims.of(parallel, world_size)
    if world_size == 1:
        return init_process_group(device_type, timeout_s=timeout_s, dims=dims, one_rank_group=one_rank_group)
    rank = int(os.environ["RANK"])
    set_comm_env(device_type, timeout_s)
    short = wait_s(timeout_s)
    store = job_store(rank, world_size, short)
    check_arrival(store, rank, world_size, short)
    ctx = init_process_group(device_type, timeout_s=timeout_s, store=dist.PrefixStore("pg", store), dims=dims)
    check_collectives(ctx, short)
    return ctx
