"""The Optuna study of a Bayesian sweep: where it is stored, its trials, the best one and the plot.

`train -m hydra/sweeper=optuna` (launcher.front.optuna_sweep) writes `sweep_study.json` into the sweep
folder (the study's storage, name, metric and direction); the study itself lives in `optuna.db`
there (SQLite) unless `hydra.sweeper.storage` names another database. `train-sweep-status` reads
both: the trials (invalid and failed ones with their reason), the best trial, the parameters'
importances (mean decrease in impurity of a random forest, scikit-learn: optuna 2.10's default fANOVA
evaluator does not run on current scikit-learn), and `optuna.png`, the optimisation history and the
importances side by side (matplotlib).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

STUDY_FILE = "sweep_study.json"
"""Written into the sweep folder of an Optuna sweep: storage, study name, metric and direction."""
DB_FILE = "optuna.db"
"""The study's SQLite database in the sweep folder (when hydra.sweeper.storage is not set)."""
PLOT_FILE = "optuna.png"
"""The optimisation history and the parameters' importances, written by `train-sweep-status`."""
EXTRA_HINT = "pip install 'torch-launcher[sweep]' (scripts/install installs it)"
"""How to install what the Optuna sweeper needs."""
DEFAULT_STUDY = "sweep"
"""The study's name when hydra.sweeper.study_name is not set (a fixed name: a re-run finds it)."""


def missing_module() -> str | None:
    """The first module of the `sweep` extra that does not import, None when all do."""
    import importlib.util

    for name in ("optuna", "hydra_plugins.hydra_optuna_sweeper", "sqlalchemy"):
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except ImportError:
            return name
    return None


def import_optuna() -> Any:
    """optuna, quiet: its info lines off, and SQLAlchemy 1.4's notice about 2.0 (optuna 2.10 needs 1.4) silenced."""
    import os

    os.environ.setdefault("SQLALCHEMY_SILENCE_UBER_WARNING", "1")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def storage_url(sweep_dir: Path, storage: str | None) -> str:
    """The study's storage: hydra.sweeper.storage, else SQLite in the sweep folder."""
    return storage or f"sqlite:///{(Path(sweep_dir) / DB_FILE).resolve()}"


def write_record(sweep_dir: Path, record: dict[str, Any]) -> None:
    """Write sweep_study.json (storage null: optuna.db beside it, so the folder can move)."""
    path = Path(sweep_dir) / STUDY_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)


def read_record(sweep_dir: Path) -> dict[str, Any] | None:
    """sweep_study.json of an Optuna sweep, None for a grid sweep (or a record that does not read)."""
    try:
        record = json.loads((Path(sweep_dir) / STUDY_FILE).read_text())
    except (OSError, ValueError):
        return None
    fields_ok = isinstance(record, dict) and isinstance(record.get("metric"), str)
    return record if fields_ok and record.get("direction") in ("minimize", "maximize") else None


def load(sweep_dir: Path, record: dict[str, Any]) -> Any:
    """The sweep's study, from its storage."""
    optuna = import_optuna()
    url = storage_url(sweep_dir, record.get("storage"))
    return optuna.load_study(study_name=record.get("study_name") or DEFAULT_STUDY, storage=url)


def summarize(study: Any, record: dict[str, Any]) -> dict[str, Any]:
    """Every trial (state, value, params, run_dir, problem), the best one and the importances."""
    trials = [
        {
            "trial": t.number,
            "state": t.state.name.lower(),
            "value": t.value,
            "params": dict(t.params),
            "run_dir": t.user_attrs.get("run_dir"),
            "problem": t.user_attrs.get("problem"),
        }
        for t in study.trials
    ]
    done = [t for t in trials if t["state"] == "complete" and t["value"] is not None]
    pick = min if record["direction"] == "minimize" else max
    best = pick(done, key=lambda t: t["value"]) if done else None
    return {"metric": record["metric"], "direction": record["direction"], "trials": trials,
            "best": best, "importances": importances(study)}  # fmt: skip


def importances(study: Any) -> dict[str, float]:
    """Each parameter's importance to the objective ({} under two complete trials or without scikit-learn)."""
    import optuna

    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if len(complete) < 2:
        return {}
    try:
        evaluator = optuna.importance.MeanDecreaseImpurityImportanceEvaluator(seed=0)
        return dict(optuna.importance.get_param_importances(study, evaluator=evaluator))
    except (ImportError, RuntimeError, ValueError):  # no scikit-learn, or one value everywhere
        return {}


def plot(summary: dict[str, Any], path: Path) -> str | None:
    """Draw the optimisation history and the importances into `path` (PNG); why not, when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"no plot: matplotlib is not installed ({EXTRA_HINT})"
    metric, trials = summary["metric"], [t for t in summary["trials"] if t["state"] == "complete"]
    fig, (history, bars) = plt.subplots(1, 2, figsize=(11, 4))
    xs, ys = [t["trial"] for t in trials], [t["value"] for t in trials]
    history.scatter(xs, ys, label=metric, color="tab:blue")
    best, running = [], math.inf if summary["direction"] == "minimize" else -math.inf
    for y in ys:
        running = min(running, y) if summary["direction"] == "minimize" else max(running, y)
        best.append(running)
    history.step(xs, best, where="post", color="tab:red", label=f"best {metric}")
    history.set(xlabel="trial", ylabel=metric, title="optimisation history")
    history.legend()
    names = list(summary["importances"])[::-1]
    bars.barh(names, [summary["importances"][n] for n in names], color="tab:green")
    bars.set(xlabel="importance", title="parameter importances" if names else "importances: too few trials")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def report(sweep_dir: Path, console: Any) -> dict[str, Any] | None:
    """Print the study's trials and best trial under the sweep table and write optuna.png; None for a grid sweep."""
    record = read_record(sweep_dir)
    if record is None:
        return None
    if missing_module() is not None:
        console.print(f"the Optuna study is not shown: {missing_module()} is missing ({EXTRA_HINT})")
        return None
    summary = summarize(load(sweep_dir, record), record)
    counts: dict[str, int] = {}
    for t in summary["trials"]:
        counts[t["state"]] = counts.get(t["state"], 0) + 1
    states = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    console.print(
        f"study: {len(summary['trials'])} trial(s) ({states}), {summary['direction']} {summary['metric']}"
    )
    for t in summary["trials"]:
        if t["problem"]:
            console.print(f"trial {t['trial']} ({t['state']}): {t['problem']}", markup=False, soft_wrap=True)
    best = summary["best"]
    if best:
        params = " ".join(f"{k}={v}" for k, v in best["params"].items())
        console.print(
            f"best trial: {best['trial']}, {summary['metric']} {best['value']:.4f} ({params}), {best['run_dir']}"
        )
    if summary["importances"]:
        console.print("importances: " + ", ".join(f"{k} {v:.2f}" for k, v in summary["importances"].items()))
    problem = plot(summary, Path(sweep_dir) / PLOT_FILE) if best else "no plot: no trial has completed yet"
    console.print(problem or f"plot: {Path(sweep_dir) / PLOT_FILE}", markup=False, soft_wrap=True)
    return summary
