"""The explicit values of a user's DeepSpeed config, as the spec keys they stand for.

A value the file states (not "auto", not missing) is a decision the user made in that file; where
the spec key it maps onto was left at its default, the file's value is taken (as the Hugging Face
Trainer lets a JSON's `offload_optimizer.device` decide). launcher.front.deepspeed_file decides
which spec keys were set explicitly and takes the rest; the spec and the file then agree, and
launcher.parallel.deepspeed_user_config finds no contradiction in them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from launcher.parallel.deepspeed_config import AUTO


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One spec value a DeepSpeed config states."""

    json_key: str
    """Dotted path in the DeepSpeed config."""
    spec_key: str
    """The spec key it decides."""
    value: Any
    """The spec's value for it (the file's value converted: "cpu" -> true, 0 -> null, ...)."""


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _positive_int(value: Any) -> int | None:
    return value if _int(value) else None


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _device(value: Any) -> bool | None:
    """An offload device as the spec's switch; "nvme" has no counterpart (the contradiction says so)."""
    return {"cpu": True, "none": False}.get(value) if isinstance(value, str) else None


def _betas(value: Any) -> list[float] | None:
    ok = isinstance(value, list) and len(value) == 2 and all(_number(v) is not None for v in value)
    return [float(v) for v in value] if ok else None


_Convert = Callable[[Any], Any]
# (JSON key, spec key, converter, optimizer it applies to or None); the first of two keys for one
# spec key wins (a modern key over its legacy spelling).
_TABLE: tuple[tuple[str, str, _Convert, str | None], ...] = (
    ("zero_optimization.stage", "parallel.zero_stage", _int, None),
    ("zero_optimization.offload_optimizer.device", "parallel.offload_optimizer", _device, None),
    ("zero_optimization.cpu_offload", "parallel.offload_optimizer", _bool, None),
    ("zero_optimization.offload_param.device", "parallel.offload_params", _device, None),
    ("zero_optimization.cpu_offload_param", "parallel.offload_params", _bool, None),
    ("train_micro_batch_size_per_gpu", "train.micro_batch_size", _positive_int, None),
    ("gradient_accumulation_steps", "train.grad_accum_steps", _positive_int, None),
    ("gradient_clipping", "train.max_grad_norm", _number, None),
    ("bf16.enabled", "precision.bf16", _bool, None),
    ("bfloat16.enabled", "precision.bf16", _bool, None),
    ("fp16.enabled", "precision.fp16", _bool, None),
    ("optimizer.params.lr", "optimizer.lr", _number, None),
    ("optimizer.params.weight_decay", "optimizer.weight_decay", _number, None),
    ("optimizer.params.eps", "optimizer.eps", _number, "adamw"),
    ("optimizer.params.betas", "optimizer.betas", _betas, "adamw"),
    ("optimizer.params.momentum", "optimizer.momentum", _number, "sgd"),
)


def _get(tree: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return AUTO
        tree = tree[part]
    return tree


def stated(user: dict[str, Any], optimizer: str) -> list[Setting]:
    """The spec values `user` (a DeepSpeed config) states explicitly; `optimizer` is the spec's optimizer.name.

    A legacy `"zero_optimization": true` is stage 1; an optimizer section of another type states nothing
    (its type is refused by the user-config check); gradient_clipping 0 is no clipping (null).
    """
    zero = user.get("zero_optimization")
    if isinstance(zero, bool):
        user = {**user, "zero_optimization": {"stage": int(zero)}}
    kind = str(_get(user, "optimizer.type")).lower()
    settings: dict[str, Setting] = {}
    for json_key, spec_key, convert, only_for in _TABLE:
        given = _get(user, json_key)
        if given == AUTO or spec_key in settings or (only_for and only_for != optimizer):
            continue
        if json_key.startswith("optimizer.") and kind not in (AUTO, optimizer):
            continue
        value = convert(given)
        if value is None:
            continue  # a value the spec cannot hold: the contradiction check names it
        if spec_key == "train.max_grad_norm" and value == 0:
            value = None
        settings[spec_key] = Setting(json_key=json_key, spec_key=spec_key, value=value)
    return list(settings.values())
