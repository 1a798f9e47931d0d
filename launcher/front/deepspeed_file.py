"""A user's DeepSpeed JSON or accelerate YAML decides the spec keys nobody set, before the spec is built.

With the Hugging Face Trainer, a JSON's explicit values (`offload_optimizer.device: "cpu"`) act
although no training argument asked for them. Here too: every value the file states for a spec key
that is still a default (the schema's, train.yaml's, or a group option nobody picked) is taken into
the config, with a note on stderr, and the dry run credits the file. A key set on the command line,
in a recipe, an experiment, a user's config directory or a group option chosen on purpose keeps its
value; where the file contradicts it, the DeepSpeed rules refuse the run naming both keys. Naming a
file also selects DeepSpeed when parallel.strategy was not set. An accelerate YAML's num_processes /
num_machines are taken the same way for launcher.nproc / launcher.nnodes (under torchrun the job's
own size stands), and its settings the launcher does not use are named once.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.config.launcher import torchrun_world
from launcher.front.config_values import with_values
from launcher.front.provenance import explicit
from launcher.parallel.accelerate_config import AccelerateFile, looks_like_accelerate, read_accelerate
from launcher.parallel.deepspeed_settings import stated
from launcher.parallel.deepspeed_user_config import read_user_config
from launcher.parallel.registry import STRATEGIES
from launcher.spec import SpecError


@dataclass(frozen=True, kw_only=True)
class Taken:
    """A spec value the user's file decides."""

    spec_key: str
    """The dotted spec key."""
    value: Any
    """Its value from the file."""
    credit: str
    """Where it came from, as the dry run's `from` column says it."""


def _read(path: str) -> tuple[dict[str, Any] | None, AccelerateFile | None]:
    """The file's DeepSpeed config (None when it does not read: the rules say why) and its accelerate view."""
    if looks_like_accelerate(path):
        accelerate = read_accelerate(path)[0]
        return (None, None) if accelerate is None else (accelerate.deepspeed, accelerate)
    return read_user_config(path)[0], None


def _path(cfg: DictConfig) -> str | None:
    path = OmegaConf.select(cfg, "parallel.deepspeed_config", default=None)
    return str(path) if path else None


def taken(cfg: DictConfig) -> list[Taken]:
    """The spec values the file named by parallel.deepspeed_config decides: its explicit values for keys nobody set."""
    path = _path(cfg)
    if path is None:
        return []
    set_by = explicit(cfg)
    engine = getattr(STRATEGIES.get(cfg.parallel.strategy), "wrap", None) == "engine"  # DeepSpeed's
    if "parallel.strategy" in set_by and not engine:
        return []  # the rules refuse a DeepSpeed file under another strategy
    name = Path(path).name
    out = []
    if "parallel.strategy" not in set_by:  # even for a file that does not read: the rules then say why
        out.append(Taken(spec_key="parallel.strategy", value="deepspeed", credit=f"deepspeed_config {name}"))
    user, accelerate = _read(path)
    if user is None:
        return out
    for setting in stated(user, str(OmegaConf.select(cfg, "optimizer.name"))):
        if setting.spec_key not in set_by:
            credit = f"{name}: {setting.json_key}"
            out.append(Taken(spec_key=setting.spec_key, value=setting.value, credit=credit))
    launch = accelerate.launch if accelerate and torchrun_world(os.environ) is None else {}
    for spec_key, (key, value) in launch.items():
        if spec_key not in set_by:
            out.append(Taken(spec_key=spec_key, value=value, credit=f"{name}: {key}"))
    return out + _accumulation(cfg, user, out, set_by, name)


def _accumulation(
    cfg: DictConfig, user: dict[str, Any], decided: list[Taken], set_by: dict[str, str], name: str
) -> list[Taken]:
    """The split of an explicit train_batch_size that DeepSpeed would derive, for the batch keys nobody set.

    As DeepSpeed's `_set_batch_related_parameters`: a known micro batch gives the accumulation steps
    (train_batch_size / (micro x ranks)), known accumulation steps give the micro batch
    (train_batch_size / (steps x ranks)), and with neither there is one step of train_batch_size / ranks.
    "Known" is stated in the file or set by someone; a key's default is not. Only exact divisions are
    taken; otherwise the batch check names the keys.
    """
    total = user.get("train_batch_size")
    if not isinstance(total, int) or isinstance(total, bool) or total <= 0:
        return []
    value = {t.spec_key: t.value for t in decided}
    ranks = 1
    for key in ("launcher.nproc", "launcher.nnodes"):
        ranks *= int(value.get(key, OmegaConf.select(cfg, key)))
    micro_key, steps_key = "train.micro_batch_size", "train.grad_accum_steps"
    micro_known = micro_key in value or micro_key in set_by
    steps_known = steps_key in value or steps_key in set_by
    micro = int(value.get(micro_key, OmegaConf.select(cfg, micro_key)))
    steps = int(value.get(steps_key, OmegaConf.select(cfg, steps_key)))
    if micro_known and steps_known:
        return []
    if micro_known:
        derived = {steps_key: (total, micro * ranks, "train_batch_size / (micro batch x ranks)")}
    elif steps_known:
        derived = {micro_key: (total, steps * ranks, "train_batch_size / (accumulation steps x ranks)")}
    else:
        derived = {
            steps_key: (1, 1, "train_batch_size without a micro batch or accumulation steps: 1 step"),
            micro_key: (total, ranks, "train_batch_size / ranks"),
        }
    if any(whole % part for whole, part, _ in derived.values()):
        return []
    return [
        Taken(spec_key=key, value=whole // part, credit=f"{name}: {how}")
        for key, (whole, part, how) in derived.items()
    ]


def _launch_conflicts(cfg: DictConfig, path: str, accelerate: AccelerateFile | None) -> list[SpecError]:
    """An accelerate file's job size against a launcher.nproc / nnodes that someone set."""
    errors = []
    launch = accelerate.launch if accelerate and torchrun_world(os.environ) is None else {}
    for spec_key, (key, value) in launch.items():
        current = OmegaConf.select(cfg, spec_key)
        if current != value:
            errors.append(
                SpecError(
                    (f"deepspeed_config:{key}", spec_key),
                    f"the accelerate config {path} sets {key} (giving {spec_key}={value}), but {spec_key}={current} "
                    f"was set for this run. Make them agree: change {spec_key}, or edit or remove {key} in the file.",
                )
            )
    return errors


def adopt(cfg: DictConfig) -> tuple[DictConfig, list[SpecError]]:
    """The config with the file's decisions written in (saying which changed a value on stderr); the conflicts
    the rules cannot see."""
    path = _path(cfg)
    if path is None:
        return cfg, []
    items = taken(cfg)
    changed = [t for t in items if _plain(OmegaConf.select(cfg, t.spec_key)) != t.value]
    cfg = with_values(cfg, {item.spec_key: item.value for item in items})
    accelerate = _read(path)[1]
    if accelerate is not None:
        print(
            f"note: read from the accelerate config {path}: {', '.join(accelerate.taken) or 'nothing'}"
            + (f"; not used here: {', '.join(accelerate.unused)}" if accelerate.unused else ""),
            file=sys.stderr,
        )
    if changed:
        values = ", ".join(f"{t.spec_key}={_text(t.value)} ({t.credit})" for t in changed)
        print(
            f"note: taken from {path}, since nobody set these keys: {values}. Set a key to choose otherwise.",
            file=sys.stderr,
        )
    return cfg, _launch_conflicts(cfg, path, accelerate)


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _text(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
