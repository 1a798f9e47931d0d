"""What every tracker shares: metrics.jsonl keys as tracker tags, the spec as flat params, run ids and
the steps a tracker already holds (so that a resumed session never logs a step twice).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import yaml

TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "epoch": "train/epoch",
    "loss_scale": "train/loss_scale",
    "tokens_per_s": "perf/tokens_per_s",
    "samples_per_s": "perf/samples_per_s",
    "trained_tokens_per_step": "perf/trained_tokens_per_step",
    "trained_tokens_per_s": "perf/trained_tokens_per_s",
    "mfu": "perf/mfu",
    "mem_peak_bytes": "mem/peak_bytes",
    "mem_reserved_bytes": "mem/reserved_bytes",
    "param_bytes": "mem/param_bytes",
    "grad_bytes": "mem/grad_bytes",
    "optimizer_bytes": "mem/optimizer_bytes",
    "nonfinite_skips": "skips/nonfinite",
    "overflow_skips": "skips/overflow",
    "eval_loss": "eval/loss",
    "eval_ppl": "eval/ppl",
}
"""metrics.jsonl key -> tracker tag; `time_<phase>_s` becomes `time/<phase>_s`, other numbers `train/<key>`."""
NOT_SCALARS = ("step", "session", "eval_step")
"""Record keys that say where a record belongs rather than what was measured."""


def tag(key: str) -> str:
    """The tracker tag of a metrics.jsonl key (TensorBoard groups tags by the part before the slash)."""
    if key in TAGS:
        return TAGS[key]
    if key.startswith("time_"):
        return f"time/{key.removeprefix('time_')}"
    if key.startswith("eval_loss/"):  # a mixture's per-source held-out loss
        return f"eval/loss/{key.removeprefix('eval_loss/')}"
    if key.startswith("eval/"):  # a benchmark evaluator's score: eval/<task>/<metric> as recorded
        return key
    return f"train/{key}"


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers under their tags (null values, e.g. mfu on a CPU, are left out)."""
    out = {}
    for key, value in record.items():
        if key in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[tag(key)] = float(value)
    return out


def flat_spec(run_dir: Path) -> dict[str, Any]:
    """spec.yaml as dotted key -> value (secrets stay `${oc.env:VAR}`, as spec.yaml keeps them)."""
    tree = yaml.safe_load((run_dir / "spec.yaml").read_text()) or {}
    return flatten({k: v for k, v in tree.items() if k not in ("defaults", "hydra")})


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted path -> leaf value of a nested dict (spec.yaml, a composed config)."""
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}{key}."))
    return flat


def read_run_id(directory: Path) -> str | None:
    """The tracker run id an earlier session of this run directory stored, if any."""
    path = directory / "run_id"
    return path.read_text().strip() or None if path.is_file() else None


def write_run_id(directory: Path, run_id: str) -> None:
    """Store the tracker's run id, so that a resumed session appends to the same tracker run."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "run_id").write_text(run_id + "\n")


class LoggedSteps:
    """The highest step each tag was logged at, kept in a file next to the run id (for trackers that
    cannot drop points: a resumed session skips the steps it replays)."""

    def __init__(self, path: Path, *, keep: bool = True) -> None:
        """`keep`: continue the marks an earlier session left (a resumed run); otherwise start empty."""
        self.path = path
        self.highest: dict[str, int] = json.loads(path.read_text()) if keep and path.is_file() else {}

    def new(self, step: int, values: dict[str, float]) -> dict[str, float]:
        """The values of `step` whose tags do not hold this step yet."""
        return {k: v for k, v in values.items() if step > self.highest.get(k, -1)}

    def mark(self, step: int, tags: list[str]) -> None:
        """Record that `tags` now hold `step` (written atomically: a crash leaves the old file or the new)."""
        if not tags:
            return
        self.highest.update(dict.fromkeys(tags, step))
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(self.highest))
        os.replace(partial, self.path)
