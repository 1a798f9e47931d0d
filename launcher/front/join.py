"""The other nodes of a multi-node local job (launcher.node_rank > 0): join node 0's run directory.

Node 0's `train` takes the run directory's lock and writes spec.yaml, as a single-node run does. The
others do neither: each waits until spec.yaml holds exactly the spec it composed (the same command
line on every node; launcher.node_rank is recorded as 0, so the file is the same for every node),
then starts its own ranks from it. The run directory must be one every node sees: a shared filesystem.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from launcher.front import compose

POLL_S = 0.1
"""How often a waiting node looks at spec.yaml."""


def written_spec(built: compose.Built, run_dir: Path) -> str:
    """spec.yaml as node 0 writes it from the same command line: launcher.node_rank recorded as 0."""
    spec = built.spec
    node_0 = dataclasses.replace(spec, launcher=dataclasses.replace(spec.launcher, node_rank=0))
    return dataclasses.replace(built, spec=node_0).written(run_dir)[1]


def wait_for_spec(path: Path, expected: str, timeout_s: float) -> bool:
    """Wait until `path` holds exactly `expected` (rank 0 or node 0 wrote it); whether it did in time."""
    deadline = time.monotonic() + timeout_s
    while not _holds(path, expected):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def wait_for_node_0(built: compose.Built, run_dir: Path) -> str | None:
    """Wait until node 0 wrote this node's spec into run_dir; None when it did, else why not."""
    path, spec = run_dir / "spec.yaml", built.spec
    if wait_for_spec(path, written_spec(built, run_dir), spec.launcher.timeout_s):
        return None
    return (
        f"error: node {spec.launcher.node_rank} waited {spec.launcher.timeout_s:g} s "
        f"(launcher.timeout_s) for node 0 to write {path} with the spec this node composed, and it "
        "did not. Node 0 did not start or failed (its error comes first), the nodes were given "
        "different arguments (only launcher.node_rank may differ), or run_dir is not shared between "
        "the nodes (it must be: a shared filesystem path)."
    )


def _holds(path: Path, expected: str) -> bool:
    try:
        return path.read_text() == expected
    except OSError:
        return False
