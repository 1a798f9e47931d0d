"""The `pp` strategy: pipeline stages on the outermost mesh dimension, FSDP2 and tensor parallel inside a stage.

Each rank holds one stage (gpipe, 1f1b) or several (interleaved_1f1b; zero_bubble, V-shaped) of
the model cut by launcher.parallel.pipeline_stage, and torch.distributed.pipelining's schedule runs
forward and backward over `pp_microbatches` pieces of every micro batch. Within a stage the data-
parallel ranks shard it with FSDP2 (parallel=pp_fsdp) and tensor parallelism splits its layers
(pp_tp_fsdp), both applied exactly as the fsdp and tp strategies apply them.

How the loop's contracts hold across stages:

- loss: the last stage sums token cross-entropy and divides by the step's trained tokens (the
  loop's normalizer), so pipeline micro batches and accumulation add up token-exactly; the
  schedule's own gradient scaling is off. Accumulation runs whole pipeline steps; FSDP2 reduces
  gradients at the end of each (torch's stage drives its sync flags).
- clipping: the norm is the global one, each stage's squared norm summed over the pipeline group
  (the tied embedding counted once), so every rank clips by the same factor.
- non-finite guard and fp16: the loss flag is agreed over the pipeline group; the sharded loss
  scaler all-reduces its overflow flag over every rank, so all stages skip together.
- checkpoints: DCP under the unwrapped model's names (stages keep them), so any stage split of
  the same model resumes it and `train-export` consolidates it like an fsdp checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from launcher.groups.checkpoint import load_tensor_file
from launcher.groups.checkpoint_files import CheckpointFiles
from launcher.groups.model.loss import lm_loss
from launcher.groups.model.shape import model_shape
from launcher.groups.optimizer import build_optimizer
from launcher.groups.precision import autocast, train_dtype
from launcher.parallel.dtensor import DCP_DIR, SCALER_FILE, make_sharded_scaler, sharded_optimizer_config
from launcher.parallel.dtensor import consolidate as consolidate
from launcher.parallel.fsdp import apply_fsdp, data_mesh
from launcher.parallel.guarded_step import guarded_step
from launcher.parallel.pipeline_split import rank_of_stage
from launcher.parallel.pipeline_stage import StagePlan, TiedCopies, local_tensor, plan_stages, tied_pair
from launcher.parallel.state_bytes import state_bytes
from launcher.parallel.strategy import Setup, StepResult

__all__ = ["PipelineStrategy", "build", "consolidate"]

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


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


class _NoTimer:
    """A phase timer that records nothing (the warm-up step is not the run's)."""

    def start(self, phase: str) -> None:
        """Ignore the phase."""


def _drop_part(key: str) -> str:
    """'0.blocks.1.w' -> 'blocks.1.w'; 'state.0.blocks.1.w.exp_avg' -> 'state.blocks.1.w.exp_avg'."""
    head, rest = key.split(".", 1)
    if head in ("state", "param_groups"):
        return f"{head}.{rest.split('.', 1)[1]}"
    return rest


class PipelineStrategy:
    """The loop's verbs over this rank's pipeline stages (`model` is the ModuleList of them)."""

    def __init__(self, parts: list[nn.Module], plan: StagePlan, setup: Setup, precision: _Precision) -> None:
        from torch.distributed.pipelining import PipelineStage

        spec, self.dist = setup.spec, setup.dist
        p = spec.parallel
        self.plan = plan
        self._precision = precision
        self.model = nn.ModuleList(parts)
        self.parts = parts
        device = self.dist.device
        self.pp_group = setup.mesh.get_group("pp")
        self.schedule_name = p.pp_schedule
        self.block = self.dist.world_size // self.dist.dims.pp
        self.hidden_size = model_shape(spec.model).equivalent.d_model
        self.scaler = make_sharded_scaler(spec.precision, device.type)
        if self.scaler is not None:  # only the last stage scales a loss: start every rank's scale alike
            self.scaler.scale(torch.zeros((), device=device))
        self.optimizer = build_optimizer(
            self.model, sharded_optimizer_config(setup, self.scaler), device.type
        )
        self.max_grad_norm = spec.train.max_grad_norm
        names = tied_pair(spec.model)
        self.tied = TiedCopies(parts, names, self.dist.dims, self.dist.rank) if names else None
        uncounted = self.tied.copies[len(self.tied.counted) :] if self.tied else []
        self._uncounted = {id(t) for t in uncounted}
        stages = [
            PipelineStage(part, index, plan.num_stages, device, group=self.pp_group)
            for part, index in zip(parts, plan.local, strict=True)
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
            self.forward_backward(batch, 1.0, train_dtype(setup.spec.precision), _NoTimer())
        for param in self.model.parameters():
            param.grad = None

    # ----- forward and backward -------------------------------------------------------------------
    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        token_loss_sum, _ = lm_loss(logits, labels)
        self._sums.append(token_loss_sum.detach())
        loss = token_loss_sum / self._normalizer
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def forward_backward(
        self, batch: dict[str, torch.Tensor], normalizer: torch.Tensor | float, dtype: torch.dtype, timer
    ) -> torch.Tensor:
        """One pipeline step over `batch`; the summed token loss on the last stage, zero elsewhere.

        Forward and backward interleave inside the schedule, so the step's time is all `forward`.
        """
        timer.start("forward")
        self._normalizer, self._sums = normalizer, []
        self._precision.dtype = dtype
        kwargs = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
        self.schedule.step(batch["input_ids"], target=batch["labels"], **kwargs)
        if not self._sums:
            return torch.zeros((), device=self.dist.device)
        return torch.stack(self._sums).sum()

    def _stage_rank(self, stage: int) -> int:
        """The global rank holding `stage` in this rank's data x tensor coordinate."""
        pp_rank = rank_of_stage(stage, self.dist.dims.pp, self.schedule_name)
        return pp_rank * self.block + self.dist.rank % self.block

    @torch.no_grad()
    def eval_loss(
        self, batch: dict[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
                return lm_loss(out, batch["labels"])
            hidden = out.float().contiguous()
            if self._stage_rank(stage + 1) != self.dist.rank:
                dist.send(hidden, dst=self._stage_rank(stage + 1))
        zero = torch.zeros((), device=ids.device)
        return zero, zero

    # ----- the optimizer step ---------------------------------------------------------------------
    def no_sync(self) -> contextlib.AbstractContextManager:
        """Nothing to defer: the schedule reduces a stage's gradients at the end of each pipeline step."""
        return contextlib.nullcontext()

    def _clip(self, params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
        """Clip by the norm of every stage's gradients together (the tied matrix once); returns that norm."""
        grads = [p.grad for p in params]
        counted = [p.grad for p in params if id(p) not in self._uncounted]
        norm = torch.nn.utils.get_total_norm(counted, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = norm.to(torch.float32) ** 2
        dist.all_reduce(squared, group=self.pp_group)
        total = squared.sqrt()
        if max_norm is not None:
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
            for grad in grads:
                local_tensor(grad).mul_(coef.to(grad.dtype))
        return total

    def step(self, *, loss_ok: torch.Tensor) -> StepResult:
        """Add the tied copies' gradients, agree on the loss flag, clip globally and step, never with non-finite values."""
        if self.tied is not None:
            self.tied.sync_grads()
        agreed = loss_ok.to(torch.int32)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.pp_group)
        return guarded_step(
            self.model.parameters(),
            self.optimizer,
            self.scaler,
            max_grad_norm=self.max_grad_norm,
            loss_ok=agreed.bool(),
            clip=self._clip,
        )

    def loss_scale(self) -> float | None:
        """The fp16 loss scale (the same on every rank: overflow flags are all-reduced)."""
        return float(self.scaler.get_scale()) if self.scaler else None

    def state_bytes(self) -> dict[str, int]:
        """This rank's stages: parameters, gradients and optimizer state (local shards under FSDP2)."""
        return state_bytes(self.model, self.optimizer)

    # ----- checkpoints ----------------------------------------------------------------------------
    def _state(self) -> tuple[dict, dict, dict[str, str]]:
        """Model and optimizer state under the unwrapped model's names, and those names' part-prefixed originals."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=_OPTIONS)
        names = {_drop_part(k): k for k in (*model_state, *optim_state)}
        return (
            {_drop_part(k): v for k, v in model_state.items()},
            {_drop_part(k): v for k, v in optim_state.items()},
            names,
        )

    def save(self, out: CheckpointFiles) -> None:
        """Every rank writes its stages' shards into `dcp/` under the whole model's names."""
        model_state, optim_state, _ = self._state()
        dcp_dir = out.directory / DCP_DIR
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=dcp_dir)
        out.adopt(dcp_dir.glob(f"__{self.dist.rank}_*.distcp"))
        if self.scaler is not None and self.dist.is_main:
            out.save(self.scaler.state_dict(), SCALER_FILE)

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote; any stage split of the same model reads it (names are the model's)."""
        model_state, optim_state, names = self._state()
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=directory / DCP_DIR)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict={names[k]: v for k, v in state["model"].items()},
            optim_state_dict={names[k]: v for k, v in state["optim"].items()},
            options=_OPTIONS,
        )
        if self.scaler is not None:
            self.scaler.load_state_dict(load_tensor_file(directory / SCALER_FILE))

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state dict on rank 0 (every stage's, gathered; CPU tensors); empty elsewhere. Collective."""
        own = {
            _drop_part(k): v.cpu()
            for k, v in get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True)
            ).items()
        }
        gathered: list[dict | None] = [None] * self.dist.world_size if self.dist.is_main else []
        dist.gather_object(own, gathered if self.dist.is_main else None, dst=0)
        full: dict[str, torch.Tensor] = {}
        for part in gathered:
            full.update(part or {})
        return full


def _prepare(parts: list[nn.Module], setup: Setup) -> list[nn.Module]:
    """Move the stages to the device and shard each with FSDP2 over the data-parallel ranks (dp > 1)."""
    dist, spec = setup.dist, setup.spec
    parts = [part.to(dist.device) for part in parts]
    if dist.dims.dp_size > 1:
        mesh = data_mesh(setup.mesh, dist.dims.replicate)
        parts = [
            apply_fsdp(
                part,
                mesh,
                parallel=spec.parallel,
                precision=spec.precision,
                pin_memory=dist.device.type == "cuda",
            )
            for part in parts
        ]
    return parts


def build(model: nn.Module, setup: Setup) -> PipelineStrategy:
    """Registry entry point: `model` is the ModuleList of this rank's stages (launcher.rank.build cut them)."""
    if setup.mesh is None:
        raise ValueError("strategy pp needs the run's device mesh (launcher.parallel.dims builds it).")
    dist, spec = setup.dist, setup.spec
    plan = plan_stages(spec.model, spec.parallel, spec.data.seq_len, dist.dims.pp_rank(dist.rank))
    precision = _Precision(dist.device.type)
    parts = _prepare(list(model), setup)
    for part in parts:
        precision.wrap(part)
    return PipelineStrategy(parts, plan, setup, precision)
