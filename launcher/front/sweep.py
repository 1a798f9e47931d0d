"""`train --multirun`: every point of a sweep composed and validated before any starts, each in its own run directory.

The sweep's points are the combinations of its sweep overrides (`key=a,b`, `range(...)`,
`choice(...)`; the last key varies fastest, as with Hydra's basic sweeper). Each point is composed
once and validated with its run directory and resume setting, so every problem of every point is
reported before anything starts (exit status 2). A point's run directory is `SWEEP_DIR/N`
(`hydra.sweep.dir`, `hydra.sweep.subdir`). Re-running the same sweep skips points whose
summary.json says completed, leaves points whose submitted job is still queued or running alone,
resumes the others from their newest checkpoint, and refuses a point directory that holds a run
of other settings. The points then run one after another through the one launch sequence
(launcher.front.rundir); on a backend that submits to a scheduler (launch.Submitter) every point is
submitted first, then the jobs of those whose spec asks to wait are collected. The table comes last
(launcher.front.sweep_status).
"""

from __future__ import annotations

import copy
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape  # overrides such as hydra.searchpath=[...] are not markup

from launcher.components import checkpoint
from launcher.config.best import FINISHED
from launcher.config.redact import redacted_container
from launcher.exits import ExitStatus
from launcher.front import compose, dryrun, rundir, sweep_status
from launcher.front.command_line import CommandLine
from launcher.front.config_values import with_values
from launcher.launch import BACKENDS, Submitter, job_state, submitter
from launcher.spec import RunSpec, SpecError

_IGNORED_KEYS = ("run_dir", "resume", "dry_run")
"""Keys that may differ between a point's earlier run and its re-run (and whether its backend waits)."""


@dataclass(kw_only=True)
class Point:
    """One combination of a sweep, composed and validated."""

    num: int
    """Index in the sweep (the default subdirectory name)."""
    overrides: list[str]
    """The plain overrides of this combination."""
    cfg: DictConfig
    """The composed config."""
    run_dir: Path
    """The point's run directory."""
    built: compose.Built | None = None
    """The point's config with run_dir and resume set and its decided values filled in, and its validated spec."""
    skip: str | None = None
    """Why the point does not run again (completed, or its job is queued), None to run it."""
    submitter: Submitter | None = None
    """Its backend, when it submits to a scheduler: the point is queued and the sweep goes on to the next."""
    wait: bool = False
    """A submitted point whose spec asks to wait: the sweep collects its job at the end."""

    @property
    def spec(self) -> RunSpec | None:
        """The validated spec (None while invalid)."""
        return self.built.spec if self.built is not None else None


def expand(overrides: list[str]) -> list[list[str]]:
    """Every combination of a basic sweep, as plain override lists, the last key varying fastest."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices: dict[str, list[str]] = {}
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        if not override.is_sweep_override():
            choices[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            choices[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            raise ValueError(f"{override.input_line}: a sweep needs a list of values (a,b / range / choice)")
    return [list(point) for point in itertools.product(*choices.values())]


def subdir(cfg: DictConfig, num: int, overrides: list[str]) -> str:
    """hydra.sweep.subdir for point `num` (`${hydra.job.num}` by default)."""
    probe = copy.deepcopy(cfg)
    OmegaConf.update(probe, "hydra.job.num", num, force_add=True)
    plain = sorted(o for o in overrides if not o.lstrip("+~").startswith("hydra."))
    OmegaConf.update(probe, "hydra.job.override_dirname", ",".join(plain), force_add=True)
    try:
        return str(probe.hydra.sweep.subdir)
    except Exception:  # an interpolation only Hydra's own job runtime can resolve
        return str(num)


def _spec_values(text: str) -> dict[str, Any]:
    """Dotted key -> value of a spec.yaml's text, without the header that makes it composable."""
    data = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
    return dryrun.flatten({k: v for k, v in data.items() if k not in ("defaults", "hydra")})


def _changed_keys(spec_path: Path, built: compose.Built) -> list[str]:
    """Keys whose value differs between a point's existing spec.yaml and the validated spec about to run.

    An invalid point is compared through its config, with every value the launcher decides filled in.
    """
    old = _spec_values(spec_path.read_text())
    if built.spec is not None:
        new = _spec_values(built.written(spec_path.parent)[1])
    else:
        new = dryrun.flatten(redacted_container(compose.strip_hydra(built.config)))
    keys = sorted(set(old) | set(new))
    ignored = _IGNORED_KEYS + _wait_key(built)
    return [k for k in keys if not k.startswith(ignored) and old.get(k) != new.get(k)]


def _wait_key(built: compose.Built) -> tuple[str, ...]:
    """The key that says whether the point's backend waits for its job, if it submits: the sweep collects it itself."""
    name = OmegaConf.select(built.config, "launcher.backend", default=None)
    chosen = submitter(name) if name in BACKENDS else None
    return (chosen.WAIT_KEY,) if chosen is not None else ()


def _active_job(point_dir: Path) -> str | None:
    """The id and state of this point's submitted job while it is queued or running, else None."""
    state = job_state(point_dir)
    return f"{state.job_id} ({state.state})" if state is not None and state.active else None


def prepare(point: Point, label: str = "sweep point") -> list[SpecError]:
    """Decide skip / resume for a point from its directory, then validate it; its problems (`label` names the point)."""
    summary = sweep_status._read_json(point.run_dir / "summary.json") or {}
    job = _active_job(point.run_dir)
    if summary.get("exit_reason") in FINISHED:
        point.skip = f"already completed in {point.run_dir}, skipped"
    elif job is not None:
        point.skip = f"job {job} is still queued or running, not submitted again"
    cfg, values = point.cfg, {"run_dir": str(point.run_dir)}
    runs = point.skip is None
    if runs and cfg.get("resume") is None and checkpoint.good_checkpoints(point.run_dir, warn=False):
        values["resume"] = "auto"
    point.built = compose.build(with_values(cfg, values))
    point.submitter = submitter(point.spec.launcher.backend) if runs and point.spec is not None else None
    if point.submitter is not None:  # the sweep submits every point, then collects those that wait
        point.wait = point.submitter.waits(point.spec)
    written = point.run_dir / "spec.yaml"
    changed = _changed_keys(written, point.built) if written.is_file() and (point.skip or point.spec) else []
    if changed:
        return [
            SpecError(
                ("hydra.sweep.dir",),
                f"{label} {point.num}: {point.run_dir} holds a run with other settings ({', '.join(changed[:6])}). "
                "Re-run a sweep with its original parameters, or give a new hydra.sweep.dir.",
            )
        ]
    if point.skip:
        return []  # nothing of it runs
    return [
        SpecError(e.keys, f"{label} {point.num} ({' '.join(point.overrides)}): {e.message}")
        for e in point.built.errors
    ]


def plan(line: CommandLine) -> tuple[list[Point], Path | None, list[SpecError]]:
    """Compose and validate every point (nothing is written): the points, the sweep directory, every problem."""
    try:
        combinations = expand(list(line.overrides))
    except Exception as err:  # Hydra's grammar error names the bad override
        return [], None, [SpecError(("command line",), f"the sweep does not parse: {err}")]
    points: list[Point] = []
    errors: list[SpecError] = []
    sweep_dir: Path | None = None
    for num, point_overrides in enumerate(combinations):
        cfg, problems = compose.compose_checked(point_overrides, line.source)
        if cfg is None:
            errors.extend(e for e in problems if e not in errors)
            continue
        sweep_dir = sweep_dir or Path(str(cfg.hydra.sweep.dir))  # resolved once: ${now:} must not move
        point_dir = Path(cfg.run_dir) if cfg.get("run_dir") else sweep_dir / subdir(cfg, num, point_overrides)
        point = Point(num=num, overrides=point_overrides, cfg=cfg, run_dir=point_dir)
        errors.extend(prepare(point))
        points.append(point)
    return points, sweep_dir, errors


def write_record(point: Point) -> None:
    """Make the point's run directory and write its record (index and overrides) for the sweep table."""
    rundir.make_run_dir(point.run_dir)
    record = {"num": point.num, "overrides": point.overrides}
    (point.run_dir / sweep_status.POINT_FILE).write_text(json.dumps(record, indent=1) + "\n")


def start(point: Point, console: Console) -> int:
    """Write the point's record and run it through the one launch sequence."""
    write_record(point)
    if point.spec.resume == "auto":
        console.print(f"sweep point {point.num}: resuming from its newest checkpoint in {point.run_dir}")
    return rundir.start(point.built, point.run_dir, submit_only=point.submitter is not None)


def run(line: CommandLine) -> int:
    """Run a sweep; the worst point's exit status (1 when a point failed without one)."""
    console = Console(highlight=False, soft_wrap=True)
    points, sweep_dir, errors = plan(line)
    if errors or sweep_dir is None:
        rundir.report(errors)
        return ExitStatus.INVALID_SPEC
    if points and points[0].cfg.get("dry_run"):
        shown = []
        for point in points:
            console.print(f"sweep point {point.num}: {escape(' '.join(point.overrides))}")
            shown.append(dryrun.show(point.built, point.run_dir))
        return max(shown, default=ExitStatus.OK)  # 2 where a point's run would be refused
    console.print(f"sweep: {len(points)} point(s) in {sweep_dir}")
    codes, waiting = [], []
    for point in points:
        if point.skip:
            console.print(f"sweep point {point.num}: {point.skip}")
            continue
        console.print(f"sweep point {point.num}: {escape(' '.join(point.overrides))} -> {point.run_dir}")
        codes.append(start(point, console))
        if point.submitter is not None and point.wait and codes[-1] == ExitStatus.OK:  # collected below
            waiting.append((point, point.submitter))
    if waiting:
        key = waiting[0][1].WAIT_KEY
        console.print(
            f"waiting for the sweep's {len(waiting)} submitted job(s) to end ({key}=false returns at once)"
        )
    codes.extend(chosen.collect(point.run_dir) for point, chosen in waiting)
    result = sweep_status.report(sweep_dir)
    worst = max(codes, default=0)
    return worst or (ExitStatus.FAILED if sweep_status.failed(result) else ExitStatus.OK)
