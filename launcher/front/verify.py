"""`train verify_resume=true`: prove that this very spec resumes exactly, before trusting it for days.

The spec runs twice under the run directory, through its own launch backend: `straight/` trains
N = train.max_steps steps; `split/` stops after N/2 steps (train.stop_after, with a checkpoint)
and a second launch resumes it to N. Metrics are logged every step in both, and the per-step
losses are compared. On a CPU training is deterministic, so they must be bitwise equal; on GPUs
some kernels reduce in a varying order, so a small relative tolerance is allowed (see
`tolerance`). Exit status 0 when the curves agree, 1 otherwise (a phase that fails: its own status).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from launcher.exits import ExitStatus
from launcher.front import rundir
from launcher.spec import RunSpec


def tolerance(spec: RunSpec, device_type: str) -> float:
    """Relative loss difference accepted: 0 on CPU (deterministic), else 1e-5 fp32, 1e-3 bf16/fp16."""
    if device_type == "cpu":
        return 0.0
    # CUDA reductions (atomics, split-K) may sum in another order after a restart; bf16/fp16 round
    # each of those sums to 8/11 mantissa bits, hence the looser bound.
    return 1e-3 if spec.precision.bf16 or spec.precision.fp16 else 1e-5


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """How two loss curves compare."""

    identical: bool
    """Same steps and bitwise-equal losses."""
    within_tolerance: bool
    """Same steps and every relative difference at most the tolerance."""
    max_abs_diff: float
    """Largest absolute loss difference over the common steps."""
    first_diff_step: int | None
    """First step whose losses differ at all (None when identical)."""
    message: str
    """The verdict, one paragraph."""


def compare(straight: dict[int, float], split: dict[int, float], tol: float) -> Verdict:
    """Compare per-step losses of the straight and the split-and-resumed runs."""
    if straight.keys() != split.keys():
        missing = sorted(straight.keys() ^ split.keys())
        text = f"the runs logged different steps (only in one of them: {missing[:10]})"
        return Verdict(
            identical=False,
            within_tolerance=False,
            max_abs_diff=float("inf"),
            first_diff_step=None,
            message=text,
        )
    diffs = {s: abs(straight[s] - split[s]) for s in sorted(straight)}
    first = next((s for s, d in diffs.items() if d != 0.0), None)
    worst = max(diffs.values(), default=0.0)
    ok = all(diffs[s] <= tol * abs(straight[s]) for s in diffs)
    if first is None:
        text = f"identical: all {len(diffs)} per-step losses are bitwise equal"
    else:
        text = (
            f"{'within tolerance' if ok else 'DIFFERENT'}: first differing step {first} "
            f"({straight[first]!r} straight vs {split[first]!r} resumed), max abs diff {worst:.3g} "
            f"(relative tolerance {tol:g})"
        )
    return Verdict(
        identical=first is None, within_tolerance=ok, max_abs_diff=worst, first_diff_step=first, message=text
    )


def _phase_cfg(cfg: DictConfig, run_dir: Path, *, stop_after: int | None, resume: str | None) -> DictConfig:
    """The user's config for one phase of the check, in its own run directory."""
    sub = copy.deepcopy(cfg)
    for key, value in {
        "verify_resume": False,
        "run_dir": str(run_dir),
        "resume": resume,
        "train.stop_after": stop_after,
        "train.log_every": 1,
        "checkpoint.save_final": True,
    }.items():
        OmegaConf.update(sub, key, value, merge=False)
    return sub


def run(cfg: DictConfig, spec: RunSpec, run_dir: Path) -> int:
    """Run the check under `run_dir` and print the verdict; 0 when the curves agree."""
    from launcher.components.device import resolve_device
    from launcher.components.metrics import read_metrics

    console = Console(highlight=False)
    n = spec.train.max_steps
    phases = [
        ("straight", _phase_cfg(cfg, run_dir / "straight", stop_after=None, resume=None)),
        ("split", _phase_cfg(cfg, run_dir / "split", stop_after=n // 2, resume=None)),
        ("resumed", _phase_cfg(cfg, run_dir / "split", stop_after=None, resume="auto")),
    ]
    for name, phase in phases:
        console.print(f"verify_resume: {name} run in {phase.run_dir}")
        code = rundir.validate_and_start(phase, Path(phase.run_dir))
        if code != ExitStatus.OK:
            console.print(f"verify_resume: the {name} run failed (exit status {code}); no verdict.")
            return ExitStatus.FAILED

    def curve(path: Path) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in read_metrics(path / "metrics.jsonl") if "loss" in r}

    tol = tolerance(spec, resolve_device(spec.launcher.device))
    verdict = compare(curve(run_dir / "straight"), curve(run_dir / "split"), tol)
    good = verdict.identical or verdict.within_tolerance
    console.print(
        f"verify_resume: {n} steps straight vs {n // 2} + resume to {n}: {verdict.message}. "
        f"{'PASS' if good else 'FAIL'}",
        soft_wrap=True,
    )
    return ExitStatus.OK if good else ExitStatus.FAILED
