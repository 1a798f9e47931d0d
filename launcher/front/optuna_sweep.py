"""`train -m hydra/sweeper=optuna`: a Bayesian sweep through Hydra's Optuna sweeper, each trial a validated run.

Hydra's Optuna sweeper (hydra-optuna-sweeper) gives the settings (`hydra.sweeper.n_trials`, `n_jobs`,
`direction`, `sampler`, `storage`, `study_name`, `params`) and turns sweep overrides into Optuna
distributions (`interval(a,b)`, `tag(log, interval(a,b))`, `range(...)`, `choice(...)`, `a,b`); `train`
drives the study itself, so each trial keeps the launcher's guarantees. A trial's point is composed
and validated before it starts: an invalid one is reported, marked failed in the study (its reason
kept) and the sweep goes on. A trial runs through the one launch sequence in `SWEEP_DIR/<trial>`
(launcher.front.sweep); its objective is `sweep.metric` (eval_loss by default) of its summary.json.
`n_jobs` trials are asked at once: on a backend that submits (launch.Submitter) they are submitted,
then collected; otherwise one runs in this process, several as `train` processes side by side.
The study lives in SWEEP_DIR/optuna.db, so the same command again continues it: trials an earlier
sweep left running resume from their checkpoints, and only the trials still missing are asked (a seeded
sampler's seed is offset by the trials so far, so a continued study does not draw its first points again).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape

from launcher.config.best import FINISHED
from launcher.exits import ExitStatus
from launcher.front import compose, rundir, sweep, sweep_status, sweep_study
from launcher.front.command_line import CONFIG_FLAGS, CommandLine
from launcher.front.override_checks import OPTUNA, parse_error
from launcher.spec import SpecError

SAMPLERS = ("TPESampler", "RandomSampler", "CmaEsSampler", "NSGAIISampler", "MOTPESampler")
"""The samplers of hydra/sweeper/sampler a study may use (grid: `train -m key=a,b` is the grid sweep)."""
STOPPED = (ExitStatus.INTERRUPTED, ExitStatus.TERMINATED, ExitStatus.PREEMPTED)
"""A trial that ended so stays running in the study: the sweep stops, and its re-run resumes the trial."""


def requested(line: CommandLine) -> bool:
    """Whether the command line asks for the Optuna sweeper."""
    return OPTUNA in line.overrides


@dataclass(kw_only=True)
class Study:
    """An Optuna sweep's settings, checked."""

    sweep_dir: Path
    """hydra.sweep.dir: the trials' run directories, sweep_study.json and optuna.db."""
    plain: list[str]
    """The overrides every trial shares (the sweeper's own removed)."""
    search: dict[str, Any]
    """Swept key -> its Optuna distribution."""
    sweeper: DictConfig
    """hydra.sweeper as composed."""
    metric: str
    """The summary.json number each trial reports."""
    flags: list[str] = field(default_factory=list)
    """The config flags (--config-dir, ...) a trial's own `train` process is given."""


def _split(overrides: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(sweep overrides, the sweeper's settings, plain overrides)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    swept, sweeper, plain = [], [], []
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        if key.startswith(("hydra/sweeper", "hydra.sweeper")):
            sweeper.append(override.input_line)
        elif override.is_sweep_override():
            swept.append(override.input_line)
        else:
            plain.append(override.input_line)
    return swept, sweeper, plain


def _settings(sweeper: DictConfig) -> list[SpecError]:
    """Sweeper settings `train` cannot run: counts below one, several directions, a grid or unknown sampler."""
    errors: list[SpecError] = []
    for key in ("n_trials", "n_jobs"):
        if not isinstance(sweeper[key], int) or sweeper[key] < 1:
            errors.append(SpecError((f"hydra.sweeper.{key}",), f"must be 1 or more, got {sweeper[key]}."))
    direction = _direction(sweeper)
    if direction not in ("minimize", "maximize"):
        errors.append(
            SpecError(
                ("hydra.sweeper.direction",),
                f"must be minimize or maximize (one objective: sweep.metric), got {direction}.",
            )
        )
    target = str(sweeper.sampler.get("_target_", ""))
    if target.rpartition(".")[2] not in SAMPLERS or not target.startswith("optuna.samplers."):
        errors.append(
            SpecError(
                ("hydra/sweeper/sampler",),
                f"sampler {target} is not run by `train`: choose tpe, random, cmaes, nsgaii or motpe "
                "(hydra/sweeper/sampler=tpe); a grid is `train -m key=a,b` without the Optuna sweeper.",
            )
        )
    return errors


def plan(line: CommandLine) -> tuple[Study | None, list[SpecError]]:
    """Check the sweep's command line, settings, search space and shared config; nothing is written."""
    missing = sweep_study.missing_module()
    if missing is not None:
        return None, [SpecError((OPTUNA,), f"the Optuna sweeper needs {missing}: {sweep_study.EXTRA_HINT}.")]
    if not line.multirun:
        return None, [SpecError((OPTUNA,), "the Optuna sweeper runs a sweep: add --multirun (-m).")]
    overrides = list(line.overrides)
    try:
        swept, sweeper, plain = _split(overrides)
    except Exception as err:  # Hydra's grammar error names the bad override
        return None, [parse_error(err, overrides)]
    errors = compose.check_overrides(overrides, compose.user_dirs(overrides, line.source))
    if errors:
        return None, errors
    cfg, errors = compose.compose_checked([*plain, *sweeper], line.source)
    if cfg is None:
        return None, errors
    errors = _settings(cfg.hydra.sweeper)
    params = [f"{k}={v}" for k, v in (cfg.hydra.sweeper.get("params") or {}).items()]
    search, fixed, errors = _search([*params, *swept], errors)
    plain += fixed  # hydra.sweeper.params may also give a key one value
    errors += _same_objective(Path(str(cfg.hydra.sweep.dir)), str(cfg.sweep.metric), cfg.hydra.sweeper)
    if cfg.get("run_dir"):
        errors.append(SpecError(("run_dir",), "each trial runs in hydra.sweep.dir/<trial>: remove run_dir."))
    base = compose.build(cfg)  # what every trial shares, judged once: its problems would fail every trial
    errors += [e for e in base.errors if not set(e.keys) & set(search)]
    errors += _evaluates(base, search)
    if errors:
        return None, errors
    flags = [token for f in line.flags if f.name in CONFIG_FLAGS for token in f.tokens]
    return Study(
        sweep_dir=Path(str(cfg.hydra.sweep.dir)), plain=plain, search=search, sweeper=cfg.hydra.sweeper,
        metric=str(cfg.sweep.metric), flags=flags,
    ), []  # fmt: skip


def _evaluates(base: compose.Built, search: dict[str, Any]) -> list[SpecError]:
    """An eval_* metric on runs that end without a held-out evaluation: every trial would fail."""
    spec = base.spec
    decides = {"train.max_steps", "train.eval_every", "train.eval_at_end"} & set(search)
    if spec is None or decides or not spec.sweep.metric.startswith("eval_") or spec.train.evaluates_at_end():
        return []
    return [
        SpecError(
            ("sweep.metric", "train.eval_at_end"),
            f"sweep.metric={spec.sweep.metric} is read from the evaluation after a trial's last step, which "
            f"these runs do not make (train.max_steps={spec.train.max_steps} < train.eval_every="
            f"{spec.train.eval_every}). Set train.eval_at_end=true, or choose another sweep.metric.",
        )
    ]


def _direction(sweeper: DictConfig) -> str:
    """hydra.sweeper.direction as a name (the plugin's enum, or the string given)."""
    value = OmegaConf.to_container(sweeper, resolve=True)["direction"]
    return str(getattr(value, "name", value))


def _same_objective(sweep_dir: Path, metric: str, sweeper: DictConfig) -> list[SpecError]:
    """A re-run that would tell the study another metric or direction than its earlier trials, refused."""
    record = sweep_study.read_record(sweep_dir)
    if record is None or (record["metric"], record["direction"]) == (metric, _direction(sweeper)):
        return []
    return [
        SpecError(
            ("sweep.metric", "hydra.sweeper.direction"),
            f"the study in {sweep_dir} was run to {record['direction']} {record['metric']}: its trials' values "
            "would not compare. Re-run it with those settings, or give a new hydra.sweep.dir.",
        )
    ]


def _search(swept: list[str], errors: list[SpecError]) -> tuple[dict[str, Any], list[str], list[SpecError]]:
    """The search space of the sweep overrides (and hydra.sweeper.params) as Optuna distributions, and the
    plain overrides among them."""
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    try:
        search, fixed = create_params_from_overrides(swept)
    except Exception as err:  # the plugin asserts on a choice it cannot encode
        return {}, [], [*errors, SpecError(("command line",), f"the search space does not parse: {err}")]
    if not search:
        errors.append(
            SpecError(
                ("command line",),
                "the Optuna sweep has no search space: sweep at least one key, e.g. "
                "'optimizer.lr=tag(log, interval(1e-5, 1e-2))' or 'scheduler.warmup_steps=range(0, 50, 10)'.",
            )
        )
    return search, [f"{key}={value}" for key, value in fixed.items()], errors


def _open(study: Study) -> Any:
    """Create or load the study (sqlite in the sweep folder by default) and write sweep_study.json."""
    from hydra.utils import instantiate

    optuna = sweep_study.import_optuna()
    settings = OmegaConf.to_container(study.sweeper, resolve=True)
    direction = _direction(study.sweeper)
    rundir.make_run_dir(study.sweep_dir)
    record = {"storage": settings.get("storage"), "study_name": settings.get("study_name") or sweep_study.DEFAULT_STUDY,
              "metric": study.metric, "direction": direction}  # fmt: skip
    sweep_study.write_record(study.sweep_dir, record)
    opened = optuna.create_study(
        study_name=record["study_name"], storage=sweep_study.storage_url(study.sweep_dir, record["storage"]),
        sampler=instantiate(study.sweeper.sampler), direction=direction, load_if_exists=True,
    )  # fmt: skip
    seed, done = study.sweeper.sampler.get("seed"), len(opened.trials)
    if seed is not None and done:  # a seeded sampler restarted would draw the earlier trials' points again
        opened.sampler = instantiate(study.sweeper.sampler, seed=seed + done)
    return opened


def _point(study: Study, line: CommandLine, trial: Any) -> tuple[sweep.Point | None, list[SpecError]]:
    """The trial's run: its parameters suggested, composed and validated in SWEEP_DIR/<subdir>."""
    for name, distribution in study.search.items():
        trial._suggest(name, distribution)  # the sweeper plugin's own way to draw a distribution
    overrides = [*study.plain, *(f"{name}={value}" for name, value in trial.params.items())]
    cfg, problems = compose.compose_checked(overrides, line.source)
    if cfg is None:
        return None, [
            SpecError(e.keys, f"trial {trial.number} ({' '.join(overrides)}): {e.message}") for e in problems
        ]
    run_dir = study.sweep_dir / sweep.subdir(cfg, trial.number, overrides)
    point = sweep.Point(num=trial.number, overrides=overrides, cfg=cfg, run_dir=run_dir)
    trial.set_user_attr("run_dir", str(run_dir))
    return point, sweep.prepare(point, label="trial")


def _objective(run_dir: Path, metric: str) -> tuple[float | None, str | None]:
    """The trial's value from its summary.json, or why it has none."""
    summary = sweep_status._read_json(run_dir / "summary.json") or {}
    if summary.get("exit_reason") not in FINISHED:
        return None, f"the run ended {summary.get('exit_reason') or 'without a summary.json'} ({run_dir})"
    value = summary.get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None, f"{run_dir}/summary.json holds no number {metric} ({value!r})"
    return float(value), None


def _child(study: Study, point: sweep.Point) -> subprocess.Popen:
    """The trial as its own `train` process (trials side by side), its output in RUN_DIR/trial.log."""
    sweep.write_record(point)
    resume = ["resume=auto"] if point.spec.resume == "auto" and point.cfg.get("resume") is None else []
    argv = [
        sys.executable,
        "-m",
        "launcher",
        *study.flags,
        *point.overrides,
        f"run_dir={point.run_dir}",
        *resume,
    ]
    with open(point.run_dir / "trial.log", "ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


def _run_batch(study: Study, points: list[sweep.Point], console: Console) -> list[int]:
    """Run the batch's valid, unfinished points; their exit statuses, in order.

    Points on a backend that submits are queued first and collected last; of the others one runs in this
    process, several side by side as their own `train` processes.
    """
    codes = {p.num: sweep.start(p, console) for p in points if p.submitter is not None}
    here = [p for p in points if p.submitter is None]
    if len(here) == 1:
        codes[here[0].num] = sweep.start(here[0], console)
    elif here:
        console.print(f"{len(here)} trials side by side; each one's output in its trial.log")
        children = [(p, _child(study, p)) for p in here]
        codes.update({p.num: child.wait() for p, child in children})
    for p in points:
        if p.submitter is not None and codes[p.num] == ExitStatus.OK:
            codes[p.num] = p.submitter.collect(p.run_dir)
    return [codes[p.num] for p in points]


def _tell(optuna_study: Any, trial: Any, point: sweep.Point | None, metric: str, console: Console) -> None:
    """Report the trial's value to the study, or mark it failed with its reason."""
    import optuna

    if point is None:  # its problems were reported when it was composed
        optuna_study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        console.print(f"trial {trial.number} failed: an invalid point (above); the sweep goes on")
        return
    value, problem = _objective(point.run_dir, metric)
    if value is not None:
        optuna_study.tell(trial.number, value)
        console.print(f"trial {trial.number}: {metric} {value:.4f}")
        return
    trial.set_user_attr("problem", problem)
    optuna_study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
    console.print(f"trial {trial.number} failed: {problem}", markup=False, soft_wrap=True)


def _batch(study: Study, line: CommandLine, optuna_study: Any, trials: list[Any], console: Console) -> int:
    """Compose, validate, run and report one batch of trials; a stopping exit status, else 0."""
    points: list[sweep.Point | None] = []
    for trial in trials:
        point, errors = _point(study, line, trial)
        if errors:  # reported, recorded in the study, and the sweep goes on
            rundir.report(errors)
            trial.set_user_attr("problem", "invalid: " + " ".join(str(e) for e in errors))
            point = None
        points.append(point)
    runnable = [p for p in points if p is not None and p.skip is None]
    for p in runnable:
        console.print(f"trial {p.num}: {escape(' '.join(p.overrides[len(study.plain) :]))} -> {p.run_dir}")
    codes = dict(zip((p.num for p in runnable), _run_batch(study, runnable, console), strict=True))
    stopped = [code for code in codes.values() if code in STOPPED]
    for trial, point in zip(trials, points, strict=True):
        if codes.get(trial.number) not in STOPPED:
            _tell(optuna_study, trial, point, study.metric, console)
    return stopped[0] if stopped else 0


def run(line: CommandLine) -> int:
    """Run (or continue) the Optuna sweep; 0 once the study has a completed trial, 1 without, 2 invalid."""

    console = Console(highlight=False, soft_wrap=True)
    study, errors = plan(line)
    if errors or study is None:
        rundir.report(errors)
        return ExitStatus.INVALID_SPEC
    optuna_study = _open(study)
    optuna = sweep_study.import_optuna()
    n_trials, n_jobs = study.sweeper.n_trials, study.sweeper.n_jobs
    left = [optuna.trial.Trial(optuna_study, t._trial_id) for t in optuna_study.trials
            if t.state == optuna.trial.TrialState.RUNNING]  # fmt: skip
    console.print(
        f"sweep: Optuna study in {study.sweep_dir}: {len(optuna_study.trials) - len(left)} of {n_trials} "
        f"trial(s) done, {len(left)} to resume"
    )
    while left or len(optuna_study.trials) < n_trials:
        batch = left[:n_jobs] or [
            optuna_study.ask() for _ in range(min(n_jobs, n_trials - len(optuna_study.trials)))
        ]
        left = left[len(batch) :] if left else []
        code = _batch(study, line, optuna_study, batch, console)
        if code:
            console.print(f"sweep stopped (exit status {code}); the same command resumes its trials")
            return code
    sweep_status.report(study.sweep_dir)
    complete = [t for t in optuna_study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    return ExitStatus.OK if complete else ExitStatus.FAILED
