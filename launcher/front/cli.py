"""`train`: compose the command line once, validate it once, then dry-run, sweep or launch it.

Every spec problem is reported before anything starts, with exit status 2 and no traceback. Hydra's
own flags that only print (--help, --cfg, --info, ...) are handed to Hydra's app unchanged; `--cfg`
first checks the command line as a run would, so it prints only a config a run would accept.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

from launcher.exits import ExitStatus
from launcher.front import (
    compose,
    data_format,
    dryrun,
    help_cache,
    hydra_help,
    recipe_auto,
    rundir,
    sweep,
    torchrun,
    verify,
)
from launcher.front.tokenize import prepare_data
from launcher.launch import run_lock
from launcher.spec import SpecError

# Flags after which Hydra prints something and runs nothing: Hydra's own app handles them.
HYDRA_PRINT_FLAGS = (
    "--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc", "--version",
)  # fmt: skip
MULTIRUN_FLAGS = ("--multirun", "-m")
CFG_FLAGS = ("--cfg", "-c")


def precheck(argv: list[str]) -> list[SpecError]:
    """Every problem of a normalized command line (each sweep point's too); nothing is started or written."""
    flags, overrides = compose.split_argv(argv)
    errors = compose.unknown_flags(flags)
    source = compose.ConfigSource.from_flags(flags)
    if any(flag in MULTIRUN_FLAGS for flag in flags):
        return errors + sweep.plan(overrides, source)[2]
    cfg, problems = compose.compose_checked(overrides, source)
    return errors + (problems if cfg is None else compose.validate(cfg)[1])


def run(argv: list[str]) -> int:
    """Run what a normalized command line describes; the exit status."""
    flags, overrides = compose.split_argv(argv)
    errors = compose.unknown_flags(flags)
    if errors:
        rundir.report(errors)
        return ExitStatus.INVALID_SPEC
    source = compose.ConfigSource.from_flags(flags)
    multirun = any(flag in MULTIRUN_FLAGS for flag in flags)
    if multirun and not torchrun.active():
        return sweep.run(overrides, source)
    report = rundir.report if torchrun.reports() else _silent  # under torchrun, rank 0 speaks for all
    cfg, errors = compose.compose_checked(overrides, source)
    if cfg is None:
        report(errors)
        return ExitStatus.INVALID_SPEC
    errors = torchrun.adopt(cfg, multirun=multirun)  # under torchrun: its world, in every rank's spec alike
    if errors:
        report(errors)
        return ExitStatus.INVALID_SPEC
    auto_format = cfg.data.format == "auto"  # validate replaces it with the detected format
    spec, errors = compose.validate(cfg)
    if auto_format and spec is not None and report is not _silent:
        Console(highlight=False).print(data_format.announce(spec), markup=False, soft_wrap=True)
    run_dir = Path(cfg.run_dir) if cfg.get("run_dir") else rundir.default_run_dir(rundir.safe_name(cfg))
    if cfg.get("dry_run"):
        dryrun.show(cfg, spec, errors, run_dir)
        return ExitStatus.INVALID_SPEC if errors else ExitStatus.OK
    if torchrun.active():
        if errors:
            report(errors)
            return ExitStatus.INVALID_SPEC
        return torchrun.start(cfg, spec, run_dir)
    errors = errors or prepare_data(spec)  # tokenize once, before any rank starts
    if errors:
        rundir.report(errors)
        return ExitStatus.INVALID_SPEC
    if spec.verify_resume:
        rundir.make_run_dir(run_dir)
        with run_lock.holding(run_dir):
            return verify.run(cfg, rundir.write(cfg, spec, run_dir), run_dir)
    return rundir.start(cfg, spec, run_dir)


def _silent(errors: list[SpecError]) -> None:
    """Report nothing (another rank reports the same problems)."""


def _without_print_flags(argv: list[str]) -> list[str]:
    """The command line a run would see: the printing flags (and `--cfg`'s value) removed."""
    out, skip_next = [], False
    for arg in argv:
        if skip_next:
            skip_next = False
        elif arg.split("=", 1)[0] in HYDRA_PRINT_FLAGS:
            skip_next = arg in ("--cfg", "-c", "--info", "-i", "--package", "-p")
        else:
            out.append(arg)
    return out


def _hydra_print(argv: list[str]) -> int:
    """Let Hydra's own app answer a flag that only prints (help, composed config, info)."""
    import hydra

    @hydra.main(version_base="1.3", config_path=f"pkg://{compose.CONFIG_MODULE}", config_name=compose.PRIMARY)
    def app(_cfg: object) -> None:
        """Never reached for the printing flags."""

    saved = sys.argv
    sys.argv = [saved[0], *argv]  # Hydra's app reads its arguments from sys.argv only
    try:
        with hydra_help.one_repository_copy():  # Hydra's group listing, without a repository copy per group
            app()
    finally:
        sys.argv = saved
    return ExitStatus.OK


def main() -> None:
    """Console entry point of `train` (through launcher.front.entry)."""
    raw = sys.argv[1:]
    argv = compose.normalize(raw)
    compose.register_schemas()
    flags = [flag.split("=", 1)[0] for flag in compose.split_argv(argv)[0]]
    if any(flag in CFG_FLAGS for flag in flags):  # print only what a run would accept
        argv = recipe_auto.resolve(argv, console=Console(stderr=True, highlight=False))
        errors = precheck(_without_print_flags(argv))
        if errors:
            rundir.report(errors)
            sys.exit(ExitStatus.INVALID_SPEC)
    if any(flag in HYDRA_PRINT_FLAGS for flag in flags):
        if help_cache.cacheable(raw):  # the next `train --help` is answered from the cache (front/entry.py)
            sys.exit(help_cache.print_and_keep(raw, lambda: _hydra_print(argv)))
        sys.exit(_hydra_print(argv))
    argv = recipe_auto.resolve(argv, console=Console(stderr=True, highlight=False))
    try:
        sys.exit(run(argv))
    except KeyboardInterrupt:  # a second Ctrl-C while a rank ran in this process
        rundir.err_console.print("stopped at once (a second Ctrl-C); completed checkpoints are intact.")
        sys.exit(ExitStatus.INTERRUPTED)
