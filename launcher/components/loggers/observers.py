"""Who watches a run on rank 0: each logged record and the final summary go to every observer.

metrics.jsonl stays the engine's own record (it is truncated and replayed on resume); observers are
what is built on top of the same records: a plain log line where no terminal shows a progress bar,
experiment trackers (the `logger` group), the run-time advisor. An observer that fails is reported
once and dropped: watching a run never stops it.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rich.console import Console


class Observer(Protocol):
    """Receives rank 0's records: training records (`loss`, `lr`, ...) and evaluation records (`eval_loss`)."""

    def on_record(self, record: dict[str, Any]) -> None:
        """One metrics record, as written to metrics.jsonl."""

    def on_finish(self, summary: dict[str, Any]) -> None:
        """The run's summary before summary.json is written; an observer may add keys to it."""

    def close(self) -> None:
        """Release files and connections (also after a crash, when on_finish never came)."""


@dataclass(frozen=True, kw_only=True)
class RunContext:
    """What an observer may want to know about the run it watches (its own group's config comes separately)."""

    run_dir: Path
    """The run directory; the resolved spec is its spec.yaml."""
    console: Console
    device_type: str
    start_step: int
    """The step this session starts from (0, or the step of the checkpoint it resumed)."""
    session: int
    """Sessions before this one in the run directory."""
    world_size: int
    max_steps: int


class LogLines:
    """One plain line per logged step where stdout is not a terminal (CI, nohup, `| tee`): no progress bar there."""

    def __init__(self, context: RunContext) -> None:
        self._console, self._total = context.console, context.max_steps

    def on_record(self, record: dict[str, Any]) -> None:
        """Print the step's loss, rate and learning rate, or the evaluation's loss and scores."""
        step = record.get("step")
        scores = [f"{key} {value:.4g}" for key, value in record.items() if key.startswith("eval/")]
        if "eval_loss" in record or scores:
            loss = (
                [f"eval_loss {record['eval_loss']:.4f} ppl {record['eval_ppl']:.4g}"]
                if "eval_loss" in record
                else []
            )
            line = f"eval step {step}: {', '.join(loss + scores)}"
        elif "loss" not in record:  # a step's checkpoint time alone (launcher.rank.engine): no line
            return
        else:
            line = (
                f"step {step}/{self._total}: loss {record['loss']:.4f} lr {record['lr']:.3g} "
                f"grad_norm {record['grad_norm']:.3g} {record['tokens_per_s']:,.0f} tok/s"
            )
        self._console.print(line, markup=False, highlight=False)
        sys.stdout.flush()

    def on_finish(self, summary: dict[str, Any]) -> None:
        """Nothing: the summary table follows."""

    def close(self) -> None:
        """Nothing to release."""


class Observers:
    """Fans records out to observers; one that raises is reported once and dropped."""

    def __init__(self, items: list[Observer] | None = None) -> None:
        self.items: list[Observer] = list(items or [])

    def _each(self, method: str, *args: Any) -> None:
        for item in list(self.items):
            try:
                getattr(item, method)(*args)
            except Exception as err:  # noqa: BLE001 - an observer never stops the run
                warnings.warn(f"{type(item).__name__} stopped watching the run: {err!r}", stacklevel=2)
                self.items.remove(item)
                with contextlib.suppress(Exception):  # already reported
                    item.close()

    def record(self, record: dict[str, Any]) -> None:
        """Hand one record to every observer."""
        self._each("on_record", record)

    def finish(self, summary: dict[str, Any]) -> None:
        """Hand the summary to every observer (they may add keys), then close them."""
        self._each("on_finish", summary)
        self.close()

    def close(self) -> None:
        """Close every observer (idempotent)."""
        items, self.items = self.items, []
        for item in items:
            try:
                item.close()
            except Exception as err:  # noqa: BLE001 - closing a tracker never fails the run
                warnings.warn(f"closing {type(item).__name__} failed: {err!r}", stacklevel=2)
