"""MLflow: one MLflow run per run directory; the spec as params, spec.yaml as an artifact, metrics per step.

The tracking URI defaults to a file store in RUN_DIR/logs/mlflow. MLflow 3 keeps its file store in
maintenance mode and refuses it unless MLFLOW_ALLOW_FILE_STORE=true, which is set here for file:
URIs (mlflow-skinny has no SQL backend). The run id is stored in RUN_DIR/logs/mlflow/run_id and a
resumed session appends to that run (a session that starts at step 0, with no checkpoint to resume,
begins a new one). MLflow keeps every (key, step) point it is given and cannot drop one, so a
resumed session logs only the steps after the highest each metric already holds: the replayed
steps keep the first session's values (the same values where resume is exact).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.components.loggers.records import flat_spec, read_run_id, scalars, write_run_id
from launcher.config.best import FINISHED

if TYPE_CHECKING:
    from launcher.components.loggers.observers import RunContext
    from launcher.config.logger import MlflowConfig

MAX_PARAMS_PER_BATCH = 100
"""MLflow's limit of params in one log_batch call."""
MAX_PARAM_CHARS = 6000
"""MLflow's limit on a param value's length."""


def default_uri(run_dir: Path) -> str:
    """The file store under the run directory: `mlflow ui --backend-store-uri` this."""
    return (run_dir / "logs" / "mlflow").resolve().as_uri()


class MlflowLogger:
    """Logs each record's scalars as metrics at the record's step, through MlflowClient (no global state)."""

    def __init__(self, config: MlflowConfig, context: RunContext) -> None:
        uri = config.tracking_uri or default_uri(context.run_dir)
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.ids_dir = context.run_dir / "logs" / "mlflow"
        run_id = read_run_id(self.ids_dir) if context.start_step > 0 else None  # step 0: a new run
        if run_id is None:
            experiment = self.client.get_experiment_by_name(config.experiment)
            experiment_id = (
                experiment.experiment_id if experiment else self.client.create_experiment(config.experiment)
            )
            run_id = self.client.create_run(
                experiment_id, run_name=context.run_dir.resolve().name
            ).info.run_id
            write_run_id(self.ids_dir, run_id)
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self.highest = self._highest_steps()
        self.client.set_tag(run_id, "launcher.sessions", str(context.session + 1))
        self._log_spec(context.run_dir)
        self._finished = False

    def _highest_steps(self) -> dict[str, int]:
        """The highest step each metric of the run holds (empty for a new run), in one request:
        MLflow's latest value of a metric is the one at its highest step."""
        return {m.key: m.step for m in self.client.get_run(self.run_id).to_proto().data.metrics}

    def _log_spec(self, run_dir: Path) -> None:
        """The flattened spec as params (those not logged by an earlier session), spec.yaml as an artifact."""
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params
        params = [
            Param(key, str(value)[:MAX_PARAM_CHARS])
            for key, value in flat_spec(run_dir).items()
            if key not in logged
        ]
        for i in range(0, len(params), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + MAX_PARAMS_PER_BATCH])
        self.client.log_artifact(self.run_id, str(run_dir / "spec.yaml"))

    def on_record(self, record: dict[str, Any]) -> None:
        """The record's scalars at its step, skipping metrics that already hold the step (a replay)."""
        from mlflow.entities import Metric

        step, now_ms = int(record["step"]), int(time.time() * 1000)
        values = {k: v for k, v in scalars(record).items() if step > self.highest.get(k, -1)}
        if values:
            self.client.log_batch(
                self.run_id, metrics=[Metric(k, v, now_ms, step) for k, v in values.items()]
            )
            self.highest.update(dict.fromkeys(values, step))

    def on_finish(self, summary: dict[str, Any]) -> None:
        """End the MLflow run: FINISHED when training completed (or train.early_stop ended it), KILLED for a session
        that stopped before (stop_after, a signal)."""
        completed = summary.get("exit_reason") in FINISHED
        self.client.set_terminated(self.run_id, "FINISHED" if completed else "KILLED")
        self._finished = True

    def close(self) -> None:
        """A session that ended without a summary (a crash) leaves the run FAILED."""
        if not self._finished:
            self._finished = True
            self.client.set_terminated(self.run_id, "FAILED")
