"""`train-export CHECKPOINT OUT.pt`: one full model state dict from any strategy's checkpoint.

CHECKPOINT is a `checkpoints/step_N` directory or a run directory (its newest complete checkpoint
is used). The run's spec.yaml names the strategy; that strategy's module (the registry entry's)
provides `consolidate(directory)`, which gathers sharded or engine-specific files offline in this
one process. The result loads at world size 1 into `launcher.groups.model.gpt.build_model(spec.model)`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from launcher.exits import ExitStatus
from launcher.groups import checkpoint
from launcher.parallel.registry import strategy_module
from launcher.spec import RunSpec, load_spec


class ExportError(RuntimeError):
    """The checkpoint cannot be exported; the message says why and what to give instead."""


def locate(path: Path) -> tuple[Path, Path]:
    """(checkpoint directory, run directory) for a step_N directory or a run directory."""
    path = Path(path)
    if path.name.startswith("step_"):
        reason = checkpoint.problem(path)
        if reason is not None:
            raise ExportError(f"{path} is not a complete checkpoint: {reason}.")
        return path, path.parent.parent
    good = checkpoint.good_checkpoints(path)
    if not good:
        raise ExportError(
            f"{path} holds no complete checkpoint (expected a run directory with checkpoints/step_N, "
            "or a step_N directory)."
        )
    return good[0], path


def consolidate(step_dir: Path, spec: RunSpec) -> dict[str, torch.Tensor]:
    """The full model state dict of `step_dir`, through its strategy's `consolidate`."""
    return strategy_module(spec.parallel.strategy).consolidate(step_dir)


def export(source: Path, out: Path) -> Path:
    """Write the full state dict of `source` (a checkpoint or run directory) to `out`; returns the checkpoint used."""
    step_dir, run_dir = locate(source)
    spec_path = run_dir / "spec.yaml"
    if not spec_path.is_file():
        raise ExportError(f"{spec_path} is missing: the export reads the run's spec to find its strategy.")
    spec = load_spec(spec_path)
    state = {k: v.detach().to("cpu").contiguous() for k, v in consolidate(step_dir, spec).items()}
    from launcher.groups.model.build import build_model

    build_model(spec.model).load_state_dict(state)  # proves it loads at world size 1 before writing
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    torch.save(state, partial)
    partial.replace(out)
    return step_dir


def main(argv: list[str] | None = None) -> int:
    """Console entry point of `train-export`."""
    parser = argparse.ArgumentParser(
        prog="train-export",
        description="Write a full model state dict (loads at world size 1) from a run's checkpoint.",
    )
    parser.add_argument("checkpoint", type=Path, help="a checkpoints/step_N directory, or a run directory")
    parser.add_argument("out", type=Path, help="the .pt file to write")
    args = parser.parse_args(argv)
    try:
        used = export(args.checkpoint, args.out)
    except (ExportError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return ExitStatus.INVALID_SPEC
    print(f"exported {used} -> {args.out}")
    return ExitStatus.OK


if __name__ == "__main__":
    sys.exit(main())
