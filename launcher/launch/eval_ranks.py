"""Where `train-eval`'s ranks run: one in this process, several under torch's elastic launcher on this machine."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path


def _free_port() -> int:
    """A TCP port nothing listens on now, for the ranks' rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_command(spec_path: Path, checkpoint: Path | None, nproc: int) -> list[str]:
    """The command that starts `nproc` ranks of launcher.rank.eval_worker on this machine."""
    extra = ["--checkpoint", str(checkpoint)] if checkpoint is not None else []
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}", "-m", "launcher.rank.eval_worker", str(spec_path), *extra,
    ]  # fmt: skip


def run_evaluation(spec_path: Path, checkpoint: Path | None, nproc: int) -> int:
    """Run the evaluation ranks; their exit status (the first failing rank's, under the elastic launcher)."""
    if nproc == 1:
        from launcher.components import quiet, warning_lines
        from launcher.rank import eval_worker
        from launcher.spec import load_spec

        warning_lines.install()
        quiet.install(verbose=load_spec(spec_path).log.verbose)
        return eval_worker.run(spec_path, checkpoint)
    return subprocess.run(rank_command(spec_path, checkpoint, nproc)).returncode
