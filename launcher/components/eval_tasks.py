"""lm-evaluation-harness tasks from local folders: the index, each task's config with its data paths made
absolute, what would need a download, the metric names a task will report, and the records they become.

Only the folders of `eval.lm_eval.include_path` are indexed (the harness's own tasks load their data from
the Hugging Face Hub, and nothing is downloaded here). A task's `dataset_kwargs.data_files` and a
`dataset_path` naming a folder are read relative to the task's YAML file, so a task folder can move as a
whole. The launching process (launcher.rules.evaluation) and the ranks (launcher.rank.eval_harness) both
read tasks through this module; lm-eval is imported where it is used.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from launcher.config.eval import LOSS_METRICS, EvalConfig, LmEvalConfig, lm_eval_record

BUILDERS = ("json", "csv", "parquet", "text", "arrow")
"""`datasets` builders that read local files named by `dataset_kwargs.data_files`."""
DEFAULT_METRICS = {
    "multiple_choice": ("acc", "acc_norm"),
    "loglikelihood": ("perplexity", "acc"),
    "loglikelihood_rolling": ("word_perplexity", "byte_perplexity", "bits_per_byte"),
    "generate_until": ("exact_match",),
}
"""The harness's metrics for a task of each output_type that lists none (lm_eval.api.task)."""
INSTALL = "pip install 'torch-launcher[eval]' (lm-eval==0.4.11), or scripts/install"
"""How to get the harness when it is missing."""


def task_index(include_path: str) -> dict[str, dict[str, Any]]:
    """Task, group and tag name -> the harness's index entry ("type", "yaml_path"), for the folder alone."""
    import logging

    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    return dict(TaskManager(include_path=str(include_path), include_defaults=False).task_index)


def _absolute(value: Any, folder: Path) -> Any:
    """A data_files value (a path, a list, or split -> paths) with relative paths read from `folder`."""
    if isinstance(value, dict):
        return {key: _absolute(item, folder) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_absolute(item, folder) for item in value]
    if isinstance(value, str) and "://" not in value and not Path(value).is_absolute():
        return str(folder / value)
    return value


def task_config(yaml_path: str | Path) -> dict[str, Any]:
    """A task's config as the harness reads it (`include`s merged, `!function`s imported), data paths absolute."""
    from lm_eval import utils

    yaml_path = Path(yaml_path)
    config = dict(utils.load_yaml_config(str(yaml_path), mode="full"))
    folder = yaml_path.parent
    kwargs = dict(config.get("dataset_kwargs") or {})
    if "data_files" in kwargs:
        kwargs["data_files"] = _absolute(kwargs["data_files"], folder)
        config["dataset_kwargs"] = kwargs
    path = config.get("dataset_path")
    if isinstance(path, str) and path not in BUILDERS and (folder / path).exists():
        config["dataset_path"] = str(folder / path)
    return config


def _files(value: Any) -> list[str]:
    """Every path named by a data_files value."""
    if isinstance(value, dict):
        return [path for item in value.values() for path in _files(item)]
    if isinstance(value, list | tuple):
        return [path for item in value for path in _files(item)]
    return [str(value)]


def download_problem(config: dict[str, Any]) -> str | None:
    """Why the task (its config from `task_config`) would download data, or None when all of it is local."""
    path = config.get("dataset_path")
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if path is None:
        return None if config.get("custom_dataset") else "it names no dataset_path"
    if path in BUILDERS:
        if files is None:
            return f"dataset_path is the `{path}` builder but dataset_kwargs.data_files names no files"
        missing = [name for name in _files(files) if "://" in name or not Path(name).exists()]
        if missing:
            return f"its data file {missing[0]} is not a local file"
        return None
    if not Path(path).exists():
        return f"dataset_path `{path}` is not a local folder (the harness would fetch it from the Hugging Face Hub)"
    return None


def task_metrics(config: dict[str, Any]) -> set[str]:
    """The metric names (as records name them, see `score_name`) the task will report."""
    listed = [
        item["metric"] for item in config.get("metric_list") or () if isinstance(item.get("metric"), str)
    ]
    metrics = listed or list(DEFAULT_METRICS.get(config.get("output_type", "generate_until"), ()))
    filters = [item.get("name", "none") for item in config.get("filter_list") or ()] or ["none"]
    return {score_name(f"{metric},{name}") for metric in metrics for name in filters}


def score_name(key: str) -> str:
    """A harness result key `metric,filter` as a record's metric: `metric`, or `metric_filter` for a named filter."""
    metric, _, name = key.partition(",")
    return metric if name in ("", "none") else f"{metric}_{name}"


def score_records(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The harness's `results` (task -> {"metric,filter": value, ...}) as records `eval/<task>/<metric>`;
    standard errors and values that are not finite numbers are left out."""
    records = {}
    for task, scores in results.items():
        for key, value in scores.items():
            if "," not in key or "_stderr" in key or isinstance(value, bool):
                continue
            if isinstance(value, int | float) and math.isfinite(value):
                records[lm_eval_record(task, score_name(key))] = float(value)
    return records


def leaf_tasks(name: str, index: dict[str, dict[str, Any]], seen: set[str] | None = None) -> list[str]:
    """The tasks a task, group or tag name runs (a group's or tag's members, recursively)."""
    seen = set() if seen is None else seen
    entry = index.get(name)
    if entry is None or name in seen:
        return []
    seen.add(name)
    if entry.get("type") in ("task", "python_task"):
        return [name]
    members = entry.get("task") or []
    members = [members] if isinstance(members, str) else members
    return [leaf for member in members if isinstance(member, str) for leaf in leaf_tasks(member, index, seen)]


def planned_records(cfg: LmEvalConfig) -> set[str]:
    """The records the tasks of `cfg` will produce: `eval/<task>/<metric>` of each task they run."""
    if not cfg.tasks or cfg.include_path is None:
        return set()
    index = task_index(cfg.include_path)
    records = set()
    for name in cfg.tasks:
        for leaf in leaf_tasks(name, index):
            path = index[leaf].get("yaml_path")
            if isinstance(path, str):
                records |= {lm_eval_record(leaf, metric) for metric in task_metrics(task_config(path))}
    return records


def planned_metrics(cfg: EvalConfig, source_names: Iterable[str] = ()) -> set[str]:
    """Every record the evaluators of `cfg` will produce, known before launch (for rules that name a metric,
    such as keeping the best checkpoint): the held-out loss's (with `eval_loss/<name>` per named source of a
    mixture) and each task's `eval/<task>/<metric>`. launcher.rank.evaluators gives the same per evaluator."""
    loss = {*LOSS_METRICS, *(f"eval_loss/{name}" for name in source_names)} if cfg.loss else set()
    return loss | planned_records(cfg.lm_eval)
