"""The `lm_eval` evaluator: lm-evaluation-harness tasks on the model as trained, through its Python API.

Every rank calls `lm_eval.simple_evaluate` with the same tasks (local task YAMLs, launcher.components.
eval_tasks) and a `RankLM` (launcher.rank.eval_lm) that splits the requests over the data-parallel ranks
and gathers the answers, so the harness computes the same scores on every rank. The evaluation runs under
the eval precision on the weights as evaluated for the held-out loss (a schedule-free optimizer's average);
the Python, NumPy and torch random states are restored after it, so evaluating never changes training.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from launcher.components import eval_tasks, quiet
from launcher.components.data.hf_tokenizer import open_folder
from launcher.components.precision import cast_weights, eval_dtype
from launcher.components.schedule_free import averaged_weights
from launcher.config.eval import LmEvalConfig
from launcher.config.tokenizer import TokenizerConfig
from launcher.parallel.runner import ModelRunner
from launcher.rank.loop_parts import Components
from launcher.spec import RunSpec

PROGRESS = ("it/s]", "s/it]", "examples/s]")
"""The harness's and datasets' progress bars (tqdm lines), held back unless log.verbose (launcher.components.quiet)."""


class ByteTokens:
    """The byte tokenizer (`tokenizer.kind=bytes`: UTF-8 bytes as ids 0..255, eos 0) in the calls the harness makes."""

    eos_token_id = 0
    bos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's UTF-8 bytes."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The bytes as text (eos dropped with skip_special_tokens; invalid UTF-8 replaced)."""
        kept = [i for i in ids if not (skip_special_tokens and i == self.eos_token_id)]
        return bytes(kept).decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return 256


def run_tokenizer(cfg: TokenizerConfig) -> Any:
    """The run's tokenizer as the harness's calls need it: the local folder (kind=hf) or `ByteTokens`."""
    return ByteTokens() if cfg.kind == "bytes" else open_folder(str(cfg.path))


@contextlib.contextmanager
def kept_random_state() -> Iterator[None]:
    """Python's, NumPy's and torch's random states as they were before (the harness seeds all three)."""
    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


class LmEvalEvaluator:
    """lm-evaluation-harness tasks (`eval.lm_eval`), records `eval/<task>/<metric>`."""

    name = "lm_eval"

    def __init__(self, cfg: LmEvalConfig) -> None:
        self.cfg = cfg
        self._tokenizer: Any = None

    def _tasks(self) -> list[Any]:
        """Each task's config with its data paths absolute (groups and tags by name)."""
        index = eval_tasks.task_index(str(self.cfg.include_path))
        tasks: list[Any] = []
        for name in self.cfg.tasks:
            entry = index[name]
            is_task = entry.get("type") == "task" and isinstance(entry.get("yaml_path"), str)
            tasks.append(eval_tasks.task_config(entry["yaml_path"]) if is_task else name)
        return tasks

    def metrics(self, spec: RunSpec) -> set[str]:
        """`eval/<task>/<metric>` for each task's metrics (from its YAML)."""
        return eval_tasks.planned_records(spec.eval.lm_eval)

    def run(self, parts: Components, step: int) -> dict[str, float]:
        """Run the tasks on every rank (collective); the harness's scores as records."""
        import lm_eval
        from lm_eval.tasks import TaskManager

        from launcher.rank.eval_lm import RankLM

        spec, model = parts.spec, parts.strategy.model
        if self._tokenizer is None:
            self._tokenizer = run_tokenizer(spec.tokenizer)
        dtype = eval_dtype(spec.precision)
        bare = (
            model.module if isinstance(model, DistributedDataParallel) else model
        )  # generation calls it directly
        lm = RankLM(
            model=bare, runner=parts.runner, dist=parts.dist, tokenizer=self._tokenizer,
            context=spec.model.max_seq_len, dtype=dtype, batch_size=self.cfg.batch_size,
            max_gen_tokens=self.cfg.max_gen_tokens, pipelined=not isinstance(parts.runner, ModelRunner),
        )  # fmt: skip
        limit = self.cfg.limit
        limit = int(limit) if limit is not None and limit >= 1 else limit
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
        manager = TaskManager(include_path=str(self.cfg.include_path), include_defaults=False)
        with averaged_weights(parts.strategy.optimizer), kept_random_state(), quiet.held_prints(PROGRESS):
            model.eval()
            with cast_weights(model, dtype, enabled=spec.precision.eval_cast):
                results = lm_eval.simple_evaluate(
                    model=lm, tasks=self._tasks(), num_fewshot=self.cfg.num_fewshot, limit=limit,
                    task_manager=manager, bootstrap_iters=0, log_samples=False, verbosity="ERROR",
                )  # fmt: skip
            model.train()
        return eval_tasks.score_records(results["results"])
