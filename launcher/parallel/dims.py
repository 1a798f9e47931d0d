"""The parallel topology of a run, with one owner: degrees -> device mesh -> ranks, and the process group.

Every fact of the layout lives here: the degrees (pp x dp_replicate x dp_shard x cp x tp, context
parallel between dp_shard and tp) are checked against the world size by
`degree_errors` (the rules call it before launch, and a rank's `ParallelDims.of` refuses what it
refuses), the one device mesh with every axis is built by `ParallelDims.build_mesh` (row-major:
pipeline outermost, tensor parallel innermost, so consecutive ranks form a tensor-parallel group),
and a rank's pipeline, data-, context- and tensor-parallel ranks are read from the same layout. The
ranks of one context-parallel group read the same batch (the same data-parallel rank) and each keeps
its own chunks of every sequence. Which stages a
pipeline rank holds is `stage_plan`'s answer, the one place a rank asks it. `init_process_group` is the one place a process
group is created, a one-rank group for a single-process job included.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from launcher.parallel.pipeline_split import rank_of_stage
from launcher.spec import SpecError

if TYPE_CHECKING:  # torch.distributed only on a rank: the rules check degrees without it
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from launcher.config.model import ModelConfig
    from launcher.config.parallel import ParallelConfig
    from launcher.parallel.pipeline_stage import StagePlan

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Names of the mesh dimensions, outermost first (a degree of 1 keeps its dimension)."""


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Degrees of a run's mesh; their product is the world size."""

    pp: int = 1
    """Pipeline-parallel degree (outermost: each pipeline stage's ranks form one data x tensor-parallel block)."""
    pp_last: int = 0
    """Pipeline rank holding the last stage, which computes the loss (pp - 1; 0 for the V-shaped zero_bubble)."""
    dp_replicate: int = 1
    """Replicas of the sharded group (FSDP2 hybrid sharding); 1 without."""
    dp_shard: int = 1
    """Ranks one data-parallel group spans: FSDP2 shards over them, DDP and ZeRO replicate or partition over them."""
    cp: int = 1
    """Context-parallel degree: ranks that split each sequence of one batch between them."""
    tp: int = 1
    """Tensor-parallel degree (innermost: consecutive ranks form a tensor-parallel group)."""

    @classmethod
    def of(cls, parallel: ParallelConfig, world_size: int) -> ParallelDims:
        """The degrees the spec asks for on `world_size` ranks (ValueError when they do not fit)."""
        errors = degree_errors(parallel, world_size)
        if errors:
            raise ValueError("; ".join(str(e) for e in errors))
        tp, replicate, pp, cp = (
            parallel.tp_size,
            parallel.replicate_degree,
            parallel.pp_size,
            parallel.cp_size,
        )
        last = rank_of_stage(pp * parallel.pp_stages_per_rank - 1, pp, parallel.pp_schedule)
        shard = world_size // (tp * replicate * pp * cp)
        return cls(pp=pp, pp_last=last, dp_replicate=replicate, dp_shard=shard, cp=cp, tp=tp)

    @property
    def world_size(self) -> int:
        """Ranks of the mesh."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: how many different batches one step reads."""
        return self.dp_replicate * self.dp_shard

    @property
    def batch_ranks(self) -> int:
        """Ranks holding different tokens of one step (data x context parallel): the count gradients average over."""
        return self.dp_size * self.cp

    def dp_rank(self, rank: int) -> int:
        """Which data shard the tensor- and context-parallel group of `rank` reads."""
        return (rank // (self.tp * self.cp)) % self.dp_size

    def cp_rank(self, rank: int) -> int:
        """Position of `rank` inside its context-parallel group: which chunks of each sequence it keeps."""
        return (rank // self.tp) % self.cp

    def pp_rank(self, rank: int) -> int:
        """Which pipeline stage (or stages) `rank` holds: its position along the outermost dimension."""
        return rank // (self.dp_size * self.cp * self.tp)

    def counts_data(self, rank: int) -> bool:
        """Whether `rank` reports its data group's tokens and loss: tensor-parallel peers and earlier
        pipeline stages hold the same batch, and only the last stage holds the loss."""
        return self.tp_rank(rank) == 0 and self.pp_rank(rank) == self.pp_last

    def tp_rank(self, rank: int) -> int:
        """Position of `rank` inside its tensor-parallel group."""
        return rank % self.tp

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The one named mesh ("pp", "dp_replicate", "dp_shard", "cp", "tp") over the process group, row-major."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)

    def stage_plan(
        self, parallel: ParallelConfig, model: ModelConfig, seq_len: int, rank: int
    ) -> StagePlan | None:
        """The pipeline's stages and the ones `rank` holds (the one place a rank asks); None without a pipeline."""
        if self.pp == 1:
            return None
        from launcher.parallel.pipeline_stage import plan_stages

        return plan_stages(model, parallel, seq_len, self.pp_rank(rank))


def degree_errors(parallel: ParallelConfig, world_size: int) -> list[SpecError]:
    """Why the spec's degrees do not fit `world_size` ranks (empty when they do)."""
    p = parallel
    if p.tp_size < 1 or p.replicate_degree < 1 or p.pp_size < 1 or p.cp_size < 1:
        return [
            SpecError(
                ("parallel.tp_size", "parallel.replicate_degree", "parallel.pp_size", "parallel.cp_size"),
                f"tp_size ({p.tp_size}), replicate_degree ({p.replicate_degree}), pp_size ({p.pp_size}) and "
                f"cp_size ({p.cp_size}) must be at least 1.",
            )
        ]
    errors = []
    group = p.tp_size * p.replicate_degree * p.pp_size
    if p.cp_size > 1 and world_size % (group * p.cp_size):
        errors.append(
            SpecError(
                ("parallel.cp_size", "launcher.nproc", "launcher.nnodes", "parallel.tp_size"),
                f"the world size ({world_size} = launcher.nnodes x launcher.nproc) must be a multiple of "
                f"parallel.cp_size x parallel.tp_size x parallel.replicate_degree x parallel.pp_size "
                f"({p.cp_size} x {p.tp_size} x {p.replicate_degree} x {p.pp_size} = {group * p.cp_size}): each "
                "context-parallel group of parallel.cp_size ranks splits one sequence. Change launcher.nproc "
                "or parallel.cp_size.",
            )
        )
    elif world_size % group and p.pp_size == 1:
        errors.append(
            SpecError(
                ("launcher.nproc", "launcher.nnodes", "parallel.tp_size", "parallel.replicate_degree"),
                f"the world size ({world_size} = launcher.nnodes x launcher.nproc) must be a multiple of "
                f"parallel.tp_size x parallel.replicate_degree ({p.tp_size} x {p.replicate_degree}). "
                "Change launcher.nproc or the degrees.",
            )
        )
    elif world_size % group:
        errors.append(
            SpecError(
                (
                    "launcher.nproc",
                    "launcher.nnodes",
                    "parallel.pp_size",
                    "parallel.tp_size",
                    "parallel.replicate_degree",
                ),
                f"the world size ({world_size} = launcher.nnodes x launcher.nproc) must be a multiple of "
                f"parallel.pp_size x parallel.tp_size x parallel.replicate_degree ({p.pp_size} x {p.tp_size} x "
                f"{p.replicate_degree} = {group}); the data-parallel degree is the world size divided by it. "
                "Change launcher.nproc or the degrees.",
            )
        )
    return errors


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
    dims: ParallelDims = field(default_factory=ParallelDims)
    """The run's parallel degrees; data- and tensor-parallel ranks come from them."""

    @property
    def dp_rank(self) -> int:
        """Data-parallel rank: which shard of the data this rank's tensor-parallel group reads."""
        return self.dims.dp_rank(self.rank)

    @property
    def dp_size(self) -> int:
        """Data-parallel degree."""
        return self.dims.dp_size

    @property
    def is_main(self) -> bool:
        """Rank 0 writes metrics, summaries and checkpoint markers."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (a no-op for one process)."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (a collective AND on the CPU; every rank must call it)."""
        if self.world_size == 1:
            return flag
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return bool(tensor.item())

    def sum(self, values: list[float]) -> list[float]:
        """Sum plain numbers over ranks (log steps only: it synchronizes)."""
        if self.world_size == 1:
            return values
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def data_mean(self, value: int) -> int | torch.Tensor:
        """The mean of `value` over data- (and context-) parallel ranks, on the device (no host sync); `value` alone.

        The loop divides each rank's summed token loss by the mean trained-token count, so that the
        gradient average over ranks is the mean over every trained token of the step, however
        unevenly prompts, padding and document starts fall. Equal counts give exactly `value`.
        """
        if self.world_size == 1:
            return value
        import torch
        import torch.distributed as dist

        counted = value if self.dims.counts_data(self.rank) else 0
        tensor = torch.tensor(float(counted), dtype=torch.float32, device=self.device)
        dist.all_reduce(tensor)
        return tensor / self.dims.batch_ranks

    def data_sum(self, values: list[float]) -> list[float]:
        """Sum numbers over data-parallel groups, each counted once (tensor-parallel peers hold the same,
        and only a pipeline's last stage holds the loss)."""
        if self.dims.tp == 1 and self.dims.pp == 1:
            return self.sum(values)
        return self.sum([v if self.dims.counts_data(self.rank) else 0.0 for v in values])


def backend_name(device_type: str) -> str:
    """The process group's backend: NCCL for CUDA tensors plus gloo for CPU ones, gloo on a CPU.

    FSDP2 CPU offload keeps sharded gradients, and so the pieces of the clipping norm, on the CPU
    even in a GPU job (torchtitan pairs the two backends the same way).
    """
    return "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"


def init_process_group(
    device_type: str,
    *,
    timeout_s: float = 600.0,
    store: dist.Store | None = None,
    dims: ParallelDims | None = None,
    one_rank_group: bool = False,
) -> DistContext:
    """Join the job described by torch's launcher variables (RANK, WORLD_SIZE, ...): the one place a group is made.

    Several ranks join through `store` (an already connected job store, see launcher.rank.preflight)
    or env://. A single process gets a one-rank group of its own (no rendezvous) when
    `one_rank_group` is set: DDP, DeepSpeed and DTensor strategies need a group even then.
    """
    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        options = {"backend": backend_name(device_type), "timeout": timedelta(seconds=timeout_s)}
        if device_type == "cuda":
            options["device_id"] = device
        if world_size > 1:
            if store is not None:
                options |= {"store": store, "rank": rank, "world_size": world_size}
            dist.init_process_group(**options)
        elif one_rank_group:
            dist.init_process_group(**options, store=dist.HashStore(), rank=0, world_size=1)
    return DistContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        dims=dims or ParallelDims(dp_shard=world_size),
    )


def shutdown(*, barrier: bool = True) -> None:
    """Leave the process group cleanly: collect garbage, wait for every rank, then destroy it.

    Tearing down gloo while its threads still hold references aborts the process at exit in a
    fraction of runs; releasing objects first and meeting at a barrier avoids that. A process
    told to stop at once (`barrier=False`) waits for no other rank. Without a process group there
    is nothing to release first (a full collection walks every object the process holds).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        gc.collect()
        try:
            if barrier:
                dist.barrier()
        finally:
            dist.destroy_process_group()


def data_mesh(mesh: DeviceMesh, replicate: int, cp: int = 1) -> DeviceMesh:
    """The mesh FSDP2 shards over: 1-D (dp_shard) or 2-D (dp_replicate, dp_shard) for hybrid sharding.

    Under context parallel the cp ranks hold different tokens of the same batch, so their gradients
    average like data parallel ones: the shard dimension is dp_shard x cp flattened (torchtitan's
    dp_shard_cp), and the parameters are sharded over it too.
    """
    shard = "dp_shard"
    if cp > 1:
        shard = "dp_shard_cp"
        try:
            mesh[shard]
        except KeyError:  # flattened once per mesh
            mesh["dp_shard", "cp"]._flatten(shard)
    return mesh["dp_replicate", shard] if replicate > 1 else mesh[shard]
