"""The pipeline runner: this rank's stages under a torch.distributed.pipelining schedule, called by the loop per step.

Pipeline parallel is an axis (parallel.pp_size), not a strategy: the stages are cut by
launcher.parallel.pipeline_stage (the one plan, from launcher.parallel.dims), each is parallelized
like a whole model (tensor parallel, checkpointing, compile, then the data-parallel wrap: FSDP2,
DDP over the ranks holding the same stage, or none), and launcher.parallel.parts steps, clips and
saves them. This runner only runs forward and backward: each rank holds one stage (gpipe, 1f1b) or
several (interleaved_1f1b; zero_bubble, V-shaped), and the schedule runs them over
`pp_microbatches` pieces of every micro batch.

How the loop's contracts hold across stages:

- loss: the last stage asks the run's objective for the summed loss and divides by the step's
  trained tokens (the loop's normalizer), so pipeline micro batches and accumulation add up
  token-exactly; the schedule's own gradient scaling is off. MoE blocks' auxiliary losses are added by
  the stage holding them (launcher.parallel.pipeline_aux). Accumulation runs whole pipeline steps;
  FSDP2 and DDP reduce gradients at the end of each (torch's stage drives their sync flags).
- clipping, the non-finite guard, fp16 and checkpoints: launcher.parallel.parts (the global norm
  over the pipeline group, the tied embedding once; DCP under the whole model's names).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from launcher.components.metrics import PhaseTimer
from launcher.components.model.moe_balance import moe_blocks
from launcher.components.model.shape import model_shape
from launcher.components.objectives import Objective
from launcher.components.precision import autocast
from launcher.parallel.parts import PartsStrategy
from launcher.parallel.pipeline_aux import StageAuxiliary
from launcher.parallel.pipeline_split import rank_of_stage
from launcher.parallel.pipeline_stage import StagePlan
from launcher.parallel.runner import Batch
from launcher.parallel.strategy import Setup

__all__ = ["PipelineRunner"]


def _schedule_class(name: str) -> type:
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    return {
        "gpipe": ScheduleGPipe,
        "1f1b": Schedule1F1B,
        "interleaved_1f1b": ScheduleInterleaved1F1B,
        "zero_bubble": ScheduleZBVZeroBubble,
    }[name]


def _static_shapes(setup: Setup, wrap: str, stage: int, num_stages: int) -> dict[str, torch.Tensor]:
    """A stage's example input and output, for a fake process group (dry_run=simulate), where nothing is received.

    On a real group torch infers them by running the first step and sending each stage's output
    metadata to the next; the fake group delivers nothing, so the stage is told them: a pipeline
    micro batch of token ids into the first stage, of hidden states between stages (in FSDP2's
    compute dtype under its mixed precision, else the float32 residual stream), of logits out of
    the last.
    """
    spec, device = setup.spec, setup.dist.device
    rows, seq = setup.batch.micro_batch_size // spec.parallel.pp_microbatches, spec.data.seq_len
    shape = model_shape(spec.model).equivalent
    policy = None
    if wrap == "fsdp":
        from launcher.parallel.fsdp import mixed_precision_policy

        policy = mixed_precision_policy(spec.precision)
    hidden_dtype = policy.param_dtype if policy is not None else torch.float32
    logits_dtype = hidden_dtype if policy is not None else setup.dtype

    def hidden() -> torch.Tensor:
        return torch.empty(rows, seq, shape.d_model, dtype=hidden_dtype, device=device, requires_grad=True)

    first = torch.empty(rows, seq, dtype=torch.long, device=device)
    last = torch.empty(rows, seq, shape.vocab_size, dtype=logits_dtype, device=device, requires_grad=True)
    return {
        "input_args": first if stage == 0 else hidden(),
        "output_args": last if stage == num_stages - 1 else hidden(),
    }


class _Precision:
    """The autocast dtype the stages' forwards run under (training's, or evaluation's while evaluating)."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.dtype = torch.float32

    def wrap(self, module: nn.Module) -> None:
        """Run `module`'s forward under autocast to the current dtype (the schedule calls it, not the loop)."""
        forward = module.forward

        @functools.wraps(forward)
        def cast(*args: object, **kwargs: object) -> object:
            with autocast(self.dtype, self.device_type):
                return forward(*args, **kwargs)

        module.forward = cast


def _match_grad_layouts(model: nn.Module) -> None:
    """Give each DTensor gradient its parameter's layout.

    Through the schedule's backward the last stage's vocabulary-split head gets its gradient
    replicated (equal values, the whole matrix on every rank) where its weight is sharded; the
    optimizer, clipping and the tied copies' sum (on local shards) want the weight's layout.
    """
    for param in model.parameters():
        grad, want = param.grad, getattr(param, "placements", None)
        if grad is not None and want is not None and getattr(grad, "placements", None) not in (None, want):
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def _reduce_at_the_last_backward_only(part: nn.Module) -> None:
    """Let torch's stage alone arm a DDP stage's gradient reduction, at a step's last backward.

    DDP's forward arms its reducer for the next backward unless gradient sync is off. A schedule
    runs several micro batches' forwards before their backwards, and torch's stage runs every
    backward but the last under `no_sync` and arms the reducer itself before the last one: with
    the forwards armed as well, the first step's bucket rebuild saw each parameter once per micro
    batch and DDP's reducer failed ("rebuilt parameter indices size is not same as original model
    parameters size"). With sync off in forward, gradients accumulate locally and are reduced once.
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(part, DistributedDataParallel):
        part.require_backward_grad_sync = False


class _NoTimer:
    """A phase timer that records nothing (the warm-up step is not the run's)."""

    def start(self, phase: str) -> None:
        """Ignore the phase."""


class PipelineRunner:
    """forward_backward and eval_loss over this rank's stages (the strategy's parts), through the schedule."""

    def __init__(self, strategy: PartsStrategy, plan: StagePlan, setup: Setup, objective: Objective) -> None:
        from torch.distributed.pipelining import PipelineStage

        spec, self.dist = setup.spec, setup.dist
        p = spec.parallel
        self.plan, self.objective, self.scaler = plan, objective, strategy.scaler
        self.parts = strategy.parts
        self.model, self.pp_group = strategy.model, strategy.pp_group
        self._precision = _Precision(self.dist.device.type)
        for part in self.parts:
            self._precision.wrap(part)
            _reduce_at_the_last_backward_only(part)
        # MoE blocks: each stage adds its own auxiliary losses (the last stage's objective sees only its own)
        self._aux = StageAuxiliary(self.parts, self.scaler) if spec.model.moe.num_experts else None
        device = self.dist.device
        self.schedule_name = p.pp_schedule
        self.block = self.dist.world_size // self.dist.dims.pp
        self.hidden_size = model_shape(spec.model).equivalent.d_model
        simulated = dist.get_backend(strategy.pp_group) == "fake"
        stages = [
            PipelineStage(
                part,
                index,
                plan.num_stages,
                device,
                group=strategy.pp_group,
                **(_static_shapes(setup, strategy.wrap, index, plan.num_stages) if simulated else {}),
            )
            for part, index in zip(self.parts, plan.local, strict=True)
        ]
        kwargs = {"n_microbatches": p.pp_microbatches, "loss_fn": self._loss, "scale_grads": False}
        cls = _schedule_class(p.pp_schedule)
        self.schedule = cls(stages[0], **kwargs) if len(stages) == 1 else cls(stages, **kwargs)
        self._normalizer: torch.Tensor | float = 1.0
        self._sums: list[torch.Tensor] = []
        self._warm_up(setup)

    def _warm_up(self, setup: Setup) -> None:
        """Run one throwaway pipeline step so torch infers the stages' shapes, then forget its effects.

        torch's first step infers the tensors passed between stages by running a forward and
        backward on placeholder values, whose gradients it clears only from FSDP2 modules; here
        it runs on zero tokens before training, under a forked RNG, and every gradient is dropped,
        so the first real step starts clean and the random streams are untouched.
        """
        shape = (setup.batch.micro_batch_size, setup.spec.data.seq_len)
        ids = torch.zeros(shape, dtype=torch.long, device=self.dist.device)
        batch = {"input_ids": ids, "labels": ids}
        if setup.spec.data.packing and setup.spec.data.document_mask:
            batch["position_ids"] = torch.arange(shape[1], device=ids.device).expand(shape).contiguous()
        device = self.dist.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            self.forward_backward(batch, 1.0, setup.dtype, _NoTimer())
        for param in self.model.parameters():
            param.grad = None
        for part in self.parts:  # the MoE blocks' routing record starts with the first real step
            for block in moe_blocks(part).values():
                block.reset_interval()

    # ----- forward and backward -------------------------------------------------------------------
    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        token_loss_sum, _ = self.objective.loss_sum(logits, {"labels": labels})
        self._sums.append(token_loss_sum.detach())
        loss = token_loss_sum / self._normalizer
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def forward_backward(
        self, batch: Batch, normalizer: torch.Tensor | float, dtype: torch.dtype, timer: PhaseTimer
    ) -> torch.Tensor:
        """One pipeline step over `batch`; the summed token loss on the last stage, zero elsewhere.

        Forward and backward interleave inside the schedule, so the step's time is all `forward`.
        """
        timer.start("forward")
        self._normalizer, self._sums = normalizer, []
        self._precision.dtype = dtype
        kwargs = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
        if self._aux is not None:
            kwargs |= self._aux.begin(batch, normalizer)
        self.schedule.step(batch["input_ids"], target=batch["labels"], **kwargs)
        _match_grad_layouts(self.model)
        aux = self._aux.total(self.pp_group, self.dist.device) if self._aux is not None else None
        if not self._sums:
            return torch.zeros((), device=self.dist.device)
        loss_sum = torch.stack(self._sums).sum()
        return loss_sum if aux is None else loss_sum + aux

    def _stage_rank(self, stage: int) -> int:
        """The global rank holding `stage` in this rank's data x tensor coordinate."""
        pp_rank = rank_of_stage(stage, self.dist.dims.pp, self.schedule_name)
        return pp_rank * self.block + self.dist.rank % self.block

    @torch.no_grad()
    def eval_loss(self, batch: Batch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed token loss, tokens) of `batch`, passed stage by stage (whole, not in micro batches)."""
        self._precision.dtype = dtype
        kwargs = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
        ids, last = batch["input_ids"], self.plan.num_stages - 1
        hidden: torch.Tensor | None = None
        for stage in range(self.plan.num_stages):
            if stage not in self.plan.local:
                continue
            part = self.parts[self.plan.local.index(stage)]
            if stage > 0 and self._stage_rank(stage - 1) != self.dist.rank:
                hidden = torch.empty(*ids.shape, self.hidden_size, dtype=torch.float32, device=ids.device)
                dist.recv(hidden, src=self._stage_rank(stage - 1))
            out = part(ids if stage == 0 else hidden, **kwargs)
            if stage == last:
                return self.objective.loss_sum(out, {"labels": batch["labels"]}, train=False)
            hidden = out.float().contiguous()
            if self._stage_rank(stage + 1) != self.dist.rank:
                dist.send(hidden, dst=self._stage_rank(stage + 1))
        zero = torch.zeros((), device=ids.device)
        return zero, zero
