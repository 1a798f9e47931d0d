"""`train`: parse the command line once, compose it and build its spec once, then dry-run, sweep or launch it.

Every spec problem is reported before anything starts, with exit status 2 and no traceback. Hydra's
own flags that only print (--help, --cfg, --info, ...) are handed to Hydra's app unchanged; `--cfg`
first checks the command line as a run would, so it prints only a config a run would accept.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console

from launcher.components import collector, quiet, warning_lines
from launcher.exits import ExitStatus
from launcher.front import (
    command_line,
    compose,
    data_format,
    dryrun,
    help_cache,
    hydra_help,
    optuna_sweep,
    recipe_auto,
    rundir,
    sweep,
    torchrun,
    verify,
)
from launcher.front.command_line import CommandLine
from launcher.front.tokenize import prepare_data
from launcher.launch import run_lock
from launcher.spec import SpecError


def precheck(argv: CommandLine | Sequence[str]) -> list[SpecError]:
    """Every problem of a command line (each sweep point's too); nothing is started or written."""
    line = command_line.of(argv)
    errors = line.unknown_flags()
    if optuna_sweep.requested(line):
        return errors + optuna_sweep.plan(line)[1]
    if line.multirun:
        return errors + sweep.plan(line)[2]
    cfg, problems = compose.compose_checked(list(line.overrides), line.source)
    return errors + (problems if cfg is None else list(compose.build(cfg).errors))


def run(argv: CommandLine | Sequence[str]) -> int:
    """Run what a command line describes; the exit status."""
    line = command_line.of(argv)
    errors = line.unknown_flags()
    if errors:
        rundir.report(errors)
        return ExitStatus.INVALID_SPEC
    if optuna_sweep.requested(line) and not torchrun.active():
        collector.resume()
        return optuna_sweep.run(line)  # refused without --multirun
    if line.multirun and not torchrun.active():
        collector.resume()  # every point is composed here: start-up is over
        return sweep.run(line)
    report = rundir.report if torchrun.reports() else _after_rank_0  # under torchrun, rank 0 speaks for all
    cfg, errors = compose.compose_checked(list(line.overrides), line.source)
    if cfg is None:
        report(errors)
        return ExitStatus.INVALID_SPEC
    cfg, errors = torchrun.adopt(cfg, multirun=line.multirun)  # under torchrun: its world, every rank alike
    if errors:
        report(errors)
        return ExitStatus.INVALID_SPEC
    built = compose.build(cfg)
    if built.spec is not None and built.spec.log.verbose:  # set in a config file, not on the command line
        quiet.uninstall()
    collector.resume()  # the spec is built: what follows (tokenizing, waiting for ranks) collects as usual
    if cfg.data.format == "auto" and built.spec is not None and report is not _after_rank_0:
        Console(highlight=False).print(data_format.announce(built.spec), markup=False, soft_wrap=True)
    run_dir = Path(cfg.run_dir) if cfg.get("run_dir") else rundir.default_run_dir(rundir.safe_name(cfg))
    if cfg.get("dry_run") == "simulate":
        from launcher.front import simulation  # builds ranks on fake tensors: torch, only when asked

        return simulation.run(built)
    if cfg.get("dry_run"):
        return dryrun.show(built, run_dir)  # 2 where the run would be refused, the data-size checks included
    return _launch(built, run_dir, report)


def _launch(built: compose.Built, run_dir: Path, report: Callable[[list[SpecError]], None]) -> int:
    """Start a validated run: under torchrun this process's rank, else the run directory and its backend."""
    if torchrun.active():
        if built.errors:
            report(list(built.errors))
            return ExitStatus.INVALID_SPEC
        return torchrun.start(built, run_dir)
    errors = list(built.errors) or prepare_data(built.spec)  # tokenize once, before any rank starts
    if errors:
        rundir.report(errors)
        return ExitStatus.INVALID_SPEC
    if built.spec.verify_resume:
        rundir.make_run_dir(run_dir)
        with run_lock.holding(run_dir):
            return verify.run(built.config, rundir.write(built, run_dir), run_dir)
    return rundir.start(built, run_dir)


PEER_REPORT_WAIT_S = 30.0
"""How long a torchrun rank other than 0 waits before it reports a spec problem itself."""


def _after_rank_0(errors: list[SpecError]) -> None:
    """Let global rank 0 report the same problems first, then report them if this rank still runs.

    Every rank finds the same problems; rank 0 reports them. A rank that exited at once could end
    first, and torchrun then ends the job's other ranks, rank 0 among them, before it has printed
    anything: the user saw no reason. torchrun ends this rank when rank 0 exits; where it still runs
    after the wait (rank 0 elsewhere, or not affected), it speaks for itself.
    """
    time.sleep(PEER_REPORT_WAIT_S)
    rundir.report(errors)


def _hydra_print(argv: Sequence[str]) -> int:
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
    warning_lines.install()
    compose.register_schemas()
    line = command_line.parse(raw)
    quiet.install(verbose=line.verbose)  # before any library is imported: ranks inherit it too
    if line.has(command_line.CFG_FLAGS):  # print only what a run would accept
        line = recipe_auto.resolve(line, console=Console(stderr=True, highlight=False))
        errors = precheck(line.without_print_flags())
        if errors:
            rundir.report(errors)
            sys.exit(ExitStatus.INVALID_SPEC)
    if line.has(command_line.PRINT_FLAGS):
        if help_cache.cacheable(raw):  # the next `train --help` is answered from the cache (front/entry.py)
            sys.exit(help_cache.print_and_keep(raw, lambda: _hydra_print(line.argv)))
        sys.exit(_hydra_print(line.argv))
    line = recipe_auto.resolve(line, console=Console(stderr=True, highlight=False))
    try:
        sys.exit(run(line))
    except KeyboardInterrupt:  # a second Ctrl-C while a rank ran in this process
        rundir.err_console.print("stopped at once (a second Ctrl-C); completed checkpoints are intact.")
        sys.exit(ExitStatus.INTERRUPTED)
