"""The table of a sweep: every point's status and losses, the winner, sweep_summary.json.

`train --multirun` prints it at the end; `train-sweep-status SWEEP_DIR [--wait]`
(`python -m launcher.front.sweep_status SWEEP_DIR`) prints it later, waiting for the points' queued
jobs if asked (each job's state comes from its point's backend: launch.job_state). The winner is the
completed point with the lowest eval loss (else the lowest final loss); in an Optuna sweep the best by its
metric and direction, and the study's trials, best trial and plot follow the table (launcher.front.sweep_study).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launcher.components.files import records
from launcher.components.files.safe_load import RefusedFile
from launcher.config.best import FINISHED
from launcher.front import sweep_study
from launcher.launch import job_state

POINT_FILE = "sweep_point.json"
"""Written into each point's run directory: its index and overrides."""
SUMMARY_FILE = "sweep_summary.json"
"""Written into the sweep directory: every point and the winner."""
ACTIVE = "active"
"""A row's key: its job is queued or running (not written to SUMMARY_FILE, whose rows say it in `status`)."""


def _read_json(path: Path) -> dict[str, Any] | None:
    """A point's JSON object (None when the file is missing, not JSON, or holds no object)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _checked(reader: Callable[[Path], dict[str, Any]], path: Path, problems: list[str]) -> dict[str, Any]:
    """The record `reader` reads from `path`, or {} (missing; a record that does not read back: named in `problems`)."""
    if not path.is_file():
        return {}
    try:
        return reader(path)
    except RefusedFile as err:
        problems.append(str(err))
        return {}


def _point_row(point_dir: Path, metric: str | None = None) -> dict[str, Any]:
    """One point: its overrides, status and results (`problems`: its records that do not read back; `metric`: an
    Optuna sweep's objective, read from summary.json too)."""
    problems: list[str] = []
    record = _checked(records.read_sweep_point, point_dir / POINT_FILE, problems)
    summary = _checked(records.read_summary, point_dir / "summary.json", problems)
    status = "unreadable" if problems else summary.get("exit_reason") or "no summary"  # never a winner
    state = job_state(point_dir)
    known = state is not None and state.state is not None and status not in FINISHED
    if known and (state.active or not summary):
        status = state.state.lower()
    return {
        "point": record.get("num", point_dir.name),
        "run_dir": str(point_dir),
        "overrides": record.get("overrides", []),
        "status": status,
        "job_id": state.job_id if state is not None else None,
        "steps": summary.get("steps"),
        "final_loss": summary.get("final_loss"),
        "eval_loss": summary.get("eval_loss"),
        "problems": problems,
        ACTIVE: known and state.active,
        **({metric: summary.get(metric)} if metric else {}),
    }


def _order(path: Path) -> tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (1 << 30, path.name)


def collect(sweep_dir: Path) -> dict[str, Any]:
    """Every point of the sweep with its status and losses, and the winner among completed points."""
    dirs = [p for p in Path(sweep_dir).iterdir() if p.is_dir() and (p / POINT_FILE).is_file()]
    study = sweep_study.read_record(sweep_dir)  # an Optuna sweep: its metric and direction rank the points
    rows = [_point_row(p, study and study["metric"]) for p in sorted(dirs, key=_order)]
    shared = set.intersection(*(set(r["overrides"]) for r in rows)) if len(rows) > 1 else set()
    for row in rows:  # what tells the points apart (overrides common to all are noise in the table)
        row["swept"] = [o for o in row["overrides"] if o not in shared]
    done = [r for r in rows if r["status"] in FINISHED]
    by = "eval_loss" if done and all(r["eval_loss"] is not None for r in done) else "final_loss"
    by = study["metric"] if study else by
    ranked = [r for r in done if isinstance(r[by], (int, float))]
    pick = max if study and study["direction"] == "maximize" else min
    best = pick(ranked, key=lambda r: r[by]) if ranked else None
    return {
        "sweep_dir": str(sweep_dir),
        "points": rows,
        "winner": best
        and {"point": best["point"], "swept": best["swept"], "run_dir": best["run_dir"], by: best[by]},
        "ranked_by": by,
    }


def _active(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Points whose job is still queued or running."""
    return [r for r in result["points"] if r[ACTIVE]]


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
        lowest = (
            "highest"
            if (sweep_study.read_record(sweep_dir) or {}).get("direction") == "maximize"
            else "lowest"
        )
        console.print(
            f"winner ({lowest} {by.replace('_', ' ')}): point {winner['point']} "
            f"({' '.join(winner['swept'])}), {winner['run_dir']}"
        )
    else:
        console.print("no point has completed yet")
    for row in result["points"]:
        for problem in row["problems"]:
            console.print(f"point {row['point']}: {problem}", markup=False, soft_wrap=True)
    study = sweep_study.report(Path(sweep_dir), console)  # an Optuna sweep's trials, best trial and plot
    tmp = Path(sweep_dir) / f"{SUMMARY_FILE}.tmp"
    rows = [{key: value for key, value in row.items() if key != ACTIVE} for row in result["points"]]
    extra = {"study": study} if study is not None else {}
    tmp.write_text(json.dumps({**result, "points": rows, **extra}, indent=2) + "\n")
    tmp.replace(Path(sweep_dir) / SUMMARY_FILE)
    return result


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def failed(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Points that ended without completing (queued or running ones are not failures)."""
    return [r for r in result["points"] if r["status"] not in FINISHED and r not in _active(result)]


def not_a_sweep(folder: Path) -> str | None:
    """Why `folder` is not a sweep directory (no point of a sweep in it); None when it is one."""
    if any(p.is_dir() and (p / POINT_FILE).is_file() for p in folder.iterdir()):
        return None
    if sweep_study.read_record(folder) is not None:  # an Optuna sweep none of whose trials has started
        return None
    what = f"{folder} is not a sweep: a sweep folder (hydra.sweep.dir of `train --multirun`) holds one folder per point, each with its {POINT_FILE} (and summary.json once the point ends), and this one holds none."
    if (folder / POINT_FILE).is_file():
        return f"{what} It is one point of a sweep: give its parent, {folder.resolve().parent}."
    if (folder / "spec.yaml").is_file():
        return f"{what} It is a single run's directory: its summary.json says how the run ended."
    return f"{what} Give the folder `train --multirun` printed as the sweep's directory."


def main(argv: list[str] | None = None) -> None:
    """`train-sweep-status SWEEP_DIR [--wait]`: the sweep table; status 0 once every point completed."""
    parser = argparse.ArgumentParser(prog="train-sweep-status", description=main.__doc__)
    parser.add_argument("sweep_dir", type=Path, help="the sweep directory (hydra.sweep.dir)")
    parser.add_argument("--wait", action="store_true", help="wait until no point's job is queued or running")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        parser.error(f"{args.sweep_dir} is not a directory")
    problem = not_a_sweep(args.sweep_dir)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    result = report(args.sweep_dir, wait=args.wait)
    sys.exit(0 if all(r["status"] in FINISHED for r in result["points"]) and result["points"] else 1)


if __name__ == "__main__":
    main()
