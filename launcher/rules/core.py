"""Cross-field rules of the run spec, checked once before anything starts; each names keys and a fix."""

from __future__ import annotations

import glob
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from launcher.groups import checkpoint, device
from launcher.groups.data import DataConfig
from launcher.groups.memory import ACTIVATION_CHECKPOINTING
from launcher.groups.optimizer import OPTIMIZERS
from launcher.groups.precision import DTYPES
from launcher.groups.quantization import METHODS
from launcher.groups.scheduler import SCHEDULES
from launcher.launch import BACKENDS
from launcher.parallel.registry import STRATEGIES
from launcher.spec import RunSpec, SpecError, did_you_mean

DATA_KINDS = ("stdlib", "text", "jsonl")
MODEL_KINDS = ("gpt", "hf")
NONFINITE_POLICIES = ("skip", "stop")


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """What the machine that will run the ranks can do."""

    device_type: str
    bf16: bool
    tf32: bool
    num_gpus: int


def detect_hardware(spec: RunSpec) -> Hardware:
    """Probe the device the spec would run on."""
    import torch

    kind = device.resolve_device(spec.launcher.device)
    return Hardware(
        device_type=kind,
        bf16=device.bf16_supported(kind),
        tf32=device.tf32_supported(kind),
        num_gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0,
    )


Rule = Callable[[RunSpec, Hardware], Iterator[SpecError]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    """Register a rule; every registered rule runs on every spec."""
    RULES.append(fn)
    return fn


# Modules of feature areas whose rules register themselves with @rule when imported.
RULE_MODULES: tuple[str, ...] = ("launcher.rules.slurm", "launcher.rules.performance", "launcher.rules.deepspeed", "launcher.rules.quantization", "launcher.rules.optimizer", "launcher.rules.hf_model", "launcher.rules.local_launch", "launcher.rules.ddp", "launcher.rules.sharding", "launcher.front.verify")


def check(spec: RunSpec, hw: Hardware) -> list[SpecError]:
    """All violations of all rules, so that one run of the CLI reports every problem at once."""
    for module in RULE_MODULES:
        importlib.import_module(module)
    return [error for fn in RULES for error in fn(spec, hw)]


def _choice(key: str, value: str, choices: tuple[str, ...] | list[str], what: str) -> Iterator[SpecError]:
    if value not in choices:
        yield SpecError(
            (key,),
            f"unknown {what} '{value}'.{did_you_mean(value, choices)} Choose one of: {', '.join(choices)}.",
        )


@rule
def _names(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    yield from _choice("parallel.strategy", spec.parallel.strategy, sorted(STRATEGIES), "parallel strategy")
    yield from _choice("optimizer.name", spec.optimizer.name, sorted(OPTIMIZERS), "optimizer")
    yield from _choice("scheduler.name", spec.scheduler.name, SCHEDULES, "schedule")
    yield from _choice("data.kind", spec.data.kind, DATA_KINDS, "data kind")
    yield from _choice("model.kind", spec.model.kind, MODEL_KINDS, "model kind")
    yield from _choice("quantization.method", spec.quantization.method, METHODS, "quantization method")
    yield from _choice(
        "memory.activation_checkpointing",
        spec.memory.activation_checkpointing,
        ACTIVATION_CHECKPOINTING,
        "activation checkpointing mode",
    )
    yield from _choice("launcher.backend", spec.launcher.backend, sorted(BACKENDS), "launch backend")
    yield from _choice("train.on_nonfinite", spec.train.on_nonfinite, NONFINITE_POLICIES, "policy")
    yield from _choice("launcher.device", spec.launcher.device, ("auto", "cpu", "cuda"), "device")


@rule
def _precision(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p = spec.precision
    if p.fp16 and p.bf16:
        yield SpecError(
            ("precision.fp16", "precision.bf16"),
            "fp16 and bf16 are both on, but a run autocasts to one dtype. Choose one: "
            "`precision=bf16` (preferred where the hardware has it) or `precision=fp16`.",
        )
    if p.bf16 and not hw.bf16:
        yield SpecError(
            ("precision.bf16",),
            f"this {hw.device_type} device has no bf16 support (CUDA needs compute capability 8.0+). "
            "Use `precision=fp16` (loss-scaled) or `precision=fp32`.",
        )
    if p.tf32 and not hw.tf32:
        yield SpecError(
            ("precision.tf32",),
            f"TF32 exists only on NVIDIA GPUs of compute capability 8.0 or newer, and this run is on "
            f"{hw.device_type}. Use `precision=fp32` (or `precision=bf16`) here.",
        )
    if p.eval_dtype is not None and p.eval_dtype not in DTYPES:
        yield from _choice("precision.eval_dtype", p.eval_dtype, tuple(DTYPES), "dtype")
    if p.fp16 and p.loss_scale_init <= 0:
        yield SpecError(("precision.loss_scale_init",), "the fp16 loss scale must be positive, e.g. 65536.")


def _positive(key: str, value: float | None, fix: str = "") -> Iterator[SpecError]:
    if value is not None and value <= 0:
        yield SpecError((key,), f"must be positive, got {value}.{(' ' + fix) if fix else ''}")


@rule
def _loop(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    t = spec.train
    yield from _positive("train.max_steps", t.max_steps)
    yield from _positive("train.micro_batch_size", t.micro_batch_size, "Lower it to fit memory, not below 1.")
    yield from _positive("train.grad_accum_steps", t.grad_accum_steps, "Use 1 for no accumulation.")
    yield from _positive("train.log_every", t.log_every)
    yield from _positive(
        "train.eval_every", t.eval_every, "Use `train.eval_every=null` to turn evaluation off."
    )
    yield from _positive("train.eval_batches", t.eval_batches)
    yield from _positive(
        "train.max_grad_norm", t.max_grad_norm, "Use `train.max_grad_norm=null` to turn clipping off."
    )
    yield from _positive(
        "checkpoint.every", spec.checkpoint.every, "Use `checkpoint.every=null` to turn checkpoints off."
    )
    yield from _positive("checkpoint.keep", spec.checkpoint.keep, "Keep at least 1 checkpoint.")
    yield from _positive("optimizer.lr", spec.optimizer.lr, "A typical AdamW value is 3e-4.")
    if t.stop_after is not None and not 0 < t.stop_after < t.max_steps:
        yield SpecError(
            ("train.stop_after", "train.max_steps"),
            f"stop_after ({t.stop_after}) must lie between 0 and max_steps ({t.max_steps}); "
            "use null to train to the end.",
        )
    if spec.optimizer.weight_decay < 0:
        yield SpecError(("optimizer.weight_decay",), "must be 0 or more (0 turns weight decay off).")


@rule
def _schedule(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    s = spec.scheduler
    if s.warmup_steps < 0:
        yield SpecError(("scheduler.warmup_steps",), "must be 0 or more.")
    elif s.warmup_steps >= spec.train.max_steps > 0:
        yield SpecError(
            ("scheduler.warmup_steps", "train.max_steps"),
            f"warmup ({s.warmup_steps} steps) is not shorter than the run ({spec.train.max_steps} steps), "
            "so the learning rate would never reach its peak. Lower scheduler.warmup_steps or raise train.max_steps.",
        )
    if not 0.0 <= s.min_lr_ratio <= 1.0:
        yield SpecError(("scheduler.min_lr_ratio",), f"must lie in [0, 1], got {s.min_lr_ratio}.")


@rule
def _model_and_data(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    m, d = spec.model, spec.data
    if d.seq_len > m.max_seq_len:
        yield SpecError(
            ("data.seq_len", "model.max_seq_len"),
            f"sequences of {d.seq_len} tokens exceed the model's context of {m.max_seq_len}. "
            f"Lower data.seq_len or raise model.max_seq_len.",
        )
    yield from _positive("data.seq_len", d.seq_len)
    if m.n_head <= 0 or m.d_model % max(m.n_head, 1):
        yield SpecError(
            ("model.d_model", "model.n_head"),
            f"d_model ({m.d_model}) must be a positive multiple of n_head ({m.n_head}).",
        )
    if m.vocab_size < 256:
        yield SpecError(
            ("model.vocab_size",), f"byte-level data needs at least 256 token ids, got {m.vocab_size}."
        )
    if not 0.0 < d.val_fraction < 1.0:
        yield SpecError(("data.val_fraction",), f"must lie strictly between 0 and 1, got {d.val_fraction}.")
    yield from _data_path(d)


def _data_path(d: DataConfig) -> Iterator[SpecError]:
    if d.kind not in ("text", "jsonl"):
        return
    if not d.path:
        yield SpecError(("data.path",), f"data.kind={d.kind} reads files: set data.path to a file or a glob.")
        return
    if not glob.glob(d.path):
        yield SpecError(
            ("data.path",),
            f"no file matches '{d.path}'. Give an existing file or a glob that matches one "
            "(relative paths start from the directory `train` runs in).",
        )


@rule
def _hardware(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    if spec.launcher.device == "cuda" and hw.num_gpus == 0:
        yield SpecError(
            ("launcher.device",),
            "launcher.device=cuda but no CUDA GPU is visible to this process. Use `launcher.device=auto` "
            "or `cpu`, or run on a machine with a GPU.",
        )
    yield from _positive("launcher.nproc", spec.launcher.nproc)
    if spec.launcher.backend == "inline" and spec.launcher.nproc > 1:
        yield SpecError(
            ("launcher.backend", "launcher.nproc"),
            f"the inline backend runs one process, but launcher.nproc={spec.launcher.nproc}. "
            "Use `launcher=local` for several processes on this machine, or launcher.nproc=1.",
        )


@rule
def _resume(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    run_dir = Path(spec.run_dir) if spec.run_dir else None
    if spec.resume is None:
        if run_dir is not None and checkpoint.step_dirs(run_dir):
            yield SpecError(
                ("resume", "run_dir"),
                f"{run_dir} already holds checkpoints and resume is null, so a fresh start would mix two "
                "runs. Continue it with `resume=auto`, or choose another run_dir.",
            )
        return
    if spec.resume == "auto":
        if run_dir is None:
            yield SpecError(
                ("resume", "run_dir"),
                "resume=auto continues the run in run_dir, but run_dir is null (a new directory per run). "
                "Name the run directory, e.g. `run_dir=runs/my-run resume=auto`.",
            )
        return
    if not checkpoint.resolve_resume(spec.resume, None):
        yield SpecError(
            ("resume",),
            f"'{spec.resume}' holds no complete checkpoint (a run directory with checkpoints/step_N, or a "
            "step_N directory with its COMPLETE marker). Give another path, or `resume=auto`.",
        )
