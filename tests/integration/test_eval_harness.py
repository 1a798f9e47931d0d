"""lm-evaluation-harness tasks on the model as trained: two local tasks (tests/assets/lm_eval_tasks: a
multiple-choice loglikelihood task and a generate_until task scored by exact match) on 2 FSDP2 ranks every 2
steps, the same scores as the `lm_eval` command line on the step's Hugging Face export, and `train-eval` on the
run directory. In the extended tier: `train-eval` on that export, and the comparison with LoRA, a pipeline and
tensor parallel.

One 4-step run is shared by the module; each run's step-2 export and its command-line scores are made once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY, run_ranks
from launcher.front import train_eval
from launcher.tools import export

pytest.importorskip("lm_eval")

TASKS = Path(__file__).parents[1] / "assets" / "lm_eval_tasks"
NAMES = ("tiny_choice", "tiny_answer")
SCORES = ("eval/tiny_choice/acc", "eval/tiny_choice/acc_norm", "eval/tiny_answer/exact_match")
RUN = [
    *TINY, "model=hf_llama_tiny", "tokenizer=hf", "train.max_steps=4", "train.eval_every=null", "eval.every=2",
    f"eval.lm_eval.tasks=[{','.join(NAMES)}]", f"eval.lm_eval.include_path={TASKS}", "checkpoint.every=2",
    "checkpoint.keep=2", "launcher=local", "launcher.nproc=2",
]  # fmt: skip
CASES = {
    "fsdp": ["parallel=fsdp"],
    "lora": ["parallel=fsdp", "quantization=lora", "quantization.lora.rank=4"],
    "pp": ["parallel=pp", "train.micro_batch_size=8"],
    "tp": ["parallel=tp", "train.micro_batch_size=8"],
}
_runs: dict[str, Path] = {}
_cli: dict[str, tuple[Path, dict[str, float]]] = {}


@pytest.fixture(scope="module")
def run(tmp_path_factory, hf_tokenizer):
    """The run directory of a case (2 ranks, 4 steps, tasks every 2 steps), trained on first use."""

    def get(name: str) -> Path:
        if name not in _runs:
            run_dir = tmp_path_factory.mktemp(name) / "run"
            proc = run_ranks([*RUN, *CASES[name], f"tokenizer.path={hf_tokenizer}"], run_dir, timeout=900)
            assert proc.returncode == 0, proc.stderr[-4000:]
            _runs[name] = run_dir
        return _runs[name]

    return get


def command_line_scores(folder: Path, out: Path) -> dict[str, float]:
    """The tasks' scores from `python -m lm_eval --model hf` on `folder`, as records eval/<task>/<metric>."""
    cmd = [
        sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={folder},dtype=float32",
        "--include_path", str(TASKS), "--tasks", ",".join(NAMES), "--batch_size", "4", "--device", "cpu",
        "--output_path", str(out),
    ]  # fmt: skip
    # a plain one-process command: not the rank variables an inline run earlier in the session left behind
    rank_vars = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in rank_vars}
    proc = subprocess.run(cmd, cwd=TASKS, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    return {
        f"eval/{task}/{key.split(',')[0]}": value
        for task, scores in results.items()
        for key, value in scores.items()
        if key.endswith(",none") and "_stderr" not in key
    }


@pytest.fixture(scope="module")
def command_line(run, tmp_path_factory):
    """A case's step-2 Hugging Face export (`train-export --format hf`) and the command line's scores on it."""

    def get(name: str) -> tuple[Path, dict[str, float]]:
        if name not in _cli:
            folder = tmp_path_factory.mktemp(f"{name}-hf") / "model"
            merge = ["--merge"] if name == "lora" else []
            step = run(name) / "checkpoints" / "step_2"
            assert export.main([str(step), str(folder), "--format", "hf", *merge]) == 0
            _cli[name] = folder, command_line_scores(folder, tmp_path_factory.mktemp(f"{name}-cli"))
        return _cli[name]

    return get


def eval_records(run_dir: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl's evaluation records by step."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {r["step"]: r for r in records if any(key.startswith("eval/") for key in r)}


def assert_same_scores(ours: dict[str, float], theirs: dict[str, float]) -> None:
    """Loglikelihood metrics within 1e-4, generation's exact match exactly."""
    for name in SCORES:
        if "exact_match" in name:
            assert ours[name] == theirs[name], name
        else:
            assert ours[name] == pytest.approx(theirs[name], abs=1e-4), name


def test_two_fsdp_ranks_report_the_task_scores_every_two_steps(run) -> None:
    run_dir = run("fsdp")
    records = eval_records(run_dir)
    assert sorted(records) == [2, 4]
    for record in records.values():
        assert set(SCORES) <= set(record)
        assert all(0.0 <= record[name] <= 1.0 for name in SCORES)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {name: summary[name] for name in SCORES} == {name: records[4][name] for name in SCORES}


def test_the_scores_equal_the_lm_eval_command_line_on_the_steps_export(run, command_line) -> None:
    _, theirs = command_line("fsdp")
    assert_same_scores(eval_records(run("fsdp"))[2], theirs)


def test_train_eval_on_the_run_directory_gives_the_runs_own_scores(run) -> None:
    run_dir = run("fsdp")
    assert train_eval.main([str(run_dir), "launcher.nproc=1"]) == 0
    results = json.loads((run_dir / "eval" / "step_4" / "results.json").read_text())
    assert results["step"] == 4
    assert_same_scores(results["scores"], eval_records(run_dir)[4])


@pytest.mark.extended  # train-eval on the run directory above, here on a Hugging Face folder (the step's export)
def test_train_eval_on_a_hugging_face_folder_equals_the_command_line(command_line, tmp_path) -> None:
    folder, theirs = command_line("fsdp")
    tasks = [f"eval.lm_eval.tasks=[{','.join(NAMES)}]", f"eval.lm_eval.include_path={TASKS}"]
    assert train_eval.main([str(folder), *tasks, "--out", str(tmp_path / "folder")]) == 0
    results = json.loads((tmp_path / "folder" / "results.json").read_text())
    assert results["step"] is None
    assert_same_scores(results["scores"], theirs)


@pytest.mark.extended  # the command-line comparison above (FSDP2), with LoRA adapters, a 2-stage pipeline, 2-way TP
@pytest.mark.parametrize("name", ["lora", "pp", "tp"])
def test_lora_pipeline_and_tp_scores_equal_the_command_line(name, run, command_line) -> None:
    _, theirs = command_line(name)
    records = eval_records(run(name))
    assert sorted(records) == [2, 4]
    assert_same_scores(records[2], theirs)
