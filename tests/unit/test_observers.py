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
