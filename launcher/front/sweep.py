"""Sweeps: each `--multirun` point in its own run directory, re-runs that skip or resume, the table.

A point's run directory is the sweep's job directory (`SWEEP_DIR/N`). Re-running the same sweep
(`hydra.sweep.dir=SWEEP_DIR`) skips points whose summary.json says completed, leaves points whose
SLURM job is still queued or running alone, and resumes the others from their newest checkpoint.
At the end (Hydra's `on_multirun_end` callback), or later with `train-sweep-status SWEEP_DIR`
(`python -m launcher.front.sweep SWEEP_DIR`), the points are collected into a table, the winner is named
(lowest eval loss, else lowest final loss) and the result is written to SWEEP_DIR/sweep_summary.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

POINT_FILE = "sweep_point.json"
SUMMARY_FILE = "sweep_summary.json"
_IGNORED_KEYS = ("run_dir", "resume", "dry_run", "launcher.slurm.wait")


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _changed_keys(spec_path: Path, cfg: DictConfig) -> list[str]:
    """Keys whose value differs between a point's existing spec.yaml and the config about to run."""
    from launcher.front.compose import strip_hydra
    from launcher.front.dryrun import flatten
    from launcher.spec import redacted_container

    old = OmegaConf.to_container(OmegaConf.load(spec_path), resolve=False)
    old = flatten({k: v for k, v in old.items() if k not in ("defaults", "hydra")})
    new = flatten(redacted_container(strip_hydra(cfg)))
    keys = sorted(set(old) | set(new))
    return [k for k in keys if not k.startswith(_IGNORED_KEYS) and old.get(k) != new.get(k)]


def _active_job(point_dir: Path) -> str | None:
    """The id of this point's SLURM job while it is queued or running, else None."""
    from launcher.launch import slurm_jobs

    job_file = point_dir / "slurm" / "job_id"
    if not job_file.is_file():
        return None
    job_id = job_file.read_text().strip()
    try:
        state = slurm_jobs.job_state(job_id)
    except (ValueError, slurm_jobs.SlurmError):
        return None
    return f"{job_id} ({state.state})" if state is not None and state.active else None


def prepare_point(cfg: DictConfig) -> int | None:
    """In a --multirun: skip a finished point (its exit status), else set run_dir and resume=auto.

    Returns None when the point should run. A point directory that holds a run of other settings
    (the sweep's parameters changed under the same sweep dir) is refused with status 2.
    """
    from hydra.core.hydra_config import HydraConfig

    from launcher.front.cli import err_console, make_run_dir

    if not _in_multirun() or cfg.get("dry_run"):
        return None
    hc = HydraConfig.get()
    point_dir = Path(cfg.run_dir) if cfg.get("run_dir") else Path(hc.sweep.dir) / str(hc.sweep.subdir)
    label = f"sweep point {hc.job.num}"
    if (point_dir / "spec.yaml").is_file():
        changed = _changed_keys(point_dir / "spec.yaml", cfg)
        if changed:
            err_console.print(
                f"error: {label}: {point_dir} holds a run with other settings ({', '.join(changed[:6])}). "
                "Re-run a sweep with its original parameters, or give a new hydra.sweep.dir.",
                markup=False,
                soft_wrap=True,
            )
            return 2
    summary = _read_json(point_dir / "summary.json") or {}
    if summary.get("exit_reason") == "completed":
        print(f"{label}: already completed in {point_dir}, skipped")
        return 0
    job = _active_job(point_dir)
    if job is not None:
        print(f"{label}: SLURM job {job} is still queued or running, not submitted again")
        return 0
    from launcher.groups import checkpoint

    if cfg.get("resume") is None and checkpoint.good_checkpoints(point_dir, warn=False):
        cfg.resume = "auto"
        print(f"{label}: resuming from its newest checkpoint in {point_dir}")
    cfg.run_dir = str(point_dir)
    make_run_dir(point_dir)
    record = {"num": hc.job.num, "overrides": list(hc.overrides.task)}
    (point_dir / POINT_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return None


def _point_row(point_dir: Path) -> dict[str, Any]:
    """One point: its overrides, status and results."""
    record = _read_json(point_dir / POINT_FILE) or {}
    summary = _read_json(point_dir / "summary.json") or {}
    job_file = point_dir / "slurm" / "job_id"
    job_id = job_file.read_text().strip() if job_file.is_file() else None
    status = summary.get("exit_reason") or "no summary"
    if job_id is not None and status != "completed":
        from launcher.launch import slurm_jobs

        try:
            state = slurm_jobs.job_state(job_id)
        except (ValueError, slurm_jobs.SlurmError):
            state = None
        if state is not None and (state.active or not summary):
            status = state.state.lower()
    return {
        "point": record.get("num", point_dir.name),
        "run_dir": str(point_dir),
        "overrides": record.get("overrides", []),
        "status": status,
        "job_id": job_id,
        "steps": summary.get("steps"),
        "final_loss": summary.get("final_loss"),
        "eval_loss": summary.get("eval_loss"),
    }


def _order(path: Path) -> tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (1 << 30, path.name)


def collect(sweep_dir: Path) -> dict[str, Any]:
    """Every point of the sweep with its status and losses, and the winner among completed points."""
    dirs = [p for p in Path(sweep_dir).iterdir() if p.is_dir() and (p / POINT_FILE).is_file()]
    rows = [_point_row(p) for p in sorted(dirs, key=_order)]
    shared = set.intersection(*(set(r["overrides"]) for r in rows)) if len(rows) > 1 else set()
    for row in rows:  # what tells the points apart (overrides common to all are noise in the table)
        row["swept"] = [o for o in row["overrides"] if o not in shared]
    done = [r for r in rows if r["status"] == "completed"]
    by = "eval_loss" if done and all(r["eval_loss"] is not None for r in done) else "final_loss"
    ranked = [r for r in done if r[by] is not None]
    best = min(ranked, key=lambda r: r[by]) if ranked else None
    return {
        "sweep_dir": str(sweep_dir),
        "points": rows,
        "winner": best
        and {"point": best["point"], "swept": best["swept"], "run_dir": best["run_dir"], by: best[by]},
        "ranked_by": by,
    }


def _active(result: dict[str, Any]) -> list[dict[str, Any]]:
    from launcher.launch.slurm_jobs import ACTIVE_STATES

    return [r for r in result["points"] if r["status"].upper() in ACTIVE_STATES]


def report(sweep_dir: Path, *, wait: bool = False, poll_s: float = 2.0) -> dict[str, Any]:
    """Collect (waiting for queued jobs if asked), print the table and write sweep_summary.json."""
    from rich.console import Console
    from rich.table import Table

    result = collect(sweep_dir)
    while wait and _active(result):
        time.sleep(poll_s)
        result = collect(sweep_dir)
    by, winner = result["ranked_by"], result["winner"]
    table = Table(title=f"sweep {sweep_dir}", title_justify="left")
    for column in ("point", "overrides", "status", "steps", "final loss", "eval loss", "job"):
        table.add_column(column, overflow="fold")
    for row in result["points"]:
        mark = " *" if winner and row["point"] == winner["point"] else ""
        table.add_row(
            f"{row['point']}{mark}", " ".join(row["swept"]), row["status"], str(row["steps"] or "-"),
            _num(row["final_loss"]), _num(row["eval_loss"]), row["job_id"] or "-",
        )  # fmt: skip
    console = Console(highlight=False) if Console().is_terminal else Console(highlight=False, width=160)
    console.print(table)
    if winner:
        console.print(
            f"winner (lowest {by.replace('_', ' ')}): point {winner['point']} "
            f"({' '.join(winner['swept'])}), {winner['run_dir']}"
        )
    else:
        console.print("no point has completed yet")
    tmp = Path(sweep_dir) / f"{SUMMARY_FILE}.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(Path(sweep_dir) / SUMMARY_FILE)
    return result


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def failed(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Points that ended without completing (queued or running ones are not failures)."""
    return [r for r in result["points"] if r["status"] != "completed" and r not in _active(result)]


class SweepSummary(Callback):
    """Hydra callback: print and write the sweep table once every point has run or been queued."""

    def __init__(self) -> None:
        self.codes: list[int] = []

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        """Remember each point's exit status (an exception counts as 1)."""
        from hydra.core.utils import JobStatus

        ok = job_return.status == JobStatus.COMPLETED
        self.codes.append(int(job_return.return_value or 0) if ok else 1)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Report the sweep; exit with the worst point's status (1 if a point failed)."""
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir() or config.get("dry_run"):
            return
        launcher = config.get("launcher") or {}
        wait = launcher.get("backend") == "slurm" and bool(launcher.get("slurm", {}).get("wait", True))
        if wait:
            print(
                "waiting for the sweep's SLURM jobs (launcher.slurm.wait=false returns at once)", flush=True
            )
        result = report(sweep_dir, wait=wait)
        worst = max(self.codes, default=0)
        if worst or failed(result):
            sys.exit(worst or 1)


def main(argv: list[str] | None = None) -> None:
    """`train-sweep-status SWEEP_DIR [--wait]`: the sweep table; status 0 once every point completed."""
    parser = argparse.ArgumentParser(prog="train-sweep-status", description=main.__doc__)
    parser.add_argument("sweep_dir", type=Path, help="the sweep directory (hydra.sweep.dir)")
    parser.add_argument("--wait", action="store_true", help="wait until no point's job is queued or running")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        parser.error(f"{args.sweep_dir} is not a directory")
    result = report(args.sweep_dir, wait=args.wait)
    sys.exit(0 if all(r["status"] == "completed" for r in result["points"]) and result["points"] else 1)


if __name__ == "__main__":
    main()
