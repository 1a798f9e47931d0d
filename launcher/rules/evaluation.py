"""Rules of the `eval` group: lm-eval installed, the task folder holding task YAMLs, every task named found
there with its data in local files, and the parallel layouts the evaluators run under."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from launcher.components import eval_tasks
from launcher.rules.hardware import Hardware
from launcher.rules.values import installed
from launcher.spec import RunSpec, SpecError

TASKS, INCLUDE = "eval.lm_eval.tasks", "eval.lm_eval.include_path"
SHOWN = 20
"""Local task names listed in an error at most."""


def _harness(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    cfg = spec.eval.lm_eval
    if not cfg.tasks:
        return
    if not installed("lm_eval"):
        yield SpecError(
            (TASKS,),
            f"lm-evaluation-harness tasks need the lm-eval package, which is not installed here. Install it "
            f"with {eval_tasks.INSTALL}, or leave {TASKS} empty.",
        )
        return
    if cfg.include_path is None:
        yield SpecError(
            (TASKS, INCLUDE),
            "tasks are read from a local folder of task YAMLs, and none is set: the harness's own tasks fetch "
            f"their data from the Hugging Face Hub, which a run never does. Set {INCLUDE}=FOLDER (task YAMLs "
            "with their data in local files, docs/eval.md), or leave the tasks empty.",
        )
        return
    yield from _tasks(spec)


def _tasks(spec: RunSpec) -> Iterator[SpecError]:
    cfg = spec.eval.lm_eval
    folder = Path(str(cfg.include_path)).expanduser()
    if not folder.is_dir():
        yield SpecError(
            (INCLUDE,), f"{folder} is not a directory. Give the folder that holds the task YAMLs."
        )
        return
    index = eval_tasks.task_index(str(folder))
    if not index:
        yield SpecError(
            (INCLUDE,),
            f"{folder} holds no task YAMLs (files *.yaml with a `task:` key, searched recursively). Put the "
            "tasks' YAML files there (docs/eval.md shows one), or point it at the folder that has them.",
        )
        return
    for name in cfg.tasks:
        if name not in index:
            known = sorted(index)
            shown = ", ".join(known[:SHOWN]) + (
                f" and {len(known) - SHOWN} more" if len(known) > SHOWN else ""
            )
            yield SpecError(
                (TASKS,),
                f"no task `{name}` in {folder}. The local tasks are: {shown}. Name one of them, or add the "
                "task's YAML to that folder.",
            )
            continue
        for leaf in eval_tasks.leaf_tasks(name, index):
            path = index[leaf].get("yaml_path")
            problem = (
                eval_tasks.download_problem(eval_tasks.task_config(path)) if isinstance(path, str) else None
            )
            if problem:
                yield SpecError(
                    (TASKS,),
                    f"task `{leaf}` ({path}) would download its data: {problem}. Runs read task data from local "
                    "files only: set dataset_path to a builder such as json with dataset_kwargs.data_files "
                    "naming local files (relative to the YAML), or to a local dataset folder.",
                )


def _layout(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    if not spec.eval.has_benchmarks():
        return
    if spec.parallel.cp_size > 1:
        yield SpecError(
            (TASKS, "parallel.cp_size"),
            "lm-evaluation-harness tasks do not run under context parallelism (each rank holds part of every "
            "sequence). Train with parallel.cp_size=1, or run the tasks after training with train-eval on the "
            "run directory.",
        )
    if spec.parallel.method.owns_engine:
        yield SpecError(
            (TASKS, "parallel.strategy"),
            f"lm-evaluation-harness tasks do not run inside DeepSpeed's engine (parallel.strategy="
            f"{spec.parallel.strategy}) yet. Use parallel=fsdp (FSDP2, ZeRO-3's counterpart), or run the tasks "
            "after training with train-eval on the run directory.",
        )


RULES = (_harness, _layout)
