"""Schema of the memory group: techniques that trade compute or bandwidth for memory, applied to a built model.

What the group builds at run time lives in launcher.components.memory.
"""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATION_CHECKPOINTING = ("none", "blocks", "attention", "selective")
SELECTIVE_MATMULS = ("all", "every_other")


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """Memory-saving techniques applied to the model and the loop."""

    activation_checkpointing: str = "none"
    """none: keep every activation; blocks: recompute whole transformer blocks in backward; attention: recompute
    only their attention; selective: recompute the blocks' cheap ops, keeping their matmul and attention outputs."""
    selective_matmuls: str = "all"
    """selective: which matmul outputs are kept, all or every_other (half of them recomputed too); attention's always."""
    checkpoint_every: int = 1
    """Checkpoint every k-th block (blocks 0, k, 2k, ...); 1 checkpoints every block."""
    offload_activations: bool = False
    """Keep tensors saved for backward in CPU memory (pinned on CUDA) instead of device memory."""
    empty_cache_steps: int | None = None
    """Release cached, unused CUDA memory every this many optimizer steps (a no-op on CPU); null never."""
    auto_micro_batch: bool = False
    """Before training, find the largest micro batch that fits and keep the global batch through accumulation."""
    max_micro_batch_size: int = 64
    """Largest micro batch the search tries."""
    max_memory_gb: float | None = None
    """Memory budget per rank for the search (peak RSS on CPU, peak allocated on CUDA); null on CUDA: real OOM only."""
    cuda_alloc_conf: str | None = None
    """PYTORCH_CUDA_ALLOC_CONF for every rank on CUDA, e.g. expandable_segments:True (ignored on CPU); null: unset."""
    cpu_malloc_reuse: bool = True
    """On CPU ranks, malloc keeps what a step frees for the next step (blocks up to 32 MiB from its heap,
    which is not trimmed) instead of faulting it in again each step: faster steps, resident size held at
    a step's peak (glibc only; ignored on CUDA). false: the C library's defaults."""


CUDA_ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""The variables memory.cuda_alloc_conf sets on CUDA (torch >= 2.9 reads the second first)."""
# PyTorch's CUDA caching allocator options (PYTORCH_CUDA_ALLOC_CONF), each with what its value must be.
CUDA_ALLOC_KEYS = {
    "expandable_segments": "True or False",
    "max_split_size_mb": "a whole number of MiB",
    "garbage_collection_threshold": "a fraction between 0 and 1",
    "roundup_power2_divisions": "a whole number or a list such as [256:1,512:2,>:8]",
    "pinned_use_cuda_host_register": "True or False",
    "pinned_num_register_threads": "a whole number",
    "backend": "native or cudaMallocAsync",
}
