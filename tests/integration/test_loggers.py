"""The `logger` group on a real run with a replayed resume, read back with each tracker's own reader.

One run, shared by every assertion: TensorBoard, MLflow and W&B (offline) together, evaluation,
a profiled first session that stops at step 6 with its newest checkpoint at step 4, and a resumed
session that replays steps 5-6 and trains to step 12. Each tracker must then hold every step once,
with the losses metrics.jsonl holds, in the same tracker run across both sessions.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import pytest

from conftest import TINY, run_inline
from launcher.components.metrics import read_metrics
from launcher.front.cli import precheck

LOGGERS = "logger=[tensorboard,mlflow,wandb]"
RUN = [*TINY, LOGGERS, "train.max_steps=12", "train.eval_every=3", "checkpoint.every=4"]
# Session 1 stops at step 6 without a final checkpoint: session 2 resumes at step 4 and replays 5-6.
FIRST = [*RUN, "train.stop_after=6", "checkpoint.save_final=false", "profile=true", "profiler.active=2"]
SECOND = [*RUN, "resume=auto"]
STEPS = list(range(1, 13))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("tracked") / "run"
    assert run_inline(FIRST, run_dir) == 0
    ids = {name: (run_dir / "logs" / name / "run_id").read_text() for name in ("mlflow", "wandb")}
    assert run_inline(SECOND, run_dir) == 0
    assert ids == {name: (run_dir / "logs" / name / "run_id").read_text() for name in ("mlflow", "wandb")}
    return run_dir


@pytest.fixture(scope="module")
def jsonl(run_dir: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl's loss and eval loss per step: what every tracker must hold."""
    records = read_metrics(run_dir / "metrics.jsonl")
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(losses) == STEPS and sorted(evals) == [3, 6, 9, 12]
    return {"train/loss": losses, "eval/loss": evals}


def test_tensorboard_holds_each_step_once_after_the_replay(run_dir: Path, jsonl: dict) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "logs" / "tensorboard")).Reload()
    for tag, expected in jsonl.items():
        points = events.Scalars(tag)
        assert [p.step for p in points] == sorted(expected)  # purge_step dropped session 1's steps 5-6
        assert [p.value for p in points] == pytest.approx([expected[s] for s in sorted(expected)], rel=1e-6)
    assert {"perf/tokens_per_s", "mem/peak_bytes", "train/lr", "time/forward_s"} <= set(
        events.Tags()["scalars"]
    )
    traces = list((run_dir / "logs" / "tensorboard" / "plugins" / "profile").glob("*/rank0.*.pt.trace.json"))
    assert traces and list((run_dir / "profile").glob("rank0.*.pt.trace.json"))


def test_mlflow_holds_each_step_once_with_the_spec(run_dir: Path, jsonl: dict) -> None:
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses its file store otherwise
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "logs" / "mlflow").resolve().as_uri())
    run_id = (run_dir / "logs" / "mlflow" / "run_id").read_text().strip()
    for tag, expected in jsonl.items():
        history = sorted(client.get_metric_history(run_id, tag), key=lambda m: m.step)
        assert [m.step for m in history] == sorted(expected)
        assert [m.value for m in history] == pytest.approx([expected[s] for s in sorted(expected)], rel=1e-6)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["launcher.sessions"] == "2"
    assert run.data.params["optimizer.lr"] == str(_spec_value(run_dir, "optimizer", "lr"))
    assert run.data.params["train.max_steps"] == "12"
    assert "spec.yaml" in [f.path for f in client.list_artifacts(run_id)]


def test_wandb_offline_holds_each_step_once_in_one_run(run_dir: Path, jsonl: dict) -> None:
    run_id = (run_dir / "logs" / "wandb" / "run_id").read_text().strip()
    sessions = sorted((run_dir / "logs" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(sessions) == 2  # offline, each session writes its own folder of the same run id
    rows = [row for folder in sessions for row in _wandb_history(folder / f"run-{run_id}.wandb")]
    for tag, expected in jsonl.items():
        points = [(row["_step"], row[tag]) for row in rows if tag in row]
        assert [s for s, _ in points] == sorted(expected)
        assert [v for _, v in points] == pytest.approx([expected[s] for s in sorted(expected)], rel=1e-6)


def _spec_value(run_dir: Path, section: str, key: str) -> object:
    import yaml

    return yaml.safe_load((run_dir / "spec.yaml").read_text())[section][key]


def _wandb_history(path: Path) -> list[dict]:
    """The history rows of an offline .wandb file: W&B's record log (a LevelDB-style log of 32 KiB blocks
    after a 7-byte header) holding wandb_internal_pb2.Record messages; wandb 0.31 ships no Python reader."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    rows, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        # kind 1 (full) or 2 (first) starts a record, 3 (middle) or 4 (last) continues one
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4) and pending:
            record = wandb_internal_pb2.Record.FromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in record.history.item
                    }
                )
    return rows


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["logger=[tensorboard,wandb]", "logger.wandb.mode=onlin"],
            "logger.wandb.mode: unknown W&B mode 'onlin'",
        ),
        (["logger=[tensorbord]"], "no option 'tensorbord' in group logger. Did you mean tensorboard?"),
        (
            ["logger=mlflow", "logger.mlflow.tracking_uri=mlruns"],
            "logger.mlflow.tracking_uri: 'mlruns' has no scheme",
        ),
        (["logger=mlflow", "logger.mlflow.tracking_uri=http://"], "'http://' names no host"),
        (["logger=mlflow", "logger.mlflow.tracking_uri=file:mlruns"], "is not an absolute file: URI"),
    ],
)
def test_bad_logger_settings_are_named_before_launch(argv: list[str], expected: str) -> None:
    assert any(expected in str(e) for e in precheck(argv)), [str(e) for e in precheck(argv)]


def test_a_tracker_that_is_not_installed_names_its_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # how Python marks a module that cannot be imported
    errors = [str(e) for e in precheck(["logger=[tensorboard,wandb]"])]
    assert errors == [
        "logger.wandb.enabled: logger=wandb needs the wandb package, which is not installed here. Install it "
        "with `pip install 'torch-launcher[wandb]'` (or `pip install wandb`), or leave wandb out of logger=[...]."
    ]
