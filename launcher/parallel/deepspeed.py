"""The `deepspeed` strategy: ZeRO stages 0-3 (and CPU offload) through DeepSpeed's engine.

The DeepSpeed config comes from the spec (launcher.parallel.deepspeed_config). The optimizer is the
optimizer group's own torch optimizer (a client optimizer: nothing is JIT-compiled, and it matches
the single strategy), except with optimizer offload, where AdamW runs as DeepSpeedCPUAdam. The
training loop keeps driving: it normalizes the loss by the tokens of the whole accumulation cycle
(so DeepSpeed must not divide by the accumulation steps again), marks the last micro batch (the
accumulation boundary, where ZeRO 0/1 reduce gradients and the optimizer steps) and steps its own
LR schedule over `strategy.optimizer` (DeepSpeed gets no scheduler).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from launcher.components import quiet
from launcher.components.adapters import check_loaded_keys, frozen_keys, has_adapters
from launcher.components.checkpoint_files import CheckpointFiles
from launcher.components.files.safe_load import weights_refusal
from launcher.components.optimizer import build_optimizer, param_groups
from launcher.parallel import deepspeed_user_config
from launcher.parallel.checkpoint_layout import TAG
from launcher.parallel.state_bytes import optimizer_state_bytes
from launcher.parallel.strategy import Setup, StepResult

if TYPE_CHECKING:
    from launcher.components.batch_split import BatchSplit

MODULE_FILE = "mp_rank_00_model_states.pt"
"""DeepSpeed's file of the module state (and, at stage 0, the whole fp32 model); ZeRO-3 prefixes it per rank."""


def accelerator_env(device_type: str) -> dict[str, str]:
    """The environment a rank sets before DeepSpeed is imported: DeepSpeed picks its accelerator once,
    at import, from DS_ACCELERATOR, so naming it keeps a CPU run on a GPU machine on the CPU.
    (launcher.rank.worker applies it when the process starts; the strategy changes no variable.)"""
    return {"DS_ACCELERATOR": "cuda" if device_type == "cuda" else "cpu"}


def _import_deepspeed():  # noqa: ANN202 - the deepspeed module
    """Import DeepSpeed minus the CPU inference op, quiet.

    Its shared-memory all-reduce op (`deepspeed_shm_comm`) serves only the inference kernels
    (training reduces through the torch process group), yet would be JIT-compiled at every init on
    a CPU (26-28 s the first time): marking it incompatible skips that build.
    """
    import deepspeed
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed's ZeRO calls torch's older all-gather name on every step; the warning says nothing to a user.
    warnings.filterwarnings(
        "ignore", message=".*all_gather_into_tensor` is deprecated", category=FutureWarning
    )
    return deepspeed


def client_optimizer(model: nn.Module, setup: Setup) -> torch.optim.Optimizer:
    """The optimizer DeepSpeed wraps: the optimizer group's, or DeepSpeedCPUAdam for offloaded AdamW."""
    spec = setup.spec
    o = spec.optimizer
    if spec.parallel.offload_optimizer and o.name == "adamw":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        groups = param_groups(model.named_parameters(), o)
        return DeepSpeedCPUAdam(
            groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, adamw_mode=True
        )
    # Offloaded optimizer state lives on the CPU: pick the CPU kernels for it.
    device_type = "cpu" if spec.parallel.offload_optimizer else setup.dist.device.type
    return build_optimizer(model, o, device_type)


_FORCE_ON, _FORCE_OFF = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


@contextlib.contextmanager
def weights_only_loads(folder: Path) -> Iterator[None]:
    """Make DeepSpeed's checkpoint reads (of the files in `folder`) weights_only, allowing just its own plain record types.

    DeepSpeed calls torch.load(weights_only=False); torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD turns
    those calls into weights_only loads, which execute no code from the file (a user's
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set aside meanwhile). Its optimizer files hold a few
    DeepSpeed records (loss scaler, ZeRO stage enum, fragment addresses), allowed here. A file
    the reader refuses comes out as RefusedFile naming it.
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    previous = {name: os.environ.pop(name, None) for name in (_FORCE_ON, _FORCE_OFF)}
    os.environ[_FORCE_ON] = "1"
    try:
        with torch.serialization.safe_globals(
            [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
        ):
            try:
                yield
            except pickle.UnpicklingError as err:
                refused = weights_refusal(err, sorted(Path(folder).rglob("*.pt")), folder)
                if refused is None:
                    raise
                raise refused from None
    finally:
        os.environ.pop(_FORCE_ON, None)
        os.environ.update({name: value for name, value in previous.items() if value is not None})


class DeepSpeedStrategy:
    """ZeRO 0-3 through a DeepSpeed engine, driven by the launcher's loop (the one backend owning its engine)."""

    def __init__(self, model: nn.Module, setup: Setup) -> None:
        device, spec = setup.dist.device, setup.spec
        self.deepspeed = _import_deepspeed()
        # The process group exists already (launcher.parallel.dims): DeepSpeed adopts it.
        self.deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
        self.config, errors = deepspeed_user_config.resolve(spec, setup.dist.world_size, batch=setup.batch)
        if errors:  # checked before launch; a file edited since then is caught here
            raise ValueError("; ".join(str(e) for e in errors))
        self._config_file = (
            Path(spec.run_dir) / "deepspeed_config.json" if setup.dist.is_main and spec.run_dir else None
        )
        self._write_config()
        self.optimizer = client_optimizer(model, setup)
        self.engine, *_ = self.deepspeed.initialize(model=model, optimizer=self.optimizer, config=self.config)
        self.model = self.engine
        self.stage = self.engine.zero_optimization_stage()
        self.fp16 = self.engine.fp16_enabled()
        # Only fp32 stage 0 steps the bare client optimizer; every other setup steps through a
        # DeepSpeed wrapper that checks the gradient norm and skips a non-finite step itself.
        self.guard_here = self.stage == 0 and not (self.fp16 or self.engine.bfloat16_enabled())
        self.world_size, self.rank = setup.dist.world_size, setup.dist.rank
        self.adapters = has_adapters(model)
        if self.adapters:
            _module_state_without_frozen(self.engine)
        self._boundary = True
        self._loss_ok = torch.ones((), dtype=torch.bool, device=device)

    def use_batch(self, batch: BatchSplit) -> None:
        """Take the micro-batch search's split (same per-rank batch) into the engine's config, and drop what its
        tries left: their gradient partitions (a try's backward is a boundary's) and accumulation count."""
        global_batch = batch.micro_batch_size * batch.grad_accum_steps * self.engine.dp_world_size
        self.engine.set_train_micro_batch_size(batch.micro_batch_size)
        self.engine.set_train_batch_size(global_batch)
        self.engine.optimizer.zero_grad(set_to_none=True)
        self.engine.zero_grad()
        self.config.update(
            train_micro_batch_size_per_gpu=batch.micro_batch_size,
            gradient_accumulation_steps=batch.grad_accum_steps,
            train_batch_size=global_batch,
        )
        self._write_config()

    def _write_config(self) -> None:
        """The config the engine runs, as deepspeed_config.json in the run directory (rank 0)."""
        if self._config_file is not None:
            self._config_file.write_text(json.dumps(self.config, indent=1) + "\n")

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Mark the micro batches inside as not the accumulation boundary (no ZeRO 0/1 reduction)."""
        return self._not_boundary()

    @contextlib.contextmanager
    def _not_boundary(self) -> Iterator[None]:
        self._boundary = False
        try:
            yield
        finally:
            self._boundary = True

    def backward(self, loss: torch.Tensor) -> None:
        """Backward through DeepSpeed, unscaled by accumulation steps (the loop already normalized).

        On the boundary, a non-finite loss on any rank turns this backward's gradients into NaN on
        every rank, so that every rank skips the step together (DeepSpeed's overflow check, or
        this strategy's for fp32 stage 0) and no update ever sees a non-finite loss.
        """
        self._loss_ok &= torch.isfinite(loss.detach())
        self.engine.set_gradient_accumulation_boundary(self._boundary)
        if self._boundary:
            ok = self._loss_ok.to(torch.int32)
            if self.world_size > 1:
                dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            self._loss_ok = ok.bool()
            loss = loss * torch.where(self._loss_ok, 1.0, float("nan")).to(loss.dtype)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, *, loss_ok: torch.Tensor) -> StepResult:
        """DeepSpeed's step, clipping to train.max_grad_norm (its `gradient_clipping`, set from the spec),
        skipped on every rank when a loss or a gradient is not finite (train.on_nonfinite then applies
        exactly as for the other strategies)."""
        norm = None
        if self.guard_here:  # gradients are all-reduced on every rank by now
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
            if not bool(torch.isfinite(norm)):
                self.engine.zero_grad()  # no gradients: the optimizer step leaves every weight as is
        self.engine.step()
        loss_ok_all = self._loss_ok & loss_ok.to(self._loss_ok.device)
        self._loss_ok = torch.ones_like(self._loss_ok)
        skipped = not self.engine.was_step_applied() or (norm is not None and not bool(torch.isfinite(norm)))
        if norm is None:
            value = self.engine.get_global_grad_norm()
            norm = torch.as_tensor(float("inf") if value is None and skipped else (value or 0.0))
        norm = norm.detach().float().reshape(())  # stays on the device until a log step reads it
        if self.fp16:  # the loss scaler skipped it: an overflow, unless a loss was non-finite
            return StepResult(norm, nonfinite=~loss_ok_all, overflow=loss_ok_all & skipped)
        return StepResult(norm, nonfinite=torch.as_tensor(skipped) | ~loss_ok_all, overflow=False)

    def loss_scale(self) -> float | None:
        """DeepSpeed's fp16 loss scale; None without fp16."""
        if not self.fp16:
            return None
        scale = getattr(self.engine.optimizer, "loss_scale", None)
        if scale is None:
            scale = getattr(self.engine.optimizer, "cur_scale", None)
        return float(scale) if scale is not None else None

    def state_bytes(self) -> dict[str, int]:
        """This rank's share of parameters, gradients and optimizer state (fp32 masters included), as ZeRO partitions them."""
        params = list(self.engine.module.parameters())
        local = [getattr(p, "ds_tensor", p) for p in params]  # ZeRO-3 keeps only a partition per rank
        full_grads = sum(
            getattr(p, "ds_numel", p.numel()) * p.element_size() for p in params if p.requires_grad
        )
        module_ids = {id(p) for p in params}
        masters = [t for g in self.optimizer.param_groups for t in g["params"] if id(t) not in module_ids]
        # ZeRO-3 hands its fp32 partitions to the optimizer only while it steps.
        masters += list(getattr(self.engine.optimizer, "fp32_partitioned_groups_flat", []))
        return {
            "param_bytes": sum(t.numel() * t.element_size() for t in local),
            "grad_bytes": full_grads // self.world_size if self.stage >= 2 else full_grads,
            "optimizer_bytes": optimizer_state_bytes(self.optimizer)
            + sum(t.numel() * t.element_size() for t in masters),
        }

    def save(self, out: CheckpointFiles) -> None:
        """Every rank writes its part through DeepSpeed (it synchronizes); DeepSpeed's `latest` file is not written.

        DeepSpeed names a rank's partitions `*zero_pp_rank_<R>_*`; each rank hashes its own, rank 0's
        manifest adds the shared files (the module states, DeepSpeed's recovery script). With adapters
        the frozen base is left out (`exclude_frozen_parameters`): it is rebuilt from the spec.
        """
        self.engine.save_checkpoint(
            str(out.directory), tag=TAG, client_state={}, save_latest=False,
            exclude_frozen_parameters=self.adapters,
        )  # fmt: skip
        out.adopt((out.directory / TAG).glob(f"*pp_rank_{self.rank}_*"))

    def load(self, directory: Path) -> None:
        """Restore model, optimizer, loss scaler and DeepSpeed's counters, with weights_only reads.

        An adapter checkpoint lacks the frozen base: its module keys are checked to be exactly the
        trainable ones before DeepSpeed loads it non-strictly.
        """
        with weights_only_loads(Path(directory) / TAG):
            if self.adapters:
                saved = torch.load(module_states_file(directory), map_location="cpu", weights_only=True)[
                    "module"
                ]
                check_loaded_keys(self.engine.module, saved)
            path, _ = self.engine.load_checkpoint(
                str(directory), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False,
                load_module_strict=not self.adapters,
            )  # fmt: skip
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {directory / TAG}")

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state dict (ZeRO-3 gathers the shards: every rank must call this)."""
        module = self.engine.module
        if self.stage < 3:
            return {k: v.detach().clone() for k, v in module.state_dict().items()}
        with self.deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _module_state_without_frozen(engine: object) -> None:
    """Make `engine.save_checkpoint(exclude_frozen_parameters=True)` keep only the trainable parameters.

    DeepSpeed drops frozen parameters by their first name only, so a tied alias (the output head
    sharing the token embedding) and bitsandbytes' quantization statistics would stay in the module
    file; the same filter as every other strategy's (adapters.frozen_keys) leaves out all of them.
    """
    full = engine.module_state_dict

    def module_state_dict(*args: object, exclude_frozen_parameters: bool = False, **kwargs: object) -> dict:
        state = full(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        if exclude_frozen_parameters:
            for key in frozen_keys(engine.module) & set(state):
                del state[key]
        return state

    engine.module_state_dict = module_state_dict


def module_states_file(directory: Path) -> Path:
    """The file with the module's state-dict keys in a checkpoint (rank 0's, under ZeRO-3)."""
    files = sorted((Path(directory) / TAG).glob(f"*{MODULE_FILE}"))
    if not files:
        raise FileNotFoundError(f"no DeepSpeed module states under {Path(directory) / TAG}")
    return files[0]


def build(parts: list[nn.Module], setup: Setup) -> DeepSpeedStrategy:
    """Registry entry point: the engine wraps the one whole model (a pipeline is refused by the rules)."""
    (model,) = parts
    return DeepSpeedStrategy(model, setup)


def consolidate(directory: Path) -> dict[str, torch.Tensor]:
    """The fp32 model state dict of a checkpoint written by this strategy (offline, one process).

    ZeRO 1-3 (and bf16) checkpoints hold fp32 master weights in the optimizer shards, merged by
    DeepSpeed's zero_to_fp32; a fp32 stage 0 checkpoint holds the whole module in one file. An
    adapter run's checkpoint yields only the trainable parameters (adapters.load_checkpoint_state).
    """
    from launcher.components.checkpoint import load_tensor_file

    files = Path(directory) / TAG
    if any(files.glob("*zero_pp_rank_*_optim_states.pt")):
        _import_deepspeed()  # reads files only: any accelerator will do
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with weights_only_loads(files), quiet.held_prints(quiet.DEEPSPEED_CONSOLIDATION):
            state = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=TAG)
        return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    return load_tensor_file(files / MODULE_FILE)["module"]
