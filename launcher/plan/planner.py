"""The memory planner: per-device bytes of a run, from its spec and world size alone (nothing is built).

Model states (weights, gradients, optimizer state; the ZeRO paper's formulas) come from
`launcher.plan.states`, activations from `launcher.plan.activations`, and the step's largest moment
from `launcher.plan.moments`. A Hugging Face model's activations are those of the GPT of its width,
depth and heads, a gated MLP counted 1.5 times as wide; a Llama-style one's layers are counted
tensor by tensor from their own widths (`launcher.plan.activations`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from launcher.components.model.shape import model_shape
from launcher.config.objective import rows_per_example
from launcher.plan import activations as acts
from launcher.plan import compression
from launcher.plan.experts import expert_notes, expert_plan, routed_activation_bytes
from launcher.plan.long_context import long_context_terms
from launcher.plan.moments import StepBytes, step_moments
from launcher.plan.roofline import HARDWARE
from launcher.plan.states import ModelStates, autocasts_16bit, count_params, gpt_view, model_states
from launcher.spec import RunSpec

MiB, GiB = 1024**2, 1024**3
CUDA_CONTEXT_BYTES = 512 * MiB  # CUDA context and kernels: outside torch's allocator, seen by nvidia-smi
ALLOCATOR_SLACK = 0.10  # the caching allocator's fragmentation, as a share of tensor bytes on GPU


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Per-device bytes of one rank, split the way the ZeRO paper and activation model count them."""

    parameters: int
    """Model weights held on the device (sharded, quantized or offloaded as the spec says)."""
    gradients: int
    """Gradients of the trainable parameters held on the device."""
    optimizer_states: int
    """Optimizer state (and float32 master weights under DeepSpeed mixed precision) on the device."""
    activations: int
    """Tensors saved for backward at the peak of one micro batch, logits and loss included."""
    buffers: int
    """Everything else: autocast weight copies, communication buckets, gathered shards, CUDA context."""
    host_bytes: int = 0
    """Bytes moved to host memory by offload (not part of the device total)."""
    world_size: int = 1
    """Ranks the plan assumes."""
    device_type: str = "cpu"
    """cpu or cuda."""
    num_params: int = 0
    """Parameters of the model."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """How each figure was counted."""
    peak: int = 0
    """Device bytes at the step's largest moment (launcher.plan.moments); 0: the parts all coexist."""
    step_peak: int = 0
    """The same, the build left out: what a step holds (what `dry_run=simulate` measures); 0 as `peak`."""

    @property
    def total(self) -> int:
        """Device bytes at the peak: the largest moment of the step, or all five parts together."""
        parts = self.parameters + self.gradients + self.optimizer_states + self.activations + self.buffers
        return self.peak or parts


def activation_shape(
    spec: RunSpec, micro_batch: int | None = None, device_type: str | None = None
) -> acts.ActivationShape:
    """What one rank pushes through the model at a time (default: train.micro_batch_size sequences, or pairs' rows)."""
    from launcher.components.device import resolve_device

    rows = rows_per_example(spec.objective.name)  # a pair is two rows: chosen and rejected
    p, batch = spec.parallel, micro_batch or spec.train.micro_batch_size * rows
    device_type = device_type or resolve_device(spec.launcher.device)
    cp = max(p.cp_size, 1)
    return acts.ActivationShape(
        micro_batch=batch,
        seq_len=spec.data.seq_len // cp,  # context parallel: this rank's chunks of each sequence
        cp_size=cp,
        act_bytes=2 if autocasts_16bit(spec) else 4,
        tp_size=max(p.tp_size, 1),
        sequence_parallel=p.sequence_parallel,
        llama=model_shape(spec.model).llama_layer,  # None for a family without Llama-style layers
        residual_bytes=2 if fsdp_computes_16bit(spec) else 4,
        **long_context_terms(spec, batch, device_type),
    )


def fsdp_computes_16bit(spec: RunSpec) -> bool:
    """Whether FSDP2 wraps the model with its mixed-precision policy (16-bit weights, so a 16-bit residual stream).

    Pipeline stages are counted as FSDP2-wrapped where other ranks hold the same stage.
    """
    p = spec.parallel
    if not autocasts_16bit(spec) or not p.method.shards:
        return False
    model_ranks = max(p.pp_size, 1) * max(p.tp_size, 1) * max(p.cp_size, 1)
    return p.pp_size <= 1 or max(spec.launcher.world_size, 1) > model_ranks


def device_plan(
    spec: RunSpec,
    states: ModelStates,
    activations: float,
    *,
    kept: float,
    world: int,
    kind: str,
    notes: list[str],
    moments: bool = False,
) -> MemoryPlan:
    """One rank's plan from its model states and activations: offload (`kept` stays), CUDA context, slack.

    With `moments` the total is the step's largest moment (launcher.plan.moments), else the parts' sum.
    """
    host = states.host_bytes
    if spec.memory.offload_activations and kind == "cuda":
        host, activations = host + activations, kept
        notes.append("activations offloaded to CPU: one block and the logits stay on the device")
    buffers = states.buffers
    tensors = states.parameters + states.gradients + states.optimizer_states + activations + buffers
    peak = step_peak = 0.0
    if moments:
        step = step_moments(
            spec, StepBytes.of(states, activations), mixed=autocasts_16bit(spec), device_type=kind
        )
        tensors = peak = step.peak
        step_peak = max(step.activation_peak, step.end_of_backward, step.optimizer_step)
        notes.append(
            f"total: {step.name}, the largest moment of the build and the step (launcher.plan.moments)"
        )
    if kind == "cuda":
        extra = CUDA_CONTEXT_BYTES + ALLOCATOR_SLACK * tensors
        buffers, peak = buffers + extra, peak + extra * bool(peak)
        step_peak += CUDA_CONTEXT_BYTES + ALLOCATOR_SLACK * step_peak if step_peak else 0.0
        notes.append("buffers include the CUDA context (~512 MiB) and 10% allocator fragmentation")
    return MemoryPlan(
        parameters=round(states.parameters),
        gradients=round(states.gradients),
        optimizer_states=round(states.optimizer_states),
        activations=round(activations),
        buffers=round(buffers),
        host_bytes=round(host),
        world_size=world,
        device_type=kind,
        num_params=count_params(spec).total,
        notes=tuple(notes),
        peak=round(peak),
        step_peak=round(step_peak),
    )


def plan(spec: RunSpec, world: int | None = None, device_type: str | None = None) -> MemoryPlan:
    """The per-device memory of one rank of `spec` on `world` ranks (default: the spec's own).

    Strategy pp differs per pipeline rank: `launcher.plan.pipeline.pipeline_plan` plans it.
    """
    from launcher.components.device import resolve_device

    if spec.parallel.pp_size > 1:
        raise ValueError("a pipeline is planned per pipeline rank: launcher.plan.pipeline.pipeline_plan")
    n = world or max(spec.launcher.world_size, 1)
    kind = device_type or resolve_device(spec.launcher.device)
    states = model_states(spec, n)
    gpt = gpt_view(spec)  # activations of a Hugging Face model: those of the GPT of its shape
    mem, shape = spec.memory, activation_shape(spec, device_type=kind)
    activations = acts.activation_bytes(
        gpt.model, shape, mode=mem.activation_checkpointing, checkpoint_every=mem.checkpoint_every
    ) + routed_activation_bytes(spec, shape)
    notes = [
        states.note,
        f"activations: micro batch {shape.micro_batch} x {shape.seq_len} tokens, "
        f"checkpointing {mem.activation_checkpointing}, logits {acts.logit_rows(shape)}"
        f" x {acts.vocab_shard(gpt.model, shape)} x 4 B x {1 + acts.loss_grad_slices(shape)}"
        + (f" (one of {shape.loss_chunks} loss chunks)" if shape.loss_chunks > 1 else ""),
    ]
    if shape.dense_mask:
        notes.append(f"dense document mask {shape.micro_batch} x {shape.seq_len}^2 B (model.attention: sdpa)")
    if shape.cp_size > 1:
        notes.append(f"context parallel: {shape.seq_len} tokens a rank, KV of {shape.cp_size} ranks a block")
    experts = expert_plan(spec, shape, n)
    if experts is not None:
        hw = HARDWARE.get(spec.simulate_hardware) if kind == "cuda" else None
        notes += expert_notes(experts, hw, spec.simulate_hardware)
    kept = acts.head_bytes(gpt.model, shape) + acts.layer_bytes(gpt.model, shape)
    extra, extra_notes = compression.extra_bytes(
        spec
    )  # masks, teachers, observers: small per-technique terms
    states = dataclasses.replace(states, buffers=states.buffers + extra)
    notes += extra_notes
    return device_plan(
        spec, states, activations, kept=kept, world=n, kind=kind, notes=notes, moments=states.by_moment
    )
