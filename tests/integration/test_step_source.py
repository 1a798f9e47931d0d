"""A second step-input source plugged into the loop through launcher.rank.sources' protocol: the real build,
engine, checkpoint and resume path; the source's own position lives in the checkpoint and resumes bitwise."""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from conftest import TINY, losses, write_spec
from launcher.components import checkpoint
from launcher.components.metrics import read_metrics
from launcher.parallel.dims import shutdown
from launcher.rank import preflight, worker
from launcher.rank.build import build
from launcher.rank.engine import Engine
from launcher.rank.sources import Batch, SourceContext, StepSource
from launcher.spec import load_spec

SEQ_LEN = 32
RUN = [
    *TINY,
    "data.max_bytes=20000",  # the data group's corpus is built, then the source replaces it
    "train.max_steps=12",
    "train.grad_accum_steps=2",
    "checkpoint.every=6",
]


class CountingSource:
    """Fixed token batches chosen by the source's own counter (never the step or the global RNG): each micro
    batch is byte sequences counting up from seeded starts, so a resume that lost the counter would train on
    other batches."""

    held_out = ()  # no held-out sequences: the loop makes no evaluation

    def __init__(self) -> None:
        self.drawn = 0

    def micro_batches(self, step: int, ctx: SourceContext) -> list[Batch]:
        batches = []
        for _ in range(ctx.batch.grad_accum_steps):
            generator = torch.Generator().manual_seed(1_000 + self.drawn)
            rows = ctx.batch.micro_batch_size
            start = torch.randint(0, 256, (rows, 1), generator=generator)
            tokens = (start + torch.arange(SEQ_LEN + 1)) % 256
            batches.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
            self.drawn += 1
        return batches

    def record(self) -> dict[str, float]:
        return {"drawn": self.drawn}

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.drawn = int(state["drawn"])


def _session(overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """One inline session as launcher.rank.worker runs it, with the counting source in the data's place."""
    spec = load_spec(write_spec(overrides, run_dir))
    dist = preflight.join("cpu", spec.launcher.timeout_s, parallel=spec.parallel)
    console = Console(file=io.StringIO())
    try:
        parts = build(spec, dist, run_dir)
        source: StepSource = CountingSource()
        parts.source = source
        engine = Engine(parts, run_dir, console)
        worker.restore_newest(engine, worker.resume_candidates(spec, run_dir), console, verify=True)
        summary = engine.run()
        engine.finish_saves()
    finally:
        shutdown()
    return summary


def test_a_second_source_stops_and_resumes_bitwise_with_its_position_in_the_checkpoint(tmp_path) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert _session(RUN, straight)["exit_reason"] == "completed"
    assert _session([*RUN, "train.stop_after=6"], split)["exit_reason"] == "stopped_after"
    saved = checkpoint.load_tensor_file(split / "checkpoints" / "step_6" / "trainer.pt")
    assert saved["data"] == {"drawn": 12}  # 6 steps of 2 micro batches: the source's own state
    summary = _session([*RUN, "resume=auto"], split)
    assert summary["resumed_from"].endswith("step_6") and summary["steps"] == 12
    curve = losses(straight)
    assert losses(split) == curve  # bitwise: the same batches, step by step
    assert curve[12] < curve[1] - 0.3  # the counting sequences are learnt: the source really trains
    records = [r for r in read_metrics(split / "metrics.jsonl") if "loss" in r]
    assert [r["drawn"] for r in records] == [2 * step for step in range(1, 13)]  # the source's record keys
    assert not any("eval_loss" in r for r in read_metrics(straight / "metrics.jsonl"))  # nothing held out
