"""Weights & Biases: offline by default (RUN_DIR/logs/wandb/offline-run-*, uploaded later with
`wandb sync`), online with `logger.wandb.mode=online` and the user's own WANDB_API_KEY.

The run id is stored in RUN_DIR/logs/wandb/run_id and a resumed session opens the same id with
resume="allow" (a session that starts at step 0, with no checkpoint to resume, begins a new run).
Offline, W&B knows nothing of earlier sessions (each writes its own offline-run folder, starting at
step 0), so the steps each metric already holds are kept in RUN_DIR/logs/wandb/logged_steps.json
and a resumed session logs only the steps after them.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.components.loggers.records import LoggedSteps, flat_spec, read_run_id, scalars, write_run_id

if TYPE_CHECKING:
    from launcher.components.loggers.observers import RunContext
    from launcher.config.logger import WandbConfig


def log_dir(run_dir: Path) -> Path:
    """Where W&B writes (it adds offline-run-<time>-<id>/ per session) and where the run id is kept."""
    return run_dir / "logs" / "wandb"


class WandbLogger:
    """Logs each record's scalars with `step=` the record's step (W&B's own step is not used)."""

    def __init__(self, config: WandbConfig, context: RunContext) -> None:
        import wandb

        out = log_dir(context.run_dir)
        resumed = context.start_step > 0  # a session at step 0 (no checkpoint to resume) begins a new run
        run_id = (read_run_id(out) if resumed else None) or secrets.token_hex(4)  # W&B ids: 8 of [0-9a-z]
        write_run_id(out, run_id)
        self.logged = LoggedSteps(out / "logged_steps.json", keep=resumed)
        self.run = wandb.init(
            dir=str(out.parent),  # W&B writes into DIR/wandb/
            mode=config.mode,
            project=config.project,
            entity=config.entity,
            id=run_id,
            resume="allow",
            name=context.run_dir.resolve().name,
            config=flat_spec(context.run_dir),
            allow_val_change=True,  # a resumed session may change a key (e.g. resume itself)
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True, save_code=False),
        )
        self._finished = False

    def on_record(self, record: dict[str, Any]) -> None:
        """The record's scalars at its step, skipping metrics that already hold the step (a replay)."""
        step = int(record["step"])
        values = self.logged.new(step, scalars(record))
        if values:
            self.run.log(values, step=step)
            self.logged.mark(step, list(values))

    def on_finish(self, summary: dict[str, Any]) -> None:
        """Finish the W&B run (exit code 0 also for a session that stopped to resume later)."""
        self._finished = True
        self.run.finish(exit_code=0)

    def close(self) -> None:
        """A session that ended without a summary (a crash) finishes the run with exit code 1."""
        if not self._finished:
            self._finished = True
            self.run.finish(exit_code=1)
