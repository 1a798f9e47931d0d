"""The rollout step source: each step's micro batches sampled by the policy itself, on the training ranks.

Per step, this data-parallel rank takes its share of the step's prompts from a seeded prompt stream
(`PromptStream`: an epoch-seeded permutation of data.format=prompt records; the position, prompts
drawn so far, is the checkpoint's `data`), and samples objective.num_generations completions of each
with launcher.components.model.generation.generate over the model as it trains (FSDP2's hooks gather
the shards, injected adapters take part; a DDP wrapper is looked through). Each completion is seeded
by (train.seed, step, the prompt's global position, the sample), so the rollouts are the same on any
world size and after a resume. The completions are decoded, then SCORED by the source's `Scoring`
hook, which gives each row the per-row (or per-token) tensors the objective reads:

- `RewardScoring` (launcher.rank.rollout_scoring): rewards of the reward functions, then advantages
  (group-normalised for grpo, leave-one-out for rloo) and `keep` (0 on the rows of a dropped group);
- another objective plugs in its own (on-policy distillation: a teacher's token log-probs of the same
  rows), as a class with `score(rollouts, ctx) -> dict[str, Tensor]` and `record(data_sum)`.

A micro batch's rows are prompt + completion, left-aligned (positions from 0, as a training forward
has them) and right-padded: `input_ids`, `labels` (the completion's tokens; -100 on the prompt and the
padding), and the scoring's keys; with objective.num_iterations > 1 also `old_logps`, the sampling
policy's per-token log-probs (one no-grad forward of the rows), and the same batches serve that many
optimizer steps. A resume inside such a cycle samples a fresh batch for the cycle's remaining steps.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from launcher.components.data.interleave import HeldOut
from launcher.components.data.prompts import Prompt, decode
from launcher.components.data.tokenizer import Tokenizer
from launcher.components.model.generation import Sampling, generate
from launcher.components.model.loss import model_inputs
from launcher.components.precision import autocast
from launcher.config.objective import ObjectiveConfig
from launcher.rank.sources import Batch, SourceContext

__all__ = ["PromptStream", "RolloutSource", "Rollouts", "Scoring"]

ROLLOUTS_FILE = "rollouts.jsonl"
"""Where objective.log_rollouts writes each step's first rollouts, in the run directory."""


class PromptStream:
    """Global prompt positions -> record indices: each epoch a permutation of the records seeded by (seed, epoch)."""

    def __init__(self, num_prompts: int, seed: int) -> None:
        self.num_prompts, self.seed = num_prompts, seed
        self._epoch: tuple[int, list[int]] | None = None

    def index(self, position: int) -> int:
        """The record at global position `position` (0-based, over every epoch)."""
        epoch = position // self.num_prompts
        if self._epoch is None or self._epoch[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch = (epoch, torch.randperm(self.num_prompts, generator=generator).tolist())
        return self._epoch[1][position % self.num_prompts]


@dataclass(kw_only=True)
class Rollouts:
    """One step's rollouts on this rank, prompt-major (a prompt's num_generations rows side by side)."""

    prompts: list[Prompt]
    """Each row's prompt record (repeated for each of its samples)."""
    completions: list[list[int]]
    """Each row's completion ids (the stop id that ended it included, as trained)."""
    texts: list[str]
    """Each row's completion decoded."""
    truncated: list[bool]
    """Whether each row was cut at objective.max_completion_length (no stop id came)."""
    rows: Batch
    """input_ids and labels [rows, T] of every row (CPU)."""
    group_size: int
    """objective.num_generations."""
    step: int
    """The 0-based step the rollouts are for."""


class Scoring(Protocol):
    """How a step's rollouts become the per-row tensors the objective trains on (the rollout source's hook)."""

    def score(self, rollouts: Rollouts, ctx: SourceContext) -> dict[str, torch.Tensor]:
        """Tensors with one row per rollout row (advantages, keep, or a teacher's token log-probs) to add to the batches."""
        ...

    def record(self, data_sum: Callable[[list[float]], list[float]]) -> dict[str, float]:
        """Metrics since the last call, summed over data-parallel ranks with `data_sum` (a collective)."""
        ...


def policy_module(model: nn.Module) -> nn.Module:
    """The module generation drives: a DDP wrapper's module (same parameters, no reducer hooks), else the model."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def padded_rows(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> Batch:
    """input_ids and labels of prompt + completion rows, left-aligned and right-padded (id 0, label -100)."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True)) - 1
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    labels = torch.full((len(prompts), width), -100, dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        full = torch.tensor([*prompt, *completion], dtype=torch.long)
        ids[row, : len(full) - 1] = full[:-1]
        labels[row, len(prompt) - 1 : len(full) - 1] = full[len(prompt) :]
    return {"input_ids": ids, "labels": labels}


def policy_logps(rows: Batch, ctx: SourceContext, *, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """The policy's per-token log-probs of `rows`' labels (masked, CPU), in micro batches under no_grad and autocast."""
    from launcher.components.objectives.policy_gradient import token_logps
    from launcher.components.objectives.preference import logits_of

    size, device, out = ctx.batch.micro_batch_size, ctx.dist.device, []
    with torch.no_grad():
        for i in range(0, len(rows["input_ids"]), size):
            part = {k: v[i : i + size].to(device) for k, v in rows.items()}
            with autocast(dtype, device.type):
                logits = logits_of(ctx.strategy.model(**model_inputs(part)))
            out.append(token_logps(logits, part["labels"], temperature)[0].cpu())
    return torch.cat(out)


class RolloutSource:
    """The StepSource of grpo and rloo: this rank's prompts, sampled by the policy, scored, cut into micro batches."""

    held_out: tuple[HeldOut, ...] = ()  # nothing held out: evaluation of a policy is the eval group's

    def __init__(
        self,
        prompts: list[Prompt],
        *,
        objective: ObjectiveConfig,
        tokenizer: Tokenizer,
        scoring: Scoring,
        seed: int,
        context: int,
        dtype: torch.dtype,
        run_dir: Path | None = None,
    ) -> None:
        self.prompts, self.cfg, self.tokenizer, self.scoring = prompts, objective, tokenizer, scoring
        self.seed, self.context, self.dtype, self.run_dir = seed, context, dtype, run_dir
        self.stream = PromptStream(len(prompts), seed)
        self.position = 0
        """Prompts drawn over every rank so far (the checkpoint's `data`)."""
        self._cycle: tuple[int, list[Batch]] | None = None
        """With objective.num_iterations > 1: the step that sampled the cycle's batches, and the batches."""
        self._sums = {"generate_s": 0.0, "generated_tokens": 0.0, "clock": time.perf_counter()}
        self._ctx: SourceContext | None = None

    # ----- the StepSource protocol -----------------------------------------------------------------
    def micro_batches(self, step: int, ctx: SourceContext) -> list[Batch]:
        """This rank's grad_accum_steps micro batches of step `step`: sampled now, or the cycle's again."""
        self._ctx = ctx
        every = self.cfg.num_iterations
        if self._cycle is not None and step // every == self._cycle[0] // every:
            return self._cycle[1]
        batches = self._sample(step, ctx)
        self._cycle = (step, batches) if every > 1 else None
        return batches

    def record(self) -> dict[str, float]:
        """The scoring's metrics, generation's share of the interval's time and generated tokens/s (a collective)."""
        ctx = self._ctx
        if ctx is None:
            return {}
        now = time.perf_counter()
        elapsed = max(now - self._sums["clock"], 1e-9)
        generate_s, tokens = ctx.dist.data_sum([self._sums["generate_s"], self._sums["generated_tokens"]])
        ranks = max(ctx.dist.dp_size, 1)
        self._sums = {"generate_s": 0.0, "generated_tokens": 0.0, "clock": now}
        return {
            **self.scoring.record(ctx.dist.data_sum),
            "generation_share": generate_s / ranks / elapsed,
            "generated_tokens_per_s": tokens / elapsed,
        }

    def state_dict(self) -> dict[str, Any]:
        """Prompts drawn so far, the same on every rank."""
        return {"prompts_drawn": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the prompt stream at `state`'s position."""
        self.position = int(state["prompts_drawn"])
        self._cycle = None

    # ----- one step's rollouts ---------------------------------------------------------------------
    def _share(self, ctx: SourceContext) -> tuple[list[int], int]:
        """(this rank's prompts' global positions, the prompts every rank draws together this step)."""
        rows = ctx.batch.micro_batch_size * ctx.batch.grad_accum_steps
        per_rank = rows // self.cfg.num_generations
        first = self.position + ctx.dist.dp_rank * per_rank
        return list(range(first, first + per_rank)), per_rank * ctx.dist.dp_size

    def _sample(self, step: int, ctx: SourceContext) -> list[Batch]:
        positions, drawn = self._share(ctx)
        self.position += drawn
        n = self.cfg.num_generations
        prompts = [self.prompts[self.stream.index(p)] for p in positions for _ in range(n)]
        started = time.perf_counter()
        completions = generate(
            policy_module(ctx.strategy.model),
            [p.ids for p in prompts],
            max_new_tokens=self.cfg.max_completion_length,
            sampling=Sampling(
                temperature=self.cfg.temperature, top_k=self.cfg.top_k, top_p=self.cfg.top_p, seed=self.seed + step
            ),
            stop_ids=() if self.tokenizer.eos_id is None else (self.tokenizer.eos_id,),
            context=self.context,
            indices=[p * n + s for p in positions for s in range(n)],
            vocab_limit=self.tokenizer.vocab_size,
        )  # fmt: skip
        self._sums["generate_s"] += time.perf_counter() - started
        ids = [c.ids + ([c.eos_id] if c.stop == "eos" else []) for c in completions]
        self._sums["generated_tokens"] += sum(len(i) for i in ids)
        rollouts = Rollouts(
            prompts=prompts, completions=ids, texts=[decode(self.tokenizer, c.ids) for c in completions],
            truncated=[c.stop == "max_new_tokens" for c in completions],
            rows=padded_rows([p.ids for p in prompts], ids), group_size=n, step=step,
        )  # fmt: skip
        rows = dict(rollouts.rows)
        if self.cfg.num_iterations > 1:
            rows["old_logps"] = policy_logps(rows, ctx, temperature=self.cfg.temperature, dtype=self.dtype)
        rows.update(self.scoring.score(rollouts, ctx))
        self._log(rollouts, rows, ctx)
        size = ctx.batch.micro_batch_size
        return [
            {key: value[i : i + size] for key, value in rows.items()} for i in range(0, len(prompts), size)
        ]

    def _log(self, rollouts: Rollouts, rows: Batch, ctx: SourceContext) -> None:
        """objective.log_rollouts: the first rollouts of data-parallel rank 0 to rollouts.jsonl (one line each)."""
        count = self.cfg.log_rollouts
        if not count or self.run_dir is None or ctx.dist.dp_rank != 0 or not ctx.dist.is_main:
            return
        lines = []
        for i in range(min(count, len(rollouts.texts))):
            line: dict[str, Any] = {
                "step": rollouts.step + 1, "prompt": rollouts.prompts[i].text, "completion": rollouts.texts[i],
                "truncated": rollouts.truncated[i],
            }  # fmt: skip
            for key in ("reward", "advantages"):
                if key in rows:
                    line[key.rstrip("s")] = float(rows[key][i])
            lines.append(json.dumps(line, ensure_ascii=False))
        with open(self.run_dir / ROLLOUTS_FILE, "a", encoding="utf-8") as out:
            out.write("\n".join(lines) + "\n")
