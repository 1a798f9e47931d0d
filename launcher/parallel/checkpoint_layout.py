"""Where the sharded strategies keep their files inside a checkpoint directory: names only, no torch.

The resume rules read these in the launching process; the strategies (launcher.parallel.deepspeed,
launcher.parallel.part_state) write and read the files on the ranks.
"""

from __future__ import annotations

from pathlib import Path

TAG = "deepspeed"
"""Sub-directory of a checkpoint holding DeepSpeed's files (its `tag`)."""
DCP_DIR = "dcp"
"""Subdirectory of a checkpoint that holds the DCP shards of model and optimizer."""


def is_dcp_checkpoint(directory: Path) -> bool:
    """Whether a checkpoint directory was written by a DCP strategy (fsdp, tp)."""
    return (Path(directory) / DCP_DIR / ".metadata").is_file()
