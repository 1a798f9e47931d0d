"""The `eval` group refuses bad input before launch, naming the key and the fix: an unknown task (the local
tasks listed), an include path without task YAMLs, a task whose data would be downloaded, values out of range;
train-eval refuses a source it cannot read, an override of the model and an evaluation of nothing (exit 2).
Metric names are known before launch from the task YAMLs, and trackers get them as recorded."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.components import eval_tasks
from launcher.components.loggers.records import tag
from launcher.front import compose, train_eval
from launcher.rank.evaluators import build_evaluators

pytest.importorskip("lm_eval")

TASKS = Path(__file__).parents[1] / "assets" / "lm_eval_tasks"
BOTH = ["eval.lm_eval.tasks=[tiny_choice,tiny_answer]", f"eval.lm_eval.include_path={TASKS}"]
HUB_TASK = """task: hub_task
dataset_path: some_org/some_dataset
output_type: multiple_choice
doc_to_text: "{{q}}"
doc_to_choice: "{{c}}"
doc_to_target: 0
"""
MISSING_FILE = """task: file_task
dataset_path: json
dataset_kwargs:
  data_files:
    test: not_there.jsonl
output_type: generate_until
doc_to_text: "{{q}}"
doc_to_target: "{{a}}"
"""


def errors(*argv: str) -> list[str]:
    """Every problem `train` would print for these overrides (an empty list: the spec is valid)."""
    return [str(error) for error in compose.build(compose.compose(list(argv))).errors]


def folder_with(tmp_path: Path, text: str) -> Path:
    """A task folder holding one YAML."""
    (tmp_path / "task.yaml").write_text(text)
    return tmp_path


def test_the_test_tasks_are_valid_and_their_metrics_known_before_launch() -> None:
    built = compose.build(compose.compose(BOTH))
    assert not built.errors
    expected = {"eval/tiny_choice/acc", "eval/tiny_choice/acc_norm", "eval/tiny_answer/exact_match"}
    assert build_evaluators(built.spec).metrics(built.spec) == expected | {"eval_loss", "eval_ppl"}
    assert eval_tasks.planned_metrics(built.spec.eval) == expected | {
        "eval_loss",
        "eval_ppl",
    }  # for the rules
    assert tag("eval/tiny_choice/acc") == "eval/tiny_choice/acc"  # trackers: the record's own name


def test_an_unknown_task_lists_the_local_tasks() -> None:
    (message,) = errors(f"eval.lm_eval.include_path={TASKS}", "eval.lm_eval.tasks=[tiny_choise]")
    assert message.startswith("eval.lm_eval.tasks:") and "no task `tiny_choise`" in message
    assert "The local tasks are: tiny_answer, tiny_choice." in message


def test_tasks_need_a_folder_that_holds_task_yamls(tmp_path) -> None:
    (message,) = errors("eval.lm_eval.tasks=[tiny_choice]")
    assert "eval.lm_eval.include_path" in message and "Hugging Face Hub" in message
    (message,) = errors("eval.lm_eval.tasks=[tiny_choice]", f"eval.lm_eval.include_path={tmp_path}")
    assert message.startswith("eval.lm_eval.include_path:") and "holds no task YAMLs" in message


@pytest.mark.parametrize(
    ("text", "name", "why"),
    [(HUB_TASK, "hub_task", "is not a local folder"), (MISSING_FILE, "file_task", "is not a local file")],
    ids=["hub-dataset", "missing-file"],
)
def test_a_task_whose_data_would_be_downloaded_is_refused(tmp_path, text, name, why) -> None:
    folder = folder_with(tmp_path, text)
    (message,) = errors(f"eval.lm_eval.include_path={folder}", f"eval.lm_eval.tasks=[{name}]")
    assert f"task `{name}`" in message and "would download its data" in message and why in message


def test_relative_data_files_are_read_beside_the_yaml() -> None:
    config = eval_tasks.task_config(TASKS / "tiny_choice.yaml")
    assert config["dataset_kwargs"]["data_files"] == {"test": str(TASKS / "tiny_choice.jsonl")}
    assert eval_tasks.download_problem(config) is None


def test_values_out_of_range_are_refused_naming_the_key() -> None:
    found = errors(
        "eval.every=0", "eval.lm_eval.limit=-1", "eval.lm_eval.num_fewshot=-1", "eval.lm_eval.batch_size=0"
    )
    for key in ("eval.every", "eval.lm_eval.limit", "eval.lm_eval.num_fewshot", "eval.lm_eval.batch_size"):
        assert any(message.startswith(f"{key}:") for message in found), (key, found)


def test_train_eval_refuses_what_it_cannot_evaluate(tmp_path, capsys) -> None:
    assert train_eval.main([str(tmp_path)]) == 2
    assert "neither a run directory" in capsys.readouterr().err
    assert train_eval.main([str(tmp_path), "model.n_layer=3"]) == 2
    assert "`model.n_layer=3` cannot be set here" in capsys.readouterr().err
    assert train_eval.main([str(tmp_path), "parallel=ddp"]) == 2  # a run's spec.yaml holds keys, not presets
    assert "parallel.strategy=ddp launcher.nproc=2" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")  # a Hugging Face folder, but no task named
    assert (
        train_eval.main([str(tmp_path), "eval.lm_eval.tasks=[nope]", f"eval.lm_eval.include_path={TASKS}"])
        == 2
    )
    assert "no task `nope`" in capsys.readouterr().err
