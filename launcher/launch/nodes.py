"""The nodes of a multi-node local job: one `train` per node, joined at node 0's rendezvous store.

Node 0 hosts the store on the host of launcher.rdzv_endpoint only; every node checks in on it
(`nodes/K` = its address) before torch's c10d rendezvous, so a rendezvous that times out can name
the nodes that never came. Each node's ranks talk over the interface that carries the node's own
address (the one its traffic to node 0 leaves from), not over whatever the hostname resolves to.
"""

from __future__ import annotations

import fcntl
import hashlib
import socket
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

    from launcher.config.launcher import LauncherConfig

_SIOCGIFADDR = 0x8915


def endpoint(lc: LauncherConfig) -> tuple[str, int]:
    """(host, port) of the job's rendezvous store: rdzv_endpoint for several nodes, else master_addr/port (0: free)."""
    if lc.nnodes > 1 and lc.rdzv_endpoint:
        host, _, port = lc.rdzv_endpoint.rpartition(":")
        return host.strip("[]"), int(port)
    return lc.master_addr, lc.master_port or 0


def job_id(lc: LauncherConfig, run_dir: str) -> str:
    """The rendezvous id: launcher.rdzv_id, else one derived from the run directory every node shares."""
    return lc.rdzv_id or f"run-{hashlib.sha1(run_dir.encode()).hexdigest()[:12]}"


def address_towards(host: str, port: int) -> str:
    """This machine's address on the route to host:port (what node 0 and the others reach this node at)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # UDP: picks the route and source address, sends nothing
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the network interface that carries IPv4 `address`, None when none does (or IPv6)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def check_in(store: dist.Store, run_id: str, node_rank: int, address: str) -> None:
    """Say on the rendezvous store that node `node_rank` (at `address`) has come."""
    store.set(f"launcher/{run_id}/nodes/{node_rank}", address)


def missing(store: dist.Store, run_id: str, nnodes: int) -> list[int]:
    """The node ranks that have not checked in."""
    return [k for k in range(nnodes) if not store.check([f"launcher/{run_id}/nodes/{k}"])]


def missing_message(store: dist.Store, lc: LauncherConfig, run_id: str, where: str) -> str:
    """Why the rendezvous timed out: the nodes that never checked in, and what to check."""
    try:
        absent = missing(store, run_id, lc.nnodes)
    except Exception:  # the store itself is gone (node 0 stopped)
        absent = []
    who = (
        f"node(s) {', '.join(map(str, absent))} of {lc.nnodes} (launcher.node_rank) did not join"
        if absent
        else f"the {lc.nnodes} nodes did not all join"
    )
    return (
        f"error: {who} the rendezvous {run_id!r} at {where} within {lc.timeout_s:g} s (launcher.timeout_s). "
        f"Start `train` with the same arguments and launcher.node_rank=K on each missing node; check that it "
        f"reaches {where} and gives the same launcher.rdzv_endpoint, launcher.rdzv_id and run_dir."
    )
