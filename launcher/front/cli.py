"""`train`: Hydra main -> resolve spec -> write spec.yaml -> hand to a launch backend.

Every spec problem is reported before anything starts, with exit status 2 and no traceback.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from omegaconf import DictConfig
from rich.console import Console

from launcher.front import compose, recipe_auto
from launcher.spec import SpecError, dump_spec, redacted_container, register_schemas

EXIT_INVALID = 2
_HYDRA_ONLY_FLAGS = (
    "--help",
    "-h",
    "--hydra-help",
    "--cfg",
    "-c",
    "--info",
    "-i",
    "--shell-completion",
    "-sc",
    "--version",
)

err_console = Console(stderr=True, highlight=False)


def report(errors: list[SpecError]) -> None:
    """Print every violation as one paragraph, naming keys and fixes."""
    err_console.print(
        f"[red bold]error:[/] the run spec is invalid ({len(errors)} problem{'s' * (len(errors) > 1)}); nothing was started.",
    )
    for error in errors:
        err_console.print(f"  - {error}", markup=False, soft_wrap=True)


def precheck(argv: list[str]) -> list[SpecError]:
    """Compose and validate every run the command line describes (each sweep point), before Hydra runs."""
    flags, overrides = compose.split_argv(argv)
    config_path = _flag_value(flags, "--config-path", "-cp")
    config_name = _flag_value(flags, "--config-name", "-cn") or compose.PRIMARY
    errors = compose.check_overrides(overrides) if config_path is None else []
    if errors:
        return errors
    points = _sweep_points(overrides) if ("--multirun" in flags or "-m" in flags) else [overrides]
    for point in points:
        try:
            cfg = compose.compose(point, config_path=config_path, config_name=config_name)
        except Exception as err:
            errors.append(compose.composition_error(err))
            continue
        _, point_errors = compose.validate(cfg)
        errors.extend(e for e in point_errors if e not in errors)
    return errors


def _flag_value(flags: list[str], *names: str) -> str | None:
    for i, flag in enumerate(flags):
        if flag in names and i + 1 < len(flags):
            return flags[i + 1]
        for name in names:
            if flag.startswith(name + "="):
                return flag.split("=", 1)[1]
    return None


def _sweep_points(overrides: list[str]) -> list[list[str]]:
    """Each combination of a basic sweep, as plain override lists."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [list(point) for batch in BasicSweeper.split_arguments(parsed, None) for point in batch]


def default_run_dir(name: str) -> Path:
    """runs/<name>-<timestamp> (the sweep's job directory in a multirun)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        return Path(hc.sweep.dir) / hc.sweep.subdir
    base = Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _safe_name(cfg: DictConfig) -> str:
    """The run name for a directory, unless it comes from the environment (it might be a secret)."""
    name = str(redacted_container(cfg).get("name", "run"))
    return "run" if "${" in name else name


def make_run_dir(path: Path) -> None:
    """Create the run directory private to the user (0700)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def run_from_config(cfg: DictConfig) -> int:
    """Validate the composed config, then dry-run or launch it; returns the exit status."""
    from hydra.core.hydra_config import HydraConfig

    from launcher import launch
    from launcher.front import sweep
    from launcher.front.dryrun import print_dry_run

    hc = HydraConfig.get()
    skipped = sweep.prepare_point(cfg)  # a --multirun point: skip it when done, else resume it
    if skipped is not None:
        return skipped
    spec, errors = compose.validate(cfg)
    dry = bool(cfg.get("dry_run"))
    run_dir = Path(cfg.run_dir) if cfg.get("run_dir") else default_run_dir(_safe_name(cfg))
    if dry:
        plan = launch.backend(spec.launcher.backend)[0](spec, run_dir) if spec else None
        console = Console() if Console().is_terminal else Console(width=160)
        print_dry_run(console, cfg, dict(hc.runtime.choices), list(hc.overrides.task), errors, plan)
        return EXIT_INVALID if errors else 0
    if errors:
        report(errors)
        return EXIT_INVALID
    cfg.run_dir = str(run_dir)
    make_run_dir(run_dir)
    dump_spec(cfg, run_dir / "spec.yaml")
    Console().print(f"run directory: {run_dir}")
    if spec.verify_resume:
        from launcher.front import verify

        return verify.run(cfg, spec, run_dir)
    return launch.backend(spec.launcher.backend)[1](spec, run_dir)


def _hydra_app() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    @hydra.main(version_base="1.3", config_path=f"pkg://{compose.CONFIG_MODULE}", config_name=compose.PRIMARY)
    def app(cfg: DictConfig) -> int:
        code = run_from_config(cfg)
        if code and HydraConfig.get().mode == RunMode.RUN:
            sys.exit(code)
        return code

    app()


def main() -> None:
    """Console entry point of `train`."""
    argv = compose.normalize(sys.argv[1:])
    register_schemas()
    argv = recipe_auto.resolve(argv)  # recipe=auto -> the recipe chosen for this machine, with the reason
    if not any(flag in argv for flag in _HYDRA_ONLY_FLAGS):
        errors = precheck(argv)
        if errors:
            report(errors)
            sys.exit(EXIT_INVALID)
    sys.argv = [sys.argv[0], *argv]
    _hydra_app()
