"""A rank of `train-eval`: read spec.yaml, join the job, build the model as training builds it, load a
checkpoint's weights (or none: a Hugging Face folder's own), run the spec's evaluators once, and on rank 0
write `results.json` beside spec.yaml and print the table.

`python -m launcher.rank.eval_worker SPEC_YAML [--checkpoint STEP_DIR]`: how launcher.launch.eval_ranks
starts a rank (torch's elastic launcher for several, in-process for one).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from launcher.components import checkpoint as checkpoints
from launcher.components import quiet, warning_lines
from launcher.components.device import resolve_device
from launcher.components.schedule_free import ready_to_load
from launcher.parallel.dims import shutdown
from launcher.parallel.registry import STRATEGIES
from launcher.rank import preflight
from launcher.rank.build import build
from launcher.rank.evaluators import build_evaluators
from launcher.rank.worker import configure_process
from launcher.spec import load_spec

RESULTS = "results.json"
"""What train-eval writes beside its spec.yaml: the source, the step and every score."""


def score_table(title: str, scores: dict[str, float]) -> Table:
    """The scores as a two-column table, sorted by name."""
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name in sorted(scores):
        table.add_row(name, f"{scores[name]:.4f}")
    return table


def checkpoint_step(directory: Path) -> int:
    """The optimizer step a checkpoint directory holds (its trainer.pt, else its step_N name)."""
    state = checkpoints.load_tensor_file(directory / "trainer.pt")
    return int(state.get("step", directory.name.removeprefix("step_")))


def run(spec_path: Path, checkpoint: Path | None = None) -> int:
    """Evaluate on this rank (every rank calls it); rank 0 writes results.json and prints the table."""
    spec = load_spec(spec_path)
    out_dir = Path(spec.run_dir or spec_path.parent)
    console = Console(soft_wrap=True)
    device_type = resolve_device(spec.launcher.device)
    configure_process(spec, device_type)
    dist = preflight.join(
        device_type, spec.launcher.timeout_s, parallel=spec.parallel,
        one_rank_group=STRATEGIES[spec.parallel.strategy].process_group,
    )  # fmt: skip
    started = time.perf_counter()
    try:
        parts = build(spec, dist, out_dir)
        step: int | None = None  # a Hugging Face folder's weights: no step
        if checkpoint is not None:
            ready_to_load(parts.strategy.optimizer)  # schedule-free: DCP steps it once at lr 0
            parts.strategy.load(checkpoint)
            step = checkpoint_step(checkpoint)
        evaluators = build_evaluators(spec)
        scores = {k: v for k, v in evaluators.run_all(parts, step or 0).items() if k != "eval_step"}
    finally:
        shutdown()
    if dist.is_main:
        results: dict[str, Any] = {
            "source": str(checkpoint) if checkpoint is not None else spec.model.path,
            "step": step, "world_size": dist.world_size, "wall_time_s": time.perf_counter() - started,
            "scores": scores,
        }  # fmt: skip
        (out_dir / RESULTS).write_text(json.dumps(results, indent=2) + "\n")
        at = f" (step {step})" if step is not None else ""
        console.print(score_table(f"evaluation of {results['source']}{at}", scores))
        console.print(f"results: {out_dir / RESULTS}", markup=False, highlight=False)
    return 0


def main() -> None:
    """`python -m launcher.rank.eval_worker SPEC_YAML [--checkpoint STEP_DIR]`."""
    parser = argparse.ArgumentParser(prog="launcher.rank.eval_worker")
    parser.add_argument("spec", type=Path)
    parser.add_argument("--checkpoint", type=Path, default=None)
    args = parser.parse_args()
    warning_lines.install()
    quiet.install(verbose=load_spec(args.spec).log.verbose)
    sys.exit(run(args.spec, args.checkpoint))


if __name__ == "__main__":
    main()
