"""Rules of the `deepspeed` strategy, checked before launch: ZeRO stage and offload, precision on
the device, exclusivity with other strategies' settings, and a user's DeepSpeed JSON against the spec."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.config.parallel import ParallelConfig
from launcher.parallel import deepspeed_schema
from launcher.parallel.deepspeed_config import loss_scale_power
from launcher.parallel.deepspeed_sections import section_problems
from launcher.parallel.deepspeed_user_config import merge as merge_user_config
from launcher.parallel.deepspeed_user_config import read_user_config
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, installed, missing
from launcher.spec import RunSpec, SpecError

DEEPSPEED_KEYS = ("zero_stage", "offload_optimizer", "offload_params", "deepspeed_config")
# Settings of other strategies that a DeepSpeed run would silently ignore.
# (nf4/int8 weights with ZeRO-3 are refused by launcher.rules.quantization; the pipeline keys,
# parallel.pp_*, by launcher.rules.pipeline for every strategy but pp, with ZeRO's own reason.)
FOREIGN_KEYS = (
    "bucket_mb",
    "static_graph",
    "gradient_as_bucket_view",
    "find_unused_parameters",
    "comm_hook",
    "powersgd_rank",
    "powersgd_start_iter",
    "reshard_after_forward",
    "replicate_degree",
    "cpu_offload",
    "prefetch_layers",
    "tp_size",
    "sequence_parallel",
)
_DEFAULTS = ParallelConfig()


def _changed(p: ParallelConfig, names: tuple[str, ...]) -> list[str]:
    return [f"parallel.{n}" for n in names if getattr(p, n) != getattr(_DEFAULTS, n)]


def _exclusive(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    """One error naming the keys, set away from their defaults, of the strategies this run does not use."""
    p = spec.parallel
    if p.strategy != "deepspeed":
        names, why = (
            DEEPSPEED_KEYS,
            f"configure DeepSpeed ZeRO, but parallel.strategy={p.strategy}, which ignores "
            "them (ZeRO and FSDP are exclusive). Pick a DeepSpeed option (`parallel=zero0` ... `zero3`, "
            "`zero3_offload`) or leave these keys at their defaults.",
        )
    else:
        names, why = (
            FOREIGN_KEYS,
            "belong to DDP, FSDP2 or tensor parallelism, but parallel.strategy=deepspeed "
            "(ZeRO) would ignore them (ZeRO and FSDP are exclusive). Use `parallel=ddp` / `parallel=fsdp` / "
            "`parallel=tp` for them, or leave them at their defaults; DeepSpeed offload is "
            "parallel.offload_optimizer / parallel.offload_params.",
        )
    keys = _changed(p, names)
    if keys:
        yield SpecError(("parallel.strategy", *keys), f"{', '.join(keys)} {why}")


def _installed(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    if spec.parallel.strategy == "deepspeed":
        yield from missing(
            "deepspeed",
            ("parallel.strategy",),
            "parallel.strategy=deepspeed needs the deepspeed package, which is not installed. "
            "Install it with `pip install deepspeed` (or `pip install -e .[deepspeed]`), or pick `parallel=ddp`.",
        )


def _stage_and_offload(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p = spec.parallel
    if p.strategy != "deepspeed":
        return
    if p.zero_stage not in (0, 1, 2, 3):
        yield SpecError(
            ("parallel.zero_stage",),
            f"ZeRO stages are 0, 1, 2 and 3, got {p.zero_stage}. Pick one with `parallel=zero0` ... `parallel=zero3`.",
        )
        return
    if p.offload_params and p.zero_stage != 3:
        yield SpecError(
            ("parallel.offload_params", "parallel.zero_stage"),
            f"parameter offload needs ZeRO stage 3 (parameters are sharded only there), but zero_stage={p.zero_stage}. "
            "Use `parallel=zero3_offload`, or set parallel.zero_stage=3.",
        )
    if p.offload_optimizer and p.zero_stage < 1:
        yield SpecError(
            ("parallel.offload_optimizer", "parallel.zero_stage"),
            "optimizer offload needs ZeRO stage 1 or more (stage 0 keeps the plain optimizer on the device). "
            "Set parallel.zero_stage=1, 2 or 3.",
        )


def _precision(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    if spec.parallel.strategy != "deepspeed" or not spec.precision.fp16:
        return
    if hw.device_type == "cpu":
        yield SpecError(
            ("precision.fp16", "parallel.strategy"),
            "DeepSpeed does not support fp16 on a CPU (it fails with 'Type fp16 is not supported on your "
            "device'). Use `precision=bf16` or `precision=fp32` with DeepSpeed here.",
        )
    if loss_scale_power(spec) is None:
        yield SpecError(
            ("precision.loss_scale_init",),
            f"DeepSpeed's fp16 loss scale starts at a power of two (it takes the exponent), got "
            f"{spec.precision.loss_scale_init}. Use e.g. precision.loss_scale_init=65536.",
        )


def _user_config(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    """A user's DeepSpeed JSON: every section honoured, decided by the spec or refused; then DeepSpeed's own check."""
    path = spec.parallel.deepspeed_config
    if spec.parallel.strategy != "deepspeed" or not path:
        return
    user, errors = read_user_config(path)
    if user is not None:
        filled, errors = merge_user_config(spec, path, user)
        errors = section_problems(path, user) + errors
        if not errors and installed("deepspeed"):
            errors = deepspeed_schema.errors(path, filled)
    yield from errors


RULES: tuple[Rule, ...] = (_exclusive, _installed, _stage_and_offload, _precision, _user_config)
"""This module's rules, in the order they report."""
