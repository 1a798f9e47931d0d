"""What evaluations drive, judged before launch (launcher/rules/best.py), and the pieces the loop uses: which
way a metric improves (launcher/config/best.py) and the best checkpoint kept across a resume onto its line
(launcher/components/checkpoint_aside.py). The runs: tests/integration/test_keep_best.py."""

from __future__ import annotations

import math
from pathlib import Path

from conftest import TINY, run_cli
from launcher.components import checkpoint, checkpoint_aside, checkpoint_best
from launcher.config.best import direction, improves
from launcher.front.cli import precheck

KEEP = ["checkpoint.keep_best=eval_loss", "train.eval_every=10", "checkpoint.every=10"]


def _errors(*argv: str) -> dict[tuple[str, ...], str]:
    return {e.keys: " ".join(e.message.split()) for e in precheck(list(argv))}


def test_a_valid_spec_passes() -> None:
    assert _errors(*KEEP, "train.early_stop.metric=eval_ppl", "train.early_stop.min_delta=0.01") == {}
    assert _errors(*KEEP, "checkpoint.every=5") == {}  # every evaluation step is a checkpoint step


def test_a_metric_no_evaluation_produces_is_refused_with_the_list() -> None:
    errors = _errors(
        *KEEP, "checkpoint.keep_best=eval/generation/accuracy", "train.early_stop.metric=eval_los"
    )
    assert "produces the metric 'eval/generation/accuracy'" in errors[("checkpoint.keep_best",)]
    assert "The metrics it produces: eval_loss, eval_ppl." in errors[("checkpoint.keep_best",)]
    assert "Did you mean eval_loss?" in errors[("train.early_stop.metric",)]
    tasks = [
        "eval.lm_eval.tasks=[tiny_choice,tiny_answer]",
        f"eval.lm_eval.include_path={Path(__file__).parents[1] / 'assets' / 'lm_eval_tasks'}",
    ]
    harness = _errors(*KEEP, *tasks, "checkpoint.keep_best=eval/tiny_choice/accuracy",
                      "train.early_stop.metric=eval/tiny_answer/exact_match")  # fmt: skip
    assert list(harness) == [("checkpoint.keep_best",)]  # the tasks' metrics, read from their YAMLs
    assert "Did you mean eval/tiny_choice/acc?" in harness[("checkpoint.keep_best",)]
    never = _errors("train.early_stop.metric=eval_loss", "train.eval_every=null", "train.eval_at_end=false")
    assert "this run makes no evaluation" in never[("train.early_stop.metric",)]


def test_keep_best_needs_a_checkpoint_at_every_evaluation() -> None:
    off = _errors(*KEEP, "checkpoint.every=null")
    assert "checkpoint.every=null writes none" in off[("checkpoint.keep_best", "checkpoint.every")]
    apart = _errors(*KEEP, "checkpoint.every=4")
    message = apart[("checkpoint.keep_best", "train.eval_every", "checkpoint.every")]
    assert (
        "eval_loss is measured every 10 steps (train.eval_every), not a multiple of checkpoint.every=4"
        in message
    )
    assert "checkpoint.every=10" in message  # the fix
    score = _errors(*KEEP, "checkpoint.keep_best=eval/generation/accuracy", "eval.generation.prompts=p.jsonl",
                    "eval.every=15")  # fmt: skip
    assert (
        "(eval.every), not a multiple of checkpoint.every=10"
        in score[("checkpoint.keep_best", "eval.every", "checkpoint.every")]
    )
    end = _errors(*KEEP, "train.max_steps=25", "checkpoint.save_final=false")
    assert "Set checkpoint.save_final=true" in end[("checkpoint.keep_best", "checkpoint.save_final")]


def test_bad_patience_min_delta_and_mode_are_refused() -> None:
    errors = _errors("train.early_stop.metric=eval_loss", "train.early_stop.patience=0",
                     "train.early_stop.min_delta=-0.1", "checkpoint.keep_best_mode=lower")  # fmt: skip
    assert "must be 1 or more, got 0" in errors[("train.early_stop.patience",)]
    assert "0 or more, got -0.1" in errors[("train.early_stop.min_delta",)]
    assert "'lower'" in errors[("checkpoint.keep_best_mode",)]
    counts = _errors("train.early_stop.metric=eval_loss", "train.eval_every=null", "train.eval_at_end=true")
    assert (
        "train.eval_every=null measures eval_loss only at the end"
        in counts[("train.early_stop.metric", "train.eval_every")]
    )


def test_the_command_line_exits_2_before_anything_starts(tmp_path: Path) -> None:
    result = run_cli([*TINY, "checkpoint.keep_best=accuracy", f"run_dir={tmp_path / 'run'}"], tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "checkpoint.keep_best" in result.stdout + result.stderr and not (tmp_path / "run").exists()


def test_which_way_a_metric_improves() -> None:
    assert [
        direction(m, "auto") for m in ("eval_loss", "eval_loss/code", "eval_ppl", "eval/wiki/word_perplexity")
    ] == ["min"] * 4
    assert (
        direction("eval/generation/accuracy", "auto") == direction("eval/generation/pass@4", "auto") == "max"
    )
    assert direction("eval_loss", "max") == "max"
    assert improves(1.0, None, "min") and not improves(math.nan, None, "min")
    assert improves(0.8, 1.0, "min", 0.1) and not improves(0.9, 1.0, "min", 0.1)  # by more than min_delta
    assert improves(0.6, 0.5, "max") and not improves(0.5, 0.5, "max")


def test_a_resume_keeps_the_best_its_line_records(tmp_path: Path) -> None:
    """The best's descendants were pruned (keep=1), so the line from latest no longer reaches it: it stays anyway."""
    run_dir = tmp_path / "run"
    for step in (10, 20, 30):
        checkpoint.save(
            run_dir, step, lambda f: f.save({"w": [1]}, "model.pt"), keep=1, info={"best": "step_10"}
        )
    checkpoint.start_session(run_dir)
    assert [p.name for p in checkpoint.good_checkpoints(run_dir)] == ["step_30", "step_10"]
    base = checkpoint.root(run_dir)
    assert checkpoint_aside.abandon_branches(run_dir, base / "step_30") == []
    assert checkpoint_best.named(base) == base / "step_10"
    checkpoint.save(run_dir, 40, lambda f: f.save({"w": [1]}, "model.pt"), keep=3, info={"best": "step_40"})
    assert checkpoint_best.named(base) == base / "step_40"
    lines = checkpoint_aside.abandon_branches(run_dir, base / "step_30")  # back onto step_30's line
    assert len(lines) == 1 and "step_40" in lines[0]
    assert checkpoint_best.named(base) == base / "step_10"
