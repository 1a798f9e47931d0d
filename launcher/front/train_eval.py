"""`train-eval SOURCE [key=value ...] [--out DIR]`: the run's evaluators after training, on one or several ranks.

SOURCE is a run directory (its newest complete checkpoint), a `checkpoints/step_N` directory, or a Hugging
Face folder (config.json and weights). A run is rebuilt from its spec.yaml, as training built it, and the
checkpoint's weights loaded; a folder becomes `model=hf model.path=FOLDER` (its own tokenizer, no held-out
loss unless `eval.loss=true`). Overrides may set `eval.*` (the tasks to run, their limit, ...), `parallel*`
and `launcher.nproc=N` (ranks on this machine). The spec is checked by the same rules as `train` (exit
status 2, nothing started). Results: `DIR/results.json` and a table, DIR being `RUN_DIR/eval/step_N` for a
run, `FOLDER-eval` beside a folder, or `--out` (docs/eval.md).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from launcher.components import checkpoint
from launcher.exits import ExitStatus
from launcher.spec import SpecError

ALLOWED = ("eval.", "eval=", "parallel.", "parallel=", "+parallel=", "launcher.nproc=")
"""The overrides train-eval takes: what to evaluate and on how many ranks, never the model itself."""

NOTHING = SpecError(
    ("eval.lm_eval.tasks", "eval.loss"),
    "there is nothing to evaluate: no lm-evaluation-harness task is set and the held-out loss is off. Name "
    "tasks with eval.lm_eval.tasks=[...] and eval.lm_eval.include_path=FOLDER, or set eval.loss=true.",
)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What train-eval evaluates: the composed config's source and overrides, the checkpoint, where results go."""

    config_path: str | None
    """spec.yaml's directory for a run; None: the shipped config (a Hugging Face folder)."""
    overrides: list[str]
    checkpoint: Path | None
    out: Path


def plan(source: Path, overrides: list[str], out: Path | None) -> Plan | SpecError:
    """The evaluation of `source` with `overrides`, or the one problem that stops it."""
    wrong = [item for item in overrides if not item.startswith(ALLOWED)]
    if wrong:
        return SpecError(
            ("train-eval",),
            f"`{wrong[0]}` cannot be set here: train-eval evaluates the model SOURCE holds, and takes eval.* "
            "(the evaluators), parallel=... and launcher.nproc=N (ranks on this machine) only.",
        )
    nproc = [item.partition("=")[2] for item in overrides if item.startswith("launcher.nproc=")]
    if nproc and nproc[-1].isdigit() and int(nproc[-1]) > 1:
        overrides = [*overrides, "launcher.backend=local"]  # a run trained inline: its ranks on this machine
    if (source / "config.json").is_file() and not (source / "spec.yaml").exists():
        out = out or source.parent / f"{source.name}-eval"
        hf = ["model=hf", f"model.path={source.resolve()}", "eval.loss=false"]
        return Plan(config_path=None, overrides=[*hf, *overrides], checkpoint=None, out=out)
    presets = [item for item in overrides if item.startswith(("parallel=", "+parallel="))]
    if presets:
        return SpecError(
            ("train-eval",),
            f"`{presets[0]}` picks a preset, and a run's spec.yaml holds keys, not presets: set the keys "
            "instead, e.g. parallel.strategy=ddp launcher.nproc=2 (the checkpoint loads on any layout).",
        )
    if source.name.startswith("step_"):
        reason = checkpoint.problem(source) if source.is_dir() else "it does not exist"
        if reason is not None:
            return SpecError(("SOURCE",), f"{source} is not a complete checkpoint: {reason}.")
        step_dir, run_dir = source, source.parent.parent
    else:
        found = checkpoint.resolve_resume(str(source), None) if (source / "spec.yaml").is_file() else []
        if not found:
            return SpecError(
                ("SOURCE",),
                f"{source} is neither a run directory with a complete checkpoint (spec.yaml, checkpoints/step_N), "
                "a step_N directory, nor a Hugging Face folder (config.json and weights). Give one of those.",
            )
        step_dir, run_dir = found[0], source
    out = out or run_dir / "eval" / step_dir.name
    return Plan(
        config_path=str(run_dir.resolve()),
        overrides=["resume=null", *overrides],
        checkpoint=step_dir,
        out=out,
    )


def _errors(errors: list[SpecError] | tuple[SpecError, ...]) -> int:
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    return int(ExitStatus.INVALID_SPEC)


def main(argv: list[str] | None = None) -> int:
    """`train-eval`: compose and check the spec, then run the evaluators on its ranks; the exit status."""
    parser = argparse.ArgumentParser(
        prog="train-eval",
        description="Run a run's evaluators (lm-evaluation-harness tasks, held-out loss) on a run directory, "
        "a step_N directory or a Hugging Face folder; prints a table and writes results.json. Exit status 2: "
        "bad input (nothing started).",
    )
    parser.add_argument(
        "source", type=Path, help="RUN_DIR, RUN_DIR/checkpoints/step_N or a Hugging Face folder"
    )
    parser.add_argument("overrides", nargs="*", help="eval.*=..., parallel=..., launcher.nproc=N")
    parser.add_argument(
        "--out", type=Path, default=None, help="where results.json goes (default: see docs/eval.md)"
    )
    args = parser.parse_args(argv)
    chosen = plan(args.source, args.overrides, args.out)
    if isinstance(chosen, SpecError):
        return _errors([chosen])
    from launcher.front import compose
    from launcher.launch.eval_ranks import run_evaluation

    out = chosen.out.resolve()
    source = compose.ConfigSource(
        config_path=chosen.config_path, config_name="spec" if chosen.config_path else "train"
    )
    cfg, errors = compose.compose_checked([*chosen.overrides, f"run_dir={out}"], source)
    if errors or cfg is None:
        return _errors(errors)
    built = compose.build(cfg)
    if built.errors:
        return _errors(built.errors)
    if not (built.spec.eval.has_benchmarks() or built.spec.eval.loss):
        return _errors([NOTHING])
    out.mkdir(parents=True, exist_ok=True)
    spec, text = built.written(out)
    (out / "spec.yaml").write_text(text)
    return run_evaluation(out / "spec.yaml", chosen.checkpoint, spec.launcher.nproc)


if __name__ == "__main__":
    sys.exit(main())
