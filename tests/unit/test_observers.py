"""Observers of a run: a failing one is dropped with a warning, log lines replace the bar off a terminal."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from launcher.components.loggers import observers
from launcher.rank.watchers import build_observers
from launcher.spec import RunSpec


class Broken:
    def __init__(self) -> None:
        self.closed = 0

    def on_record(self, record: dict) -> None:
        raise OSError("disk full")

    def on_finish(self, summary: dict) -> None:
        raise AssertionError("never reached: dropped after the first failure")

    def close(self) -> None:
        self.closed += 1


class Advice:
    def on_record(self, record: dict) -> None:
        pass

    def on_finish(self, summary: dict) -> None:
        summary["advice"] = ["x"]

    def close(self) -> None:
        pass


def test_a_failing_observer_is_dropped_and_the_others_go_on() -> None:
    broken = Broken()
    group = observers.Observers([broken, Advice()])
    with pytest.warns(UserWarning, match="Broken stopped watching the run: OSError"):
        group.record({"step": 1})
    assert broken.closed == 1
    summary: dict = {}
    group.finish(summary)
    assert summary == {"advice": ["x"]} and group.items == []


def test_log_lines_where_stdout_is_not_a_terminal(tmp_path: Path) -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False)
    context = observers.RunContext(
        run_dir=tmp_path,
        console=console,
        device_type="cpu",
        start_step=0,
        session=0,
        world_size=1,
        max_steps=300,
    )
    group = build_observers(RunSpec(), context)
    group.record({"step": 10, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 12345.6})
    group.record({"step": 10, "eval_loss": 2.25, "eval_ppl": 9.49})
    assert out.getvalue().splitlines() == [
        "step 10/300: loss 2.5000 lr 0.001 grad_norm 0.5 12,346 tok/s",
        "eval step 10: eval_loss 2.2500 ppl 9.49",
    ]
    terminal = observers.RunContext(
        **{**context.__dict__, "console": Console(file=io.StringIO(), force_terminal=True)}
    )
    kinds = [type(item).__name__ for item in build_observers(RunSpec(), terminal).items]
    assert kinds == ["Advisor"]  # no log lines: the progress bar shows instead


def test_progress_lines_fill_silence_with_steps_loss_rate_and_eta() -> None:
    from launcher.components.metrics import ProgressLines

    out = io.StringIO()
    lines = ProgressLines(Console(file=out, width=200), total=100, start_step=10, every_s=0.0)
    lines.after_step(11, [])  # nothing logged yet: steps and eta only
    lines.after_step(12, [{"step": 12, "loss": 2.5, "tokens_per_s": 12345.6}])  # its log line was printed
    lines.after_step(13, [])
    first, second = out.getvalue().splitlines()
    assert first.startswith("progress: step 11/100 (11%), eta ")
    assert second.startswith("progress: step 13/100 (13%), loss 2.5000, 12,346 tok/s, eta ")
    quiet_lines = ProgressLines(Console(file=io.StringIO()), total=100, start_step=0, every_s=3600.0)
    quiet_lines.after_step(1, [])
    assert quiet_lines._console.file.getvalue() == ""  # an hour has not passed


def test_verbose_is_an_override_and_the_quiet_filters_come_off_with_it() -> None:
    import logging

    from launcher.components import quiet
    from launcher.front import command_line

    line = command_line.parse(["--verbose", "train.max_steps=3"])
    assert line.overrides == ("log.verbose=true", "train.max_steps=3") and line.verbose and not line.flags
    assert not command_line.parse(["log.verbose=false"]).verbose
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(handler)
    try:
        quiet.install()
        logger.warning("Setting accelerator to CPU. If you have GPU or other accelerator, ...")
        logger.warning("a warning of its own")
        quiet.install(verbose=True)
        logger.warning("Setting accelerator to CPU. If you have GPU or other accelerator, ...")
    finally:
        logger.removeHandler(handler)
        quiet.uninstall()  # this test process as it was
    assert [r.getMessage()[:20] for r in records] == ["a warning of its own", "Setting accelerator "]


def test_held_prints_pass_on_all_but_the_known_chatter_and_everything_on_an_error(capsys) -> None:
    import sys

    from launcher.components import quiet

    quiet.install()
    try:
        with quiet.held_prints(quiet.DEEPSPEED_CONSOLIDATION):
            print("Processing zero checkpoint '/x/deepspeed'")
            sys.stderr.write("Loading checkpoint shards: 100%|##| 1/1\r\n")
            print("a line of its own")
        assert capsys.readouterr() == ("a line of its own\n", "")
        with pytest.raises(ValueError), quiet.held_prints(quiet.DEEPSPEED_CONSOLIDATION):
            print("Processing zero checkpoint '/x/deepspeed'")
            raise ValueError("bad shard")
        assert capsys.readouterr().out == "Processing zero checkpoint '/x/deepspeed'\n"
    finally:
        quiet.uninstall()
    with quiet.held_prints(quiet.DEEPSPEED_CONSOLIDATION):  # verbose: as printed
        print("Processing zero checkpoint '/x/deepspeed'")
    assert capsys.readouterr().out == "Processing zero checkpoint '/x/deepspeed'\n"
