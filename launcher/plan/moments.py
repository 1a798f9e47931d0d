"""When each part of a rank's memory is alive: the moments of an optimizer step (and the build), of which a rank holds the largest.

The planner's rows (launcher.plan.planner) say how large each part gets; they are not all alive at
once. `dry_run=simulate` (torch's MemTracker over a real step) shows three moments:

- the activation peak, as the last micro batch's backward starts: weights, optimizer state, every
  saved activation with the loss's logit-sized gradients, autocast's 16-bit weight copies and
  FSDP2's gathered root and blocks. Gradients are alive here only with gradient accumulation (the
  earlier micro batches' sum; under FSDP2's deferred reduction unsharded);
- the end of backward, when the token embedding's gradient is made: every other gradient exists,
  the activations are freed, and the embedding's gradient is a dense vocab x d_model temporary
  (three of them when the head is tied to it: the head's contribution waits for the embedding's
  and the two are summed). Under FSDP2 the root group (embeddings, final norm, head) is still
  gathered and its gradients unsharded, and one block's unsharded gradient waits for its
  reduce-scatter;
- the optimizer step: every gradient, and foreach AdamW's one parameter-sized temporary (the fused
  kernel, the default, makes none).

Under FSDP2 and TP a fourth moment comes before the first step: the build (`build_bytes`), the
whole float32 model of an eager build beside the kept shards, or one whole parameter of the
built-in GPT's meta-device build (launcher.components.model.meta_init).

Pipeline schedules overlap micro batches (one's backward while the next's activations are alive):
their plans keep the sum of the parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from launcher.components.model.on_meta import builds_on_meta
from launcher.components.model.shape import model_shape
from launcher.config.model import vocab_size
from launcher.config.optimizer import FUSED_AUTO_DEVICES
from launcher.spec import RunSpec

FP32 = 4


@dataclass(frozen=True, kw_only=True)
class Moments:
    """A rank's device bytes at each moment of an optimizer step."""

    activation_peak: float
    """As the last micro batch's backward starts."""
    end_of_backward: float
    """As the token embedding's gradient is made."""
    optimizer_step: float
    """While the optimizer updates the weights."""
    build: float = 0.0
    """While the model is built and split (0: the rank keeps the whole model anyway)."""

    @property
    def peak(self) -> float:
        """The largest moment: what the device must hold."""
        return max(self.activation_peak, self.end_of_backward, self.optimizer_step, self.build)

    @property
    def name(self) -> str:
        """Which moment is the largest, in words."""
        pairs = [
            (self.activation_peak, "the activation peak"),
            (self.end_of_backward, "the end of backward"),
            (self.optimizer_step, "the optimizer step"),
            (self.build, "the model build"),
        ]
        return max(pairs, key=lambda pair: pair[0])[1]


class HeldStates(Protocol):
    """A rank's model states as the planner counts them (launcher.plan.states.ModelStates)."""

    parameters: float
    optimizer_states: float
    gradients: float
    buffers: float
    forward_buffers: float
    backward_buffers: float
    shard: int


@dataclass(frozen=True, kw_only=True)
class StepBytes:
    """What one rank holds, split by when it is alive (the planner's rows, regrouped)."""

    held: float
    """Alive throughout: weights, optimizer state, buffers of every moment."""
    parameters: float = 0.0
    """The weights this rank keeps (part of `held`)."""
    forward_buffers: float
    """Alive with the activations only: autocast's weight copies, FSDP2's gathered blocks."""
    backward_buffers: float
    """Alive at the end of backward only: FSDP2's unsharded gradient of one block."""
    activations: float
    """The activation peak of one micro batch."""
    gradients: float
    """This rank's gradients as the optimizer sees them (sharded under FSDP2)."""
    shard: int = 1
    """Ranks FSDP2 shards the gradients over (1: not sharded)."""

    @classmethod
    def of(cls, states: HeldStates, activations: float) -> StepBytes:
        """The planner's model states and activations regrouped by when they are alive."""
        held = states.parameters + states.optimizer_states + states.buffers
        return cls(
            held=held - states.forward_buffers - states.backward_buffers,
            parameters=states.parameters,
            forward_buffers=states.forward_buffers,
            backward_buffers=states.backward_buffers,
            activations=activations,
            gradients=states.gradients,
            shard=states.shard,
        )


def _embedding_sizes(spec: RunSpec) -> tuple[float, float, bool]:
    """(token embedding parameters, root group parameters, tied head), counting only trainable ones."""
    shape = model_shape(spec.model)
    cfg = shape.equivalent
    if spec.quantization.lora.rank > 0:  # adapters only: the embeddings get no gradient
        return 0.0, 0.0, cfg.tie_embeddings
    per_layer = sum(i * o for i, o in shape.block_linears.values()) + 2 * cfg.d_model * (1 + int(cfg.bias))
    root = shape.num_params - cfg.n_layer * per_layer  # embeddings, final norm, an untied head
    if shape.experts is not None:  # a MoE model's layers hold experts beside their linears: counted exactly
        root = shape.experts.outside_layers
    return float(vocab_size(cfg) * cfg.d_model), float(max(root, 0)), cfg.tie_embeddings


def _foreach_adamw(spec: RunSpec, device_type: str) -> bool:
    """Whether AdamW steps with the foreach kernels (one parameter-sized temporary) rather than fused ones."""
    o = spec.optimizer
    if o.name != "adamw":
        return False
    return o.implementation == "foreach" or (
        o.implementation == "auto" and device_type not in FUSED_AUTO_DEVICES["adamw"]
    )


def step_moments(spec: RunSpec, step: StepBytes, *, mixed: bool, device_type: str) -> Moments:
    """The three moments of one optimizer step of `spec` on a rank holding `step` (see the module)."""
    accumulate = spec.train.grad_accum_steps > 1
    embedding, root, tied = _embedding_sizes(spec)
    compute = (
        2 if mixed and step.shard > 1 else FP32
    )  # the embedding's gradient in FSDP2's 16-bit parameters, or float32
    temporaries = (3 if tied else 1) * embedding * compute
    if step.shard > 1:  # FSDP2: the root's gradients are unsharded until its reduce-scatter, the last
        unsharded_root = root * FP32 if accumulate else (root - embedding) * compute
        end_grads = step.gradients - root * FP32 / step.shard + unsharded_root
        forward_grads = step.gradients * step.shard if accumulate else 0.0
    else:
        end_grads = step.gradients - (0.0 if accumulate else embedding * FP32)
        forward_grads = step.gradients if accumulate else 0.0
    forward = step.held + step.forward_buffers + step.activations + forward_grads
    end = step.held + step.backward_buffers + max(end_grads, 0.0) + temporaries
    update = step.held + step.gradients * (2 if _foreach_adamw(spec, device_type) else 1)
    build = build_bytes(spec, step)
    return Moments(activation_peak=forward, end_of_backward=end, optimizer_step=update, build=build)


def build_bytes(spec: RunSpec, step: StepBytes) -> float:
    """The build of a rank whose strategy splits the model: its kept weights, plus the whole float32 model of
    an eager build (and a tied head's first weight, dropped when tied) or one whole parameter of a meta-device
    build (launcher.components.model.meta_init); 0 where the rank keeps the whole model anyway."""
    if step.shard == 1 and spec.parallel.tp_size <= 1:
        return 0.0
    shape = model_shape(spec.model)
    cfg = shape.equivalent
    largest = max([vocab_size(cfg) * cfg.d_model, *(i * o for i, o in shape.block_linears.values())])
    p = spec
    if builds_on_meta(
        p.model, splits=True, quantization=p.quantization, qat=p.qat, prune=p.prune,
        precision=p.precision, objective=p.objective, memory=p.memory,
    ):  # fmt: skip
        return step.parameters + FP32 * largest
    return step.parameters + FP32 * (shape.num_params + largest * int(cfg.tie_embeddings))
