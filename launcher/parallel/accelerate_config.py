"""An accelerate config YAML given as `parallel.deepspeed_config`, read for its DeepSpeed settings.

`accelerate config` writes a YAML whose `deepspeed_config` section holds either a path to a
DeepSpeed JSON (`deepspeed_config_file`) or a few plugin settings that accelerate turns into a
DeepSpeed config itself. Both become the DeepSpeed config accelerate would hand DeepSpeed, mapped as
accelerate's `DeepSpeedPlugin` maps them (zero_stage 2 when left out, gradient accumulation and
clipping "auto" when left out), except that an offload device left out is left to the spec.
`mixed_precision` becomes the config's bf16/fp16 sections ("no": both off), as accelerate sets them.
`num_processes` / `num_machines` are the job's size: launcher.nproc x launcher.nnodes. Everything
else in the file (machine rank, addresses, launcher of a multi-node job, zero3_init_flag) is the
launcher's business here and is named as not used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from launcher.spec import SpecError

KEY = ("parallel.deepspeed_config",)
# accelerate's DeepSpeedPlugin settings -> DeepSpeed config paths (accelerate's own mapping).
_PLUGIN_KEYS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}
_PRECISION = {"bf16": (True, False), "fp16": (False, True), "no": (False, False)}
# Read elsewhere or meaningless for a DeepSpeed run started by the launcher.
_QUIET = {
    "compute_environment",
    "distributed_type",
    "deepspeed_config",
    "num_processes",
    "num_machines",
    "debug",
}


@dataclass(frozen=True, kw_only=True)
class AccelerateFile:
    """What an accelerate config says about a DeepSpeed run."""

    deepspeed: dict[str, Any]
    """The DeepSpeed config accelerate would build from it."""
    taken: list[str] = field(default_factory=list)
    """`accelerate_key=value` for each setting read, in file order."""
    launch: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Spec key -> (the accelerate key, its value): launcher.nproc and launcher.nnodes."""
    unused: list[str] = field(default_factory=list)
    """Keys the launcher does not use (said once, so nobody expects them to act)."""


def looks_like_accelerate(path: str) -> bool:
    """Whether `path` names an accelerate config rather than a DeepSpeed JSON (by its suffix)."""
    return Path(path).suffix.lower() in (".yaml", ".yml")


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _plugin_config(section: dict[str, Any], taken: list[str], unused: list[str]) -> dict[str, Any]:
    """The DeepSpeed config accelerate builds from a `deepspeed_config` section's plugin settings."""
    config: dict[str, Any] = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2},
    }
    for key, value in section.items():
        if key in _PLUGIN_KEYS and value is not None:
            if key.endswith("nvme_path") and value == "none":
                continue
            _set(config, _PLUGIN_KEYS[key], value)
            taken.append(f"{key}={value}")
        elif key != "deepspeed_config_file":
            unused.append(f"deepspeed_config.{key}")
    return config


def json_object(file: Path, unreadable: str, what: str) -> tuple[dict[str, Any] | None, list[SpecError]]:
    """The JSON object in `file`, or one error: `unreadable` (its `{err}` becomes the reason), or not an object."""
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        return None, [SpecError(KEY, unreadable.replace("{err}", str(err)))]
    if not isinstance(data, dict):
        return None, [SpecError(KEY, f"'{file}' must hold a JSON object ({what}).")]
    return data, []


def _json_file(path: str, yaml_path: Path) -> tuple[dict[str, Any] | None, list[SpecError]]:
    """The DeepSpeed JSON a `deepspeed_config_file` names (from the working directory, else beside the YAML)."""
    file = Path(path)
    if not file.is_file() and not file.is_absolute() and (yaml_path.parent / file).is_file():
        file = yaml_path.parent / file
    return json_object(
        file,
        f"the accelerate config {yaml_path} names deepspeed_config_file={path}, which does not read as "
        "a DeepSpeed JSON ({err}). Fix the path (from the working directory or the YAML's folder).",
        "a DeepSpeed config",
    )


def _launch(data: dict[str, Any], path: Path) -> tuple[dict[str, tuple[str, int]], list[SpecError]]:
    """launcher.nproc / launcher.nnodes from num_processes (over all machines) and num_machines."""
    total, machines = data.get("num_processes"), data.get("num_machines", 1)
    if total is None:
        return {}, []
    if not (isinstance(total, int) and isinstance(machines, int) and machines > 0 and total % machines == 0):
        return {}, [
            SpecError(
                (*KEY, "launcher.nproc"),
                f"the accelerate config {path} has num_processes={total} over num_machines={machines}, which is "
                "not a whole number of processes per machine. Fix the file, or remove both keys and set "
                "launcher.nproc / launcher.nnodes.",
            )
        ]
    launch = {"launcher.nproc": ("num_processes", total // machines)}
    if "num_machines" in data:
        launch["launcher.nnodes"] = ("num_machines", machines)
    return launch, []


def read_accelerate(path: str) -> tuple[AccelerateFile | None, list[SpecError]]:
    """The DeepSpeed settings of an accelerate config YAML, or why it cannot give them."""
    file = Path(path)
    try:
        data = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError) as err:
        return None, [
            SpecError(KEY, f"'{path}' does not read as an accelerate config YAML ({err}). Fix the file.")
        ]
    if not isinstance(data, dict):
        return None, [SpecError(KEY, f"'{path}' must hold a YAML mapping (an accelerate config).")]
    kind = str(data.get("distributed_type", "DEEPSPEED")).upper()
    section = data.get("deepspeed_config")
    if kind != "DEEPSPEED" or not isinstance(section, dict):
        return None, [
            SpecError(
                KEY,
                f"the accelerate config {path} describes distributed_type={kind} without a deepspeed_config "
                "section, so it holds no DeepSpeed settings. Give a config with distributed_type: DEEPSPEED "
                "(or a DeepSpeed JSON); for FSDP or DDP pick `parallel=fsdp` / `parallel=ddp` instead.",
            )
        ]
    taken: list[str] = []
    unused = [k for k in data if k not in _QUIET and k != "mixed_precision"]
    if section.get("deepspeed_config_file"):
        deepspeed, errors = _json_file(str(section["deepspeed_config_file"]), file)
        taken.append(f"deepspeed_config_file={section['deepspeed_config_file']}")
        unused += [f"deepspeed_config.{k}" for k in section if k != "deepspeed_config_file"]
    else:
        deepspeed, errors = _plugin_config(section, taken, unused), []
    launch, more = _launch(data, file)
    if deepspeed is None or errors or more:
        return None, errors + more
    precision = str(data.get("mixed_precision", "")).lower()
    if precision in _PRECISION:
        bf16, fp16 = _PRECISION[precision]
        deepspeed.setdefault("bf16", {})["enabled"] = bf16
        deepspeed.setdefault("fp16", {})["enabled"] = fp16
        taken.append(f"mixed_precision={precision}")
    elif precision:
        unused.append(f"mixed_precision={precision}")
    taken += [f"{name}={value}" for name, value in launch.values()]
    return AccelerateFile(deepspeed=deepspeed, taken=taken, launch=launch, unused=unused), []
