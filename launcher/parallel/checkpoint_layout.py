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
OPTIMIZER_RESTARTS = (
    "the optimizer state (Adam's moments and step counts) restarts from zero: ZeRO keeps it flattened per "
    "rank, so only the fp32 weights carry over; the step, LR schedule, data position and RNG continue"
)
"""What a DeepSpeed checkpoint does not carry into another strategy or world size."""


def is_dcp_checkpoint(directory: Path) -> bool:
    """Whether a checkpoint directory was written by a DCP strategy (fsdp, tp, a pipeline)."""
    return (Path(directory) / DCP_DIR / ".metadata").is_file()


def is_deepspeed_checkpoint(directory: Path) -> bool:
    """Whether a checkpoint directory was written by DeepSpeed (its files under TAG)."""
    return (Path(directory) / TAG).is_dir()


def checkpoint_kind(directory: Path) -> str:
    """Which layout wrote a checkpoint: dcp (fsdp, tp, pipelines), deepspeed, or files (single, ddp)."""
    if is_dcp_checkpoint(directory):
        return "dcp"
    return "deepspeed" if is_deepspeed_checkpoint(directory) else "files"
