"""The process group of a run: rank facts from the environment, init, collectives, clean shutdown."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class DistContext:
    """Where this process sits in the job."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of ranks in the job."""
    local_rank: int
    """Rank on this node (selects the GPU)."""
    device: torch.device
    """The device this rank computes on."""
    tp_size: int = 1
    """Ranks of one tensor-parallel group: consecutive ranks that compute on the same data."""

    @property
    def dp_rank(self) -> int:
        """Data-parallel rank: which shard of the data this rank's tensor-parallel group reads."""
        return self.rank // self.tp_size

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: world size over the tensor-parallel size."""
        return self.world_size // self.tp_size

    def data_sum(self, values: list[float]) -> list[float]:
        """Sum numbers over data-parallel groups, each counted once (tensor-parallel peers hold the same)."""
        if self.tp_size == 1:
            return self.sum(values)
        return self.sum([v if self.rank % self.tp_size == 0 else 0.0 for v in values])

    @property
    def is_main(self) -> bool:
        """Rank 0 writes metrics, summaries and checkpoint markers."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (a no-op for one process)."""
        if self.world_size > 1:
            dist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Sum plain numbers over ranks (log steps only: it synchronizes)."""
        if self.world_size == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()


def init(device_type: str, timeout_s: float = 600.0, store: dist.Store | None = None) -> DistContext:
    """Join the process group described by torch's launcher variables (RANK, WORLD_SIZE, ...).

    `store` is an already connected job store (see launcher.rank.preflight); without one, env:// is used.
    """
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        # NCCL for CUDA tensors plus gloo for CPU tensors (FSDP2 CPU offload keeps sharded gradients,
        # and so the pieces of the clipping norm, on the CPU; torchtitan does the same).
        backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device_type == "cuda" else None,
            **({"store": store, "rank": rank, "world_size": world_size} if store is not None else {}),
        )
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def shutdown() -> None:
    """Leave the process group cleanly: collect garbage, wait for every rank, then destroy it.

    Tearing down gloo while its threads still hold references aborts the process at exit in a
    fraction of runs; releasing objects first and meeting at a barrier avoids that.
    """
    gc.collect()
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
