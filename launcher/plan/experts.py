"""A Mixture-of-Experts model in the plan: total and active parameters, a rank's expert shard, the all-to-alls.

Pure arithmetic on the spec (nothing is built). Under expert parallelism (parallel.ep_size) each MoE
layer of each micro batch moves every token copy to the rank holding its expert and back: dispatch and
combine in forward, their gradients the same way in backward (and the dispatch and combine again where
activation checkpointing recomputes the layer's forward). Each is one all-to-all over the ep group of a
buffer of tokens x top_k rows of d_model values, of which a rank sends (ep - 1) / ep to the others
(balanced routing: every expert receives tokens x top_k / E rows). Before each dispatch the ranks
exchange how many rows they send (E integers). The dispatched rows are the residual stream's dtype,
the combined rows the experts' matmul output's (16-bit under autocast).
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.components.model.shape import model_shape
from launcher.plan.activations import ActivationShape
from launcher.plan.roofline import Hardware, Traffic, collective_s
from launcher.spec import RunSpec

COUNT_BYTES = 8
"""Bytes of one expert's row count in the counts exchange (int64)."""
ROUTER_FLOATS = 4
"""float32 [tokens, E] tensors a router keeps for backward (logits, scores, the balancing losses' terms)."""


@dataclass(frozen=True, kw_only=True)
class AllToAll:
    """One kind of all-to-all of a step, as the simulation's collective table lists it."""

    what: str
    """Which exchange, in words."""
    num_bytes: int
    """The buffer one call moves through the group (what each rank holds before and after)."""
    count: int
    """Calls per optimizer step."""


@dataclass(frozen=True, kw_only=True)
class ExpertPlan:
    """What the plan says about a Mixture-of-Experts model's experts on one rank."""

    num_params: int
    """Every parameter of the model."""
    num_active_params: int
    """Parameters one token runs through (the top_k of each MoE layer's experts)."""
    num_experts: int
    """Routed experts per MoE layer."""
    num_layers: int
    """MoE layers."""
    local_experts: int
    """Experts of each MoE layer this rank computes (num_experts / ep_size)."""
    expert_params: int
    """Routed experts' parameters of the whole model."""
    stored_expert_params: float
    """Of those, what this rank stores (its ep_size-th, divided again by its replicas under FSDP2)."""
    ep_size: int
    """Ranks of an expert-parallel group."""
    group_stride: int = 1
    """Ranks between two of a group (its data ranks share a tensor-parallel coordinate: tp_size apart)."""
    all_to_alls: tuple[AllToAll, ...]
    """The step's all-to-alls (none without expert parallelism)."""

    @property
    def sent_bytes_per_step(self) -> float:
        """Bytes this rank sends to other ranks in one step's all-to-alls."""
        share = (self.ep_size - 1) / self.ep_size
        return share * sum(a.num_bytes * a.count for a in self.all_to_alls)


def _passes(spec: RunSpec) -> int:
    """Forward passes of a MoE layer per micro batch: 2 where activation checkpointing recomputes it."""
    return 2 if spec.memory.activation_checkpointing in ("blocks", "full") else 1


def expert_plan(spec: RunSpec, tokens: ActivationShape, world: int | None = None) -> ExpertPlan | None:
    """The spec's experts on one rank pushing `tokens` (the planner's activation shape); None for a dense model."""
    shape = model_shape(spec.model)
    experts = shape.experts
    if experts is None:
        return None
    n, ep = max(world or spec.launcher.world_size, 1), max(spec.parallel.ep_size, 1)
    stored = experts.num_params / ep
    if spec.parallel.method.shards and n > ep:  # FSDP2 shards the slices over their replicas
        stored /= n // ep
    rows = tokens.micro_batch * tokens.seq_len * experts.top_k  # one MoE layer's token copies, a micro batch
    d = shape.equivalent.d_model
    dispatch_bytes, combine_bytes = tokens.residual_bytes, tokens.act_bytes
    layers, micro = experts.num_layers, spec.train.grad_accum_steps
    forward = layers * micro * _passes(spec)
    all_to_alls: tuple[AllToAll, ...] = ()
    if ep > 1:
        all_to_alls = (
            AllToAll(what="dispatch (forward) and its gradient (backward)", num_bytes=rows * d * dispatch_bytes,
                     count=forward + layers * micro),
            AllToAll(what="combine (forward) and its gradient (backward)", num_bytes=rows * d * combine_bytes,
                     count=forward + layers * micro),
            AllToAll(what="row counts", num_bytes=experts.num_experts * COUNT_BYTES, count=forward),
        )  # fmt: skip
    return ExpertPlan(
        num_params=shape.num_params,
        num_active_params=shape.num_active_params or shape.num_params,
        num_experts=experts.num_experts,
        num_layers=layers,
        local_experts=experts.num_experts // ep,
        expert_params=experts.num_params,
        stored_expert_params=stored,
        ep_size=ep,
        group_stride=max(spec.parallel.tp_size, 1),
        all_to_alls=all_to_alls,
    )


def routed_activation_bytes(spec: RunSpec, tokens: ActivationShape) -> float:
    """Bytes the MoE layers keep for backward beyond the dense MLP of their active width (the GPT view's).

    Per MoE layer and token copy (tokens x top_k of them): the copies gathered in expert order (the
    residual stream's dtype), the experts' outputs and their weighted sum's input (the matmul's dtype);
    a gated expert's fused gate_up output is one more width than the dense view's 1.5 x; and the router's
    float32 [tokens, E] tensors. Counted from the saved tensors of one block
    (docs/planner.md). A block under activation checkpointing keeps only its input: one block's worth.
    """
    experts = model_shape(spec.model).experts
    if experts is None:
        return 0.0
    d = model_shape(spec.model).equivalent.d_model
    num_tokens = tokens.micro_batch * tokens.seq_len
    rows = num_tokens * experts.top_k
    per_layer = rows * d * (tokens.residual_bytes + 2 * tokens.act_bytes)
    per_layer += rows * experts.width * tokens.act_bytes * experts.gated
    per_layer += num_tokens * experts.num_experts * 4 * ROUTER_FLOATS
    held = 1 if spec.memory.activation_checkpointing in ("blocks", "full") else experts.num_layers
    return per_layer * held


def _size(num: float) -> str:
    """Bytes as GiB (from 1 GiB up) or MiB, as the plan's table prints them."""
    return f"{num / 1024**3:.2f} GiB" if num >= 1024**3 else f"{num / 1024**2:.1f} MiB"


def all_to_all_s(plan: ExpertPlan, hw: Hardware) -> float:
    """Ring time of the step's all-to-alls on `hw` (NVLink where the group's ranks share a node)."""
    return sum(
        collective_s(
            Traffic(op="all_to_all", group="ep", group_size=plan.ep_size, group_stride=plan.group_stride,
                    num_bytes=a.num_bytes, count=a.count),
            hw,
        )
        for a in plan.all_to_alls
    )  # fmt: skip


def expert_notes(plan: ExpertPlan, hw: Hardware | None = None, hw_key: str = "") -> list[str]:
    """The plan's lines about the experts: parameters, this rank's shard, the all-to-alls and their time."""
    notes = [
        f"experts: {plan.num_params / 1e6:,.2f}M parameters, {plan.num_active_params / 1e6:,.2f}M active per token; "
        f"{plan.num_experts} routed experts in each of {plan.num_layers} MoE layers "
        f"({plan.expert_params / 1e6:,.2f}M parameters), {plan.local_experts} per rank (ep {plan.ep_size}), "
        f"{plan.stored_expert_params / 1e6:,.2f}M stored per rank"
    ]
    if not plan.all_to_alls:
        return notes
    for a in plan.all_to_alls:
        notes.append(
            f"all-to-all over ep {plan.ep_size}: {a.what}: {a.count} x {_size(a.num_bytes)} per step"
        )
    line = (
        f"all-to-all per step: {_size(plan.sent_bytes_per_step)} sent per rank "
        f"((ep - 1) / ep of {_size(sum(a.num_bytes * a.count for a in plan.all_to_alls))})"
    )
    if hw is not None:
        line += f", {all_to_all_s(plan, hw) * 1e3:,.1f} ms on {hw_key} (on the critical path)"
    notes.append(line)
    return notes
