"""Hardware profiles and the predicted step of `dry_run=simulate`: compute, communication, overlap.

The step's compute is the per-operator sum of launcher.plan.op_roofline (each aten op of the
simulated step at the rate its kernel achieves, measured on a GPU) where the simulation counted the
ops; without them, and as the stated upper bound beside it, the model's training FLOPs for this
rank's tokens (6N + attention, divided by the tensor- and pipeline-parallel degrees) at the dense
bf16 peak plus the bytes the step streams through HBM at its peak bandwidth. Each measured
collective takes ring time: (n-1)/n x bytes for an all-gather, reduce-scatter or all-to-all, twice
that for an all-reduce, over NVLink inside a node or the per-GPU network between nodes. What overlaps
is the strategy's: FSDP2 prefetches its all-gathers and reduce-scatters behind compute (the expert
slices' over their replicas too; only what exceeds compute is exposed), DDP's bucketed all-reduce
hides behind backward (about two thirds of compute), tensor-parallel all-reduces and expert
parallelism's all-to-alls (dispatch and combine) sit on the critical path, and a pipeline idles for its
bubble (docs/planner.md compares the prediction with real and published runs).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One accelerator's published peaks."""

    name: str
    """What it is called in words."""
    bf16_flops: float
    """Dense bf16 tensor-core peak, FLOP/s (no sparsity)."""
    hbm_bytes_per_s: float
    """Peak memory bandwidth, bytes/s."""
    nvlink_bytes_per_s: float
    """NVLink bandwidth per GPU, one direction, bytes/s."""
    network_bytes_per_s: float
    """Inter-node bandwidth per GPU (one NIC per GPU), bytes/s."""
    memory_bytes: int
    """Device memory."""
    gpus_per_node: int = 8
    """GPUs one NVLink domain connects."""
    capability: tuple[int, int] = (9, 0)
    """CUDA compute capability (what the bf16, TF32 and fp8 rules judge where this GPU is named, not probed)."""
    source: str = ""
    """Where the numbers are published."""


HARDWARE: dict[str, Hardware] = {
    "h100_sxm": Hardware(
        name="NVIDIA H100 SXM 80GB",
        bf16_flops=989e12,
        hbm_bytes_per_s=3.35e12,
        nvlink_bytes_per_s=450e9,  # 900 GB/s bidirectional
        network_bytes_per_s=50e9,  # 400 Gb/s ConnectX-7 NDR per GPU (DGX H100)
        memory_bytes=80 * 10**9,
        source="NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100/); DGX H100 user guide",
    ),
    "h100_hbm2e": Hardware(
        name="NVIDIA H100 96GB HBM2e (500 W, Grand Teton)",
        bf16_flops=989e12,  # the SXM figure; torchtitan notes the true peak lies between SXM and NVL
        hbm_bytes_per_s=2.4e12,
        nvlink_bytes_per_s=450e9,
        network_bytes_per_s=50e9,
        memory_bytes=96 * 10**9,
        source="pytorch/torchtitan docs/performance.md (hardware of its published Llama 3.1 runs)",
    ),
    "h200": Hardware(
        name="NVIDIA H200 SXM 141GB",
        bf16_flops=989e12,
        hbm_bytes_per_s=4.8e12,
        nvlink_bytes_per_s=450e9,
        network_bytes_per_s=50e9,
        memory_bytes=141 * 10**9,
        source="NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200/)",
    ),
    "a100_80g": Hardware(
        name="NVIDIA A100 SXM 80GB",
        bf16_flops=312e12,
        hbm_bytes_per_s=2.039e12,
        nvlink_bytes_per_s=300e9,  # 600 GB/s bidirectional
        network_bytes_per_s=25e9,  # 200 Gb/s HDR per GPU (DGX A100)
        memory_bytes=80 * 10**9,
        capability=(8, 0),
        source="NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100/); DGX A100 user guide",
    ),
}
"""Hardware profiles by the name `simulate_hardware` takes (also the GPU a dry run plans for where none is here)."""

OVERLAPPED_GROUPS = ("dp", "world", "pp", "ep_replica")
"""Groups (mesh axes, by prefix) whose collectives the strategy overlaps with compute."""

RING_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}
"""Bytes each rank sends per byte of the collective's buffer, times (n-1)/n (ring algorithms)."""


@dataclass(frozen=True, kw_only=True)
class Traffic:
    """One kind of collective of a step, as the roofline needs it."""

    op: str
    group: str
    group_size: int
    group_stride: int
    num_bytes: int
    count: int


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """A rank's predicted step."""

    compute_s: float
    """The step's compute: per operator at achievable rates, or FLOPs at peak plus HBM traffic at peak bandwidth."""
    comm_s: float
    """All collectives back to back."""
    exposed_comm_s: float
    """The part of comm_s the strategy does not hide behind compute."""
    step_s: float
    """The predicted step (compute, exposed communication, pipeline bubble)."""
    tokens_per_s_per_gpu: float
    """Trained tokens per second per GPU."""
    mfu: float
    """Model FLOPs utilization: model FLOPs per second over the peak."""


def collective_s(traffic: Traffic, hw: Hardware) -> float:
    """Ring time of every call of one collective kind: NVLink within a node, the network across nodes."""
    n = traffic.group_size
    if n <= 1:
        return 0.0
    inside = traffic.group_stride * (n - 1) < hw.gpus_per_node
    bandwidth = hw.nvlink_bytes_per_s if inside else hw.network_bytes_per_s
    per_call = RING_FACTOR.get(traffic.op, 1.0) * (n - 1) / n * traffic.num_bytes / bandwidth
    return per_call * traffic.count


def predict(
    *,
    hw: Hardware,
    model_flops_per_token: float,
    tokens_per_gpu: float,
    hbm_bytes: float,
    traffic: list[Traffic],
    wrap: str,
    bubble: float = 0.0,
    compute_s: float | None = None,
) -> Prediction:
    """The step of one rank: its share of the step's tokens (its data group's tokens / (tp x pp)) and their FLOPs.

    `compute_s`, where given (the per-operator sum of launcher.plan.op_roofline), replaces the
    peak-rate compute (FLOPs at the dense peak plus `hbm_bytes` at the HBM peak).
    """
    flops = model_flops_per_token * tokens_per_gpu
    compute = flops / hw.bf16_flops + hbm_bytes / hw.hbm_bytes_per_s if compute_s is None else compute_s
    # FSDP2's and DDP's collectives (over the data-parallel ranks, or the expert slices' replicas) hide
    # behind compute; tensor-parallel all-reduces and expert parallelism's all-to-alls wait for their data
    overlapped = sum(collective_s(t, hw) for t in traffic if t.group.startswith(OVERLAPPED_GROUPS))
    critical = sum(collective_s(t, hw) for t in traffic) - overlapped
    if wrap == "fsdp":
        hidden = compute
    elif wrap == "ddp":
        hidden = compute * 2 / 3
    else:
        hidden = 0.0
    exposed = critical + max(overlapped - hidden, 0.0)
    step = (compute + exposed) / max(1.0 - bubble, 1e-6)
    tokens_per_s = tokens_per_gpu / step if step > 0 else 0.0
    return Prediction(
        compute_s=compute,
        comm_s=overlapped + critical,
        exposed_comm_s=exposed,
        step_s=step,
        tokens_per_s_per_gpu=tokens_per_s,
        mfu=model_flops_per_token * tokens_per_s / hw.bf16_flops,
    )
