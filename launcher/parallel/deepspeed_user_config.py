"""A user's DeepSpeed JSON (`parallel.deepspeed_config=PATH`), checked against the spec and merged
over the config the spec generates.

In a user's file a key the spec decides may be left out, set to "auto" (filled from the spec) or
repeat the spec's value. Any other value is a contradiction, reported before launch naming the JSON
key and the spec key. Legacy spellings (`cpu_offload`, `cpu_offload_param`, `"zero_optimization":
true`) are checked as their modern keys. The file's `optimizer` and `scheduler` sections (as Hugging
Face's templates carry them) are checked the same way and then dropped: the engine gets the optimizer
group's torch optimizer as a client optimizer and no scheduler, because the loop steps the scheduler
group's schedule over that optimizer (a DeepSpeed scheduler would set the learning rate a second time
each step). Keys the spec has no say in (bucket sizes, overlap, prefetching, ...) are the user's: they
win over the generated defaults.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

from launcher.components.batch_split import BatchSplit
from launcher.parallel.accelerate_config import KEY, json_object, looks_like_accelerate, read_accelerate
from launcher.parallel.deepspeed_config import AUTO, Derived, bucket_sizes, derived, generate
from launcher.spec import RunSpec, SpecError

_MISSING = object()
# The optimizer comes from the optimizer group (a client optimizer: nothing is JIT-compiled);
# a JSON optimizer section may only restate it.
_OPTIMIZER_TYPES = {"adamw": ("adamw",), "sgd": ("sgd",)}
# DeepSpeed's schedulers and the scheduler group's schedule each one draws (linear warmup from 0,
# then: constant, linear decay to 0, cosine to cos_min_ratio).
_SCHEDULERS = {"warmuplr": "constant", "warmupdecaylr": "linear", "warmupcosinelr": "cosine"}
# Legacy ZeRO keys, checked as the spec keys of their modern forms, then dropped (the modern form stands).
_LEGACY_ZERO = ("zero_optimization.cpu_offload", "zero_optimization.cpu_offload_param")


def _get(tree: dict[str, Any], path: str) -> Any:
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _same(given: Any, wanted: Any) -> bool:
    """JSON value equals the spec's (numbers compared as floats, so 1 equals 1.0)."""
    if isinstance(given, bool) or isinstance(wanted, bool):
        return given is wanted
    if isinstance(given, int | float) and isinstance(wanted, int | float):
        return math.isclose(float(given), float(wanted), rel_tol=1e-9, abs_tol=0.0)
    if isinstance(given, list) and isinstance(wanted, list):
        return len(given) == len(wanted) and all(_same(a, b) for a, b in zip(given, wanted, strict=True))
    return given == wanted


def _auto_paths(tree: Any, prefix: str = "") -> list[str]:
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in _auto_paths(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if tree == AUTO else []


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_user_config(path: str) -> tuple[dict[str, Any] | None, list[SpecError]]:
    """The user's DeepSpeed config (a JSON, or what an accelerate YAML says), or the error saying why not."""
    file = Path(path)
    if not file.is_file():
        return None, [
            SpecError(
                KEY,
                f"no DeepSpeed JSON or accelerate config at '{path}' (relative paths start from the directory "
                "`train` runs in). Give an existing file, or leave parallel.deepspeed_config=null to generate "
                "the config from the spec.",
            )
        ]
    if looks_like_accelerate(path):
        accelerate, errors = read_accelerate(path)
        return (None, errors) if accelerate is None else (accelerate.deepspeed, [])
    return json_object(
        file,
        f"'{path}' is not valid JSON ({{err}}). Fix the file; an accelerate config YAML is read when its "
        "name ends in .yaml or .yml.",
        "a DeepSpeed config",
    )


def _contradiction(path: str, json_key: str, given: Any, d: Derived) -> SpecError:
    note = f" {d.note}" if d.note else ""
    return SpecError(
        (f"deepspeed_config:{json_key}", d.spec_key),
        f"the DeepSpeed JSON {path} sets {json_key}={json.dumps(given)}, but the spec gives "
        f"{json.dumps(d.value)} ({d.spec_key}){note}. The file decides only keys nobody set, and this one was set "
        f'for the run: set it to {json.dumps(d.value)} or "auto" in the JSON, or change {d.spec_key} to match.',
    )


def _check_optimizer(spec: RunSpec, path: str, user: dict[str, Any]) -> list[SpecError]:
    section = user.get("optimizer")
    if section is None:
        return []
    given = section.get("type", AUTO) if isinstance(section, dict) else section
    kind = str(given).lower() if isinstance(section, dict) else ""
    if kind == AUTO or kind in _OPTIMIZER_TYPES.get(spec.optimizer.name, ()):
        return []
    return [
        SpecError(
            ("deepspeed_config:optimizer.type", "optimizer.name"),
            f"the DeepSpeed JSON {path} sets optimizer.type={json.dumps(given)}, "
            f"but the spec uses optimizer.name={spec.optimizer.name}. The optimizer comes from the optimizer group: "
            "remove the `optimizer` section from the JSON, or make its type match.",
        )
    ]


_RAMP = "(the spec's warmup rises linearly from 0 over scheduler.warmup_steps)"


def scheduler_values(spec: RunSpec, kind: str) -> list[Derived]:
    """The parameters of DeepSpeed scheduler `kind` (lower case) that draw the spec's schedule."""
    s, o = spec.scheduler, spec.optimizer
    keys = [
        Derived(json_key="warmup_num_steps", spec_key="scheduler.warmup_steps", value=s.warmup_steps),
        Derived(json_key="warmup_type", spec_key="scheduler.warmup_steps", value="linear", note=_RAMP),
    ]
    if kind == "warmupcosinelr":
        keys.append(
            Derived(json_key="warmup_min_ratio", spec_key="scheduler.warmup_steps", value=0.0, note=_RAMP)
        )
        keys.append(
            Derived(json_key="cos_min_ratio", spec_key="scheduler.min_lr_ratio", value=s.min_lr_ratio)
        )
    else:  # the warmup rises linearly from 0 to optimizer.lr
        keys.append(
            Derived(json_key="warmup_min_lr", spec_key="scheduler.warmup_steps", value=0.0, note=_RAMP)
        )
        keys.append(Derived(json_key="warmup_max_lr", spec_key="optimizer.lr", value=o.lr))
    if kind != "warmuplr":
        keys.append(
            Derived(json_key="total_num_steps", spec_key="train.max_steps", value=spec.train.max_steps)
        )
    return keys


def _check_scheduler(spec: RunSpec, path: str, user: dict[str, Any]) -> list[SpecError]:
    """A `scheduler` section agrees when its values are "auto" or the spec's own schedule's."""
    section = user.get("scheduler")
    if section is None:
        return []
    key = "deepspeed_config:scheduler.type"
    given = section.get("type", AUTO) if isinstance(section, dict) else section
    kind = str(given).lower()
    if kind != AUTO and kind not in _SCHEDULERS:
        return [
            SpecError(
                (key, "scheduler.name"),
                f"the DeepSpeed JSON {path} asks for DeepSpeed's {given} schedule, which the scheduler group has no "
                f"counterpart for (it draws WarmupLR, WarmupDecayLR and WarmupCosineLR). The loop steps the spec's "
                f"schedule (scheduler.name={spec.scheduler.name}): remove the `scheduler` section from the JSON.",
            )
        ]
    params = section.get("params", {}) if isinstance(section, dict) else {}
    params = params if isinstance(params, dict) else {}
    errors = []
    for d in scheduler_values(spec, kind):
        value = params.get(d.json_key, AUTO)
        if value != AUTO and not _same(value, d.value):
            errors.append(_contradiction(path, f"scheduler.params.{d.json_key}", value, d))
    explicit = any(v != AUTO for v in params.values())
    s = spec.scheduler
    same_shape = kind == AUTO or (
        _SCHEDULERS[kind] == s.name and (kind != "warmupdecaylr" or s.min_lr_ratio == 0)
    )
    if explicit and not same_shape:  # an all-"auto" section only names a template's type
        errors.append(
            SpecError(
                (key, "scheduler.name", "scheduler.min_lr_ratio"),
                f"the DeepSpeed JSON {path} describes DeepSpeed's {given} schedule with explicit values, but the spec "
                f"runs scheduler.name={s.name} (min_lr_ratio={s.min_lr_ratio}), which the loop steps. Pick the matching "
                "scheduler (WarmupLR: constant; WarmupDecayLR: linear with min_lr_ratio=0; WarmupCosineLR: cosine), "
                'or set the section\'s values to "auto", or remove the section.',
            )
        )
    return errors


def _check_master_weights(spec: RunSpec, path: str, user: dict[str, Any]) -> list[SpecError]:
    """Low-precision master weights: DeepSpeed keeps them only in ZeRO-Offload's DeepSpeedCPUAdam."""
    p, errors = spec.parallel, []
    for section, precision in (("fp16", "fp16"), ("bf16", "bf16")):
        json_key = f"{section}.{precision}_master_weights_and_grads"
        if _get(user, json_key) is not True:  # "auto" is filled with false: fp32 master weights
            continue
        wanted = {
            f"precision.{precision}": getattr(spec.precision, precision),
            "parallel.zero_stage": p.zero_stage in (1, 2, 3),
            "parallel.offload_optimizer": p.offload_optimizer,
            "optimizer.name": spec.optimizer.name == "adamw",
        }
        missing = tuple(k for k, ok in wanted.items() if not ok)
        if missing:
            errors.append(
                SpecError(
                    (f"deepspeed_config:{json_key}", *missing),
                    f"the DeepSpeed JSON {path} sets {json_key}=true: DeepSpeed keeps {precision} master weights "
                    f"and gradients only in ZeRO-Offload's DeepSpeedCPUAdam, so it needs precision={precision}, "
                    "parallel.zero_stage 1-3, parallel.offload_optimizer=true and optimizer=adamw (otherwise every "
                    f"rank stops with an AssertionError at start). Here {', '.join(missing)} disagree. Remove the key "
                    "(fp32 master weights, the default), or change those keys.",
                )
            )
    return errors


def _check_autotp(path: str, user: dict[str, Any]) -> list[SpecError]:
    """DeepSpeed's AutoTP (`tensor_parallel`) would split the layers a second time: the launcher owns TP."""
    section = user.get("tensor_parallel")
    if section is None:
        return []
    size = section.get("autotp_size", section.get("tp_size")) if isinstance(section, dict) else section
    return [
        SpecError(
            ("deepspeed_config:tensor_parallel", "parallel.strategy"),
            f"the DeepSpeed JSON {path} has a tensor_parallel section (AutoTP, size {json.dumps(size)}): "
            "DeepSpeed would shard the layers itself inside deepspeed.initialize, which every rank of a launcher "
            "run fails in. The launcher owns tensor parallelism: remove the section and use `parallel=tp "
            "parallel.tp_size=N` (or `parallel=tp_fsdp` for TP with sharded data parallelism).",
        )
    ]


def _legacy_zero(user: dict[str, Any]) -> dict[str, Any]:
    """The file with a legacy `"zero_optimization": true/false` written as its stage (DeepSpeed reads 1/0)."""
    zero = user.get("zero_optimization")
    if isinstance(zero, bool):
        return {**user, "zero_optimization": {"stage": int(zero)}}
    return user


def _unfillable(path: str, autos: list[str]) -> list[SpecError]:
    """One error for every "auto" the spec cannot fill."""
    if not autos:
        return []
    return [
        SpecError(
            tuple(f"deepspeed_config:{a}" for a in autos),
            f'the DeepSpeed JSON {path} sets {", ".join(autos)} to "auto", but the spec has no value for '
            f"{'it' if len(autos) == 1 else 'them'}. Give numbers in the JSON, or remove the keys to take "
            "DeepSpeed's defaults.",
        )
    ]


def merge(
    spec: RunSpec, path: str, user: dict[str, Any], ranks: int | None = None, batch: BatchSplit | None = None
) -> tuple[dict[str, Any], list[SpecError]]:
    """Fill the user's "auto" values from the spec and report every value that contradicts it."""
    user = _legacy_zero(user)
    filled = copy.deepcopy(user)
    errors = _check_optimizer(spec, path, user) + _check_scheduler(spec, path, user)
    errors += _check_master_weights(spec, path, user) + _check_autotp(path, user)
    for d in derived(spec, ranks, batch):
        given = _get(user, d.json_key)
        if given is _MISSING:
            continue
        if given == AUTO:
            _set(filled, d.json_key, d.value)
        elif d.json_key.startswith("fp16.") and d.json_key != "fp16.enabled" and not spec.precision.fp16:
            continue  # loss-scaling details of a disabled fp16 section do not matter
        elif not _same(given, d.value):
            errors.append(_contradiction(path, d.json_key, given, d))
    # Checked above, not handed to DeepSpeed: the client optimizer and the loop's schedule are used.
    filled.pop("optimizer", None)
    filled.pop("scheduler", None)
    zero = filled.get("zero_optimization")
    for legacy in _LEGACY_ZERO if isinstance(zero, dict) else ():  # the modern sections stand for them
        zero.pop(legacy.split(".")[1], None)
    for section in ("fp16", "bf16"):
        key = f"{section}.{section}_master_weights_and_grads"
        if _get(filled, key) == AUTO:
            _set(filled, key, False)
    autos = _auto_paths(filled)
    buckets = bucket_sizes(spec) if any(a.startswith("zero_optimization.") for a in autos) else {}
    for auto in autos:
        if auto in buckets:
            _set(filled, auto, buckets[auto])
    errors += _unfillable(path, [a for a in autos if a not in buckets])
    return filled, errors


def resolve(
    spec: RunSpec, ranks: int | None = None, *, batch: BatchSplit | None = None
) -> tuple[dict[str, Any], list[SpecError]]:
    """The config DeepSpeed gets: generated from the spec, with the user's file merged over it."""
    config = generate(spec, ranks, batch)
    path = spec.parallel.deepspeed_config
    if not path:
        return config, []
    user, errors = read_user_config(path)
    if user is None:
        return config, errors
    filled, errors = merge(spec, path, user, ranks, batch)
    merged = _deep_merge(config, filled)
    # These stay the launcher's: the client optimizer is kept and DeepSpeed's console log stays off.
    for key in ("zero_force_ds_cpu_optimizer", "zero_allow_untested_optimizer", "steps_per_print"):
        merged[key] = config[key]
    return merged, errors
