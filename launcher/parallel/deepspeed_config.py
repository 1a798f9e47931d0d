"""The DeepSpeed JSON a run's spec describes: every key the spec decides, and the defaults it adds.

The spec stays the one source of truth. Every DeepSpeed key that the spec also decides (batch,
accumulation, clipping, ZeRO stage and offload, precision, loss scaling, the optimizer) is derived
from it here (`derived`), and `generate` writes them as DeepSpeed's JSON, adding the communication
defaults of ZeRO-1/2 (overlap_comm, contiguous_gradients, buckets sized from the model's width). A
user's file (`parallel.deepspeed_config=PATH`) is checked against the spec and merged over this
config by launcher.parallel.deepspeed_user_config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from launcher.components.batch_split import BatchSplit
from launcher.components.model.shape import model_shape
from launcher.spec import RunSpec

AUTO = "auto"
"""A value in a user's JSON that the spec fills."""


@dataclass(frozen=True, kw_only=True)
class Derived:
    """One DeepSpeed key whose value the spec decides."""

    json_key: str
    """Dotted path in the DeepSpeed JSON."""
    spec_key: str
    """The spec key (or keys) deciding it."""
    value: Any
    """The value the spec gives it."""
    note: str = ""
    """Said after a contradiction, e.g. which modern key a legacy one stands for."""


def loss_scale_power(spec: RunSpec) -> int | None:
    """log2 of precision.loss_scale_init when it is a power of two (DeepSpeed takes the exponent)."""
    init = spec.precision.loss_scale_init
    power = round(math.log2(init)) if init > 0 else None
    return power if power is not None and 2.0**power == init else None


def derived(spec: RunSpec, ranks: int | None = None, batch: BatchSplit | None = None) -> list[Derived]:
    """Every DeepSpeed key the spec decides, with its value.

    `ranks` is the job's actual world size, `batch` the split the build chose (the micro-batch
    search may choose another split of the spec's per-rank batch); both default to the spec's.
    """
    t, p, pr, o = spec.train, spec.parallel, spec.precision, spec.optimizer
    ranks = ranks or spec.launcher.world_size
    batch = batch or BatchSplit(micro_batch_size=t.micro_batch_size, grad_accum_steps=t.grad_accum_steps)
    keys = [
        Derived(
            json_key="train_micro_batch_size_per_gpu",
            spec_key="train.micro_batch_size",
            value=batch.micro_batch_size,
        ),
        Derived(
            json_key="gradient_accumulation_steps",
            spec_key="train.grad_accum_steps",
            value=batch.grad_accum_steps,
        ),
        Derived(
            json_key="train_batch_size",
            spec_key="train.micro_batch_size x train.grad_accum_steps x launcher.nproc x launcher.nnodes",
            value=batch.micro_batch_size * batch.grad_accum_steps * ranks,
        ),
        Derived(json_key="gradient_clipping", spec_key="train.max_grad_norm", value=t.max_grad_norm or 0.0),
        Derived(json_key="zero_optimization.stage", spec_key="parallel.zero_stage", value=p.zero_stage),
        Derived(
            json_key="zero_optimization.offload_optimizer.device",
            spec_key="parallel.offload_optimizer",
            value="cpu" if p.offload_optimizer else "none",
        ),
        Derived(
            json_key="zero_optimization.offload_param.device",
            spec_key="parallel.offload_params",
            value="cpu" if p.offload_params else "none",
        ),
        Derived(
            json_key="zero_optimization.cpu_offload",
            spec_key="parallel.offload_optimizer",
            value=p.offload_optimizer,
            note="(cpu_offload is the legacy form of zero_optimization.offload_optimizer.device=cpu)",
        ),
        Derived(
            json_key="zero_optimization.cpu_offload_param",
            spec_key="parallel.offload_params",
            value=p.offload_params,
            note="(cpu_offload_param is the legacy form of zero_optimization.offload_param.device=cpu)",
        ),
        Derived(json_key="bf16.enabled", spec_key="precision.bf16", value=pr.bf16),
        Derived(json_key="bfloat16.enabled", spec_key="precision.bf16", value=pr.bf16),
        Derived(json_key="fp16.enabled", spec_key="precision.fp16", value=pr.fp16),
        Derived(
            json_key="fp16.initial_scale_power",
            spec_key="precision.loss_scale_init",
            value=loss_scale_power(spec),
        ),
        Derived(
            json_key="fp16.loss_scale_window",
            spec_key="precision.loss_scale_growth_interval",
            value=pr.loss_scale_growth_interval,
        ),
        Derived(json_key="optimizer.params.lr", spec_key="optimizer.lr", value=o.lr),
        Derived(
            json_key="optimizer.params.weight_decay", spec_key="optimizer.weight_decay", value=o.weight_decay
        ),
    ]
    if o.name == "sgd":
        keys.append(
            Derived(json_key="optimizer.params.momentum", spec_key="optimizer.momentum", value=o.momentum)
        )
    else:
        keys.append(Derived(json_key="optimizer.params.eps", spec_key="optimizer.eps", value=o.eps))
        keys.append(
            Derived(json_key="optimizer.params.betas", spec_key="optimizer.betas", value=list(o.betas))
        )
    return keys


def generate(spec: RunSpec, ranks: int | None = None, batch: BatchSplit | None = None) -> dict[str, Any]:
    """The DeepSpeed config the spec alone describes."""
    p, pr = spec.parallel, spec.precision
    zero: dict[str, Any] = {"stage": p.zero_stage}
    if p.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if p.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    if p.zero_stage in (1, 2):
        # Reduce gradients while the backward pass still runs, into one contiguous buffer, in buckets
        # sized from the model (DeepSpeed's 5e8-element defaults suit no small model). ZeRO-3 overlaps
        # by default. A user's JSON value wins over each of these.
        sizes = bucket_sizes(spec)
        zero["overlap_comm"] = zero["contiguous_gradients"] = True
        zero["reduce_bucket_size"] = sizes["zero_optimization.reduce_bucket_size"]
        zero["allgather_bucket_size"] = sizes["zero_optimization.allgather_bucket_size"]
    values = {d.json_key: d.value for d in derived(spec, ranks, batch)}
    config: dict[str, Any] = {
        key: values[key]
        for key in (
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "train_batch_size",
            "gradient_clipping",
        )
    }
    config["zero_optimization"] = zero
    config["bf16"] = {"enabled": pr.bf16}
    if pr.fp16:
        # hysteresis 1: every overflow halves the scale at once, as torch's GradScaler does.
        config["fp16"] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": values["fp16.initial_scale_power"],
            "loss_scale_window": pr.loss_scale_growth_interval,
            "hysteresis": 1,
            "consecutive_hysteresis": False,
            "min_loss_scale": 1,
        }
    # The client optimizer (torch's, built from the optimizer group) is used as is: DeepSpeed must
    # not swap in its own compiled CPU Adam, and must accept it under ZeRO.
    config["zero_force_ds_cpu_optimizer"] = False
    config["zero_allow_untested_optimizer"] = True
    config["steps_per_print"] = 2**31 - 1  # the loop logs; DeepSpeed stays quiet
    return config


def bucket_sizes(spec: RunSpec) -> dict[str, int]:
    """Sizes DeepSpeed's own docs derive from the hidden width: ZeRO-1/2 defaults, and keys left at "auto".

    The width is the model's real one: a Hugging Face folder's hidden_size, not the preset's d_model.
    """
    width = model_shape(spec.model).equivalent.d_model
    prefetch, persistence = int(0.9 * width * width), 10 * width
    return {
        "zero_optimization.reduce_bucket_size": width * width,
        "zero_optimization.allgather_bucket_size": width * width,
        "zero_optimization.stage3_prefetch_bucket_size": prefetch,
        "zero_optimization.stage3_param_persistence_threshold": persistence,
        # DeepSpeedZeroConfig's names for the same two (axolotl's zero3 files write these)
        "zero_optimization.prefetch_bucket_size": prefetch,
        "zero_optimization.param_persistence_threshold": persistence,
    }
