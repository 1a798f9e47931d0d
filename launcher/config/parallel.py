"""The parallel group's schema: the data-parallel strategy, the mesh axes beside it (pp_size, tp_size,
cp_size, replicate_degree), and every setting.

What each data-parallel method does with the model states is the METHODS table below: code outside
launcher/rules asks it (`ParallelConfig.method`), never a strategy's name, and the strategy registry
(launcher/parallel/registry.py) reads each entry's wrap from it. The mesh degrees are checked and laid out
by launcher/parallel/dims.py.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIASES = {"pp": "fsdp"}
"""Strategy names that stand for a data-parallel method inside pipeline stages (pp: FSDP2 where dp > 1)."""


@dataclass(frozen=True, kw_only=True)
class DataParallelMethod:
    """What a data-parallel method does with the model states: what the planner and the builders ask instead of its name."""

    wrap: str
    """The wrap launcher.parallel.parallelize applies last to each model part: none, ddp, fsdp (FSDP2), or engine
    (DeepSpeed wraps the model in its own engine when the strategy is built)."""
    replicates: bool = False
    """Every data-parallel rank keeps whole model states (single, DDP): sharding or offload can take over."""
    shards: bool = False
    """Parameters, gradients and optimizer state are FSDP2 shards over the data-parallel ranks (DTensors)."""
    owns_engine: bool = False
    """The method's own engine (DeepSpeed) calls the module, reduces the gradients and, by its ZeRO stage, partitions
    the states."""


METHODS: dict[str, DataParallelMethod] = {
    "single": DataParallelMethod(wrap="none", replicates=True),
    "ddp": DataParallelMethod(wrap="ddp", replicates=True),
    "fsdp": DataParallelMethod(wrap="fsdp", shards=True),
    "deepspeed": DataParallelMethod(wrap="engine", owns_engine=True),
    "tp": DataParallelMethod(wrap="none"),
}
"""Every data-parallel method parallel.strategy names (aliases resolved), by name."""
UNKNOWN = DataParallelMethod(wrap="none")
"""What a strategy name outside METHODS is asked as (the rules refuse the name itself)."""


def method_of(strategy: str) -> DataParallelMethod:
    """The data-parallel method `strategy` names, aliases resolved (UNKNOWN for a name the rules refuse)."""
    return METHODS.get(ALIASES.get(strategy, strategy), UNKNOWN)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Strategy choice and every strategy's settings (each strategy reads only its own)."""

    strategy: str = "single"
    """The data-parallel method single, ddp, fsdp or deepspeed, tp (tensor parallel alone), or pp (the alias of
    fsdp with pipeline stages); see launcher.parallel.registry.STRATEGIES. pp_size and tp_size are axes beside it."""
    # --- DDP ---
    bucket_mb: float = 25.0
    """DDP gradient bucket size in MiB."""
    static_graph: bool = False
    """DDP static graph (the same parameters are used every step)."""
    gradient_as_bucket_view: bool = True
    """Let gradients alias DDP's communication buckets (saves one gradient copy)."""
    find_unused_parameters: bool = False
    """Let DDP tolerate parameters that get no gradient (slower)."""
    comm_hook: str = "none"
    """DDP gradient communication hook: none, fp16, bf16 or powersgd."""
    powersgd_rank: int = 1
    """Matrix rank of PowerSGD compression."""
    powersgd_start_iter: int = 10
    """Optimizer steps of plain all-reduce before PowerSGD starts compressing (at least 2)."""
    # --- FSDP2 ---
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (full_shard); false keeps them (shard_grad_op)."""
    replicate_degree: int = 1
    """FSDP2 hybrid sharding: replicas of the sharded group (2-D mesh replicate x shard); 1 shards over all ranks."""
    cpu_offload: bool = False
    """FSDP2: keep parameters, gradients and optimizer state on the CPU."""
    prefetch_layers: int = 1
    """FSDP2: transformer blocks whose parameters are gathered ahead of use, forward and backward (0: FSDP2's default)."""
    # --- DeepSpeed ---
    zero_stage: int = 0
    """DeepSpeed ZeRO stage 0-3 (0: plain data parallel through DeepSpeed)."""
    offload_optimizer: bool = False
    """DeepSpeed: optimizer state to CPU (stage 1-3)."""
    offload_params: bool = False
    """DeepSpeed: parameters to CPU (stage 3)."""
    deepspeed_config: str | None = None
    """A DeepSpeed JSON file; its `auto` values are filled from the spec, contradictions are refused."""
    # --- tensor parallel ---
    tp_size: int = 1
    """Tensor-parallel degree (column/row-wise attention and MLP); with fsdp, a 2-D mesh dp x tp."""
    sequence_parallel: bool = False
    """Run the norms on sequence shards between tensor-parallel regions (needs tp_size > 1)."""
    # --- context parallel ---
    cp_size: int = 1
    """Context-parallel degree: each sequence is split over cp_size ranks (load-balanced causal chunks) whose
    attention gathers the keys and values; a mesh axis between the data-parallel and tensor-parallel ones."""
    # --- expert parallel ---
    ep_size: int = 1
    """Expert-parallel degree: each MoE block's experts split over groups of ep_size data-parallel ranks, the
    tokens sent to the rank holding their expert by all-to-all (model.moe.num_experts must divide by it)."""
    # --- pipeline parallel ---
    pp_size: int = 1
    """Pipeline stages' ranks: the layers are split into pp_size (x pp_stages_per_rank) consecutive stages."""
    pp_schedule: str = "1f1b"
    """gpipe, 1f1b, interleaved_1f1b or zero_bubble (torch.distributed.pipelining's schedules)."""
    pp_microbatches: int = 4
    """Pipeline micro batches each train.micro_batch_size batch is cut into (it must divide it)."""
    pp_stages_per_rank: int = 1
    """Stages each rank holds; interleaved_1f1b and zero_bubble need 2 or more (zero_bubble: exactly 2, V-shaped)."""
    pp_split: list[int] | None = None
    """null: balanced automatically (parameters and FLOPs, embedding and head counted); or the first layer of each stage after the first, e.g. [3, 6]."""

    @property
    def data_parallel(self) -> str:
        """The data-parallel method, aliases resolved (pp -> fsdp): what the planner and the backends compare."""
        return ALIASES.get(self.strategy, self.strategy)

    @property
    def method(self) -> DataParallelMethod:
        """What the data-parallel method does with the model states (METHODS): what code outside the rules asks."""
        return method_of(self.strategy)

    @property
    def engine_partitions_parameters(self) -> bool:
        """DeepSpeed's ZeRO-3: the engine partitions the parameters and gathers them around its own module calls."""
        return self.method.owns_engine and self.zero_stage == 3
