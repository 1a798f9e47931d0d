"""The step-input source of on-policy distillation: the rollout source, its completions scored by a teacher.

The prompts are the corpus's (launcher.components.data.corpus_prompts: a record's prompt part, or a text
document's windows), and each step's are sampled by the student with the rollout source of online RL
(launcher.rank.rollouts.RolloutSource: one completion per prompt, distill.max_new_tokens at most, the
distill group's sampling keys, seeded per (seed, step, prompt, sample), so any world size and a resumed
run sample the same tokens). Its scoring hook here only flags each row (`completion_clipped`,
`on_policy`): the teacher scores the student's tokens in the objective itself
(launcher.components.objectives.on_policy), whose loss needs the teacher's whole distribution at each
position, not a number per row, and reads it one micro batch at a time.

A step is on-policy with probability distill.lmbda (seeded by the seed and the step, the same on every
rank); the other steps take the same prompts from the same stream with the data's own completions
(what GKD trains on off-policy). At an evaluation, `held_out_scores` samples completions of the first
distill.eval_prompts held-out prompts (the same seed each time) and reports the student-teacher KL per
completion token (`eval_kl`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from launcher.components.data.corpus_prompts import CorpusPrompts, Prompts, prompt_spans
from launcher.components.data.interleave import HeldOut
from launcher.components.data.tokens import Corpus
from launcher.components.model.generation import Sampling, generate
from launcher.components.objectives.on_policy import CLIPPED, SAMPLED, OnPolicyDistiller
from launcher.components.precision import autocast, eval_dtype
from launcher.config.distill import DistillConfig
from launcher.parallel.dims import DistContext
from launcher.rank.rollouts import Rollouts, RolloutSource, padded_rows, policy_module
from launcher.rank.sources import Batch, SourceContext
from launcher.spec import RunSpec

if TYPE_CHECKING:
    from launcher.rank.loop_parts import Components


def seed_of(seed: int, *parts: object) -> int:
    """A 63-bit seed from the run's seed and what it is for ('lmbda' and the step, 'eval')."""
    digest = hashlib.sha256(":".join(str(p) for p in (seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


class RowFlags:
    """The rollout source's scoring hook for distillation: each row flagged sampled, and whether it was clipped."""

    def score(self, rollouts: Rollouts, ctx: SourceContext) -> dict[str, torch.Tensor]:
        """`completion_clipped` and `on_policy` per row (the teacher scores the tokens in the objective)."""
        return {
            CLIPPED: torch.tensor(rollouts.truncated, dtype=torch.float32),
            SAMPLED: torch.ones(len(rollouts.truncated)),
        }

    def record(self, data_sum: Callable[[list[float]], list[float]]) -> dict[str, float]:
        """Nothing: the objective records the KL and the completions' lengths."""
        return {}


class OnPolicySource:
    """The corpus's prompts, completed by the student (or the data) each step (the StepSource protocol)."""

    def __init__(
        self,
        rollouts: RolloutSource,
        spans: Prompts,
        eval_spans: Prompts,
        *,
        cfg: DistillConfig,
        seed: int,
        held_out: tuple[HeldOut, ...],
    ) -> None:
        self.rollouts, self.spans, self.eval_spans = rollouts, spans, eval_spans
        self.cfg, self.seed, self.held_out = cfg, seed, held_out

    def on_policy(self, step: int) -> bool:
        """Whether step `step` trains on the student's samples (a share distill.lmbda of the steps)."""
        if self.cfg.lmbda >= 1.0:
            return True
        generator = torch.Generator().manual_seed(seed_of(self.seed, "lmbda", step))
        return float(torch.rand((), generator=generator)) < self.cfg.lmbda

    def micro_batches(self, step: int, ctx: SourceContext) -> list[Batch]:
        """This rank's grad_accum_steps micro batches of step `step`: sampled by the student, or the data's own."""
        if self.on_policy(step):
            return self.rollouts.micro_batches(step, ctx)
        size, rows = ctx.batch.micro_batch_size, ctx.batch.micro_batch_size * ctx.batch.grad_accum_steps
        first = self.rollouts.position + ctx.dist.dp_rank * rows  # the stream the rollouts draw from
        self.rollouts.position += rows * ctx.dist.dp_size
        indices = [self.rollouts.stream.index(p) for p in range(first, first + rows)]
        completions = [self.spans.completion(i) for i in indices]
        batch = padded_rows([self.spans.prompt(i) for i in indices], completions)
        batch[CLIPPED] = torch.tensor([float(len(c) >= self.cfg.max_new_tokens) for c in completions])
        batch[SAMPLED] = torch.zeros(rows)
        return [{key: value[i : i + size] for key, value in batch.items()} for i in range(0, rows, size)]

    @torch.no_grad()
    def held_out_scores(self, parts: Components) -> dict[str, float]:
        """eval_kl (KL(student || teacher) per completion token) and eval_completion_len over the held-out
        prompts, summed over data-parallel ranks (collective: every rank runs the same forwards)."""
        objective, dist, cfg = parts.objective, parts.dist, self.cfg
        count = min(cfg.eval_prompts, len(self.eval_spans))
        if count == 0 or not isinstance(objective, OnPolicyDistiller):
            return {}
        slots = [dist.dp_rank + i * dist.dp_size for i in range(-(-count // dist.dp_size))]
        prompts = [self.eval_spans.prompt(slot % count) for slot in slots]  # wrapped ones weigh 0 below
        model = policy_module(parts.strategy.model)
        sampling = Sampling(
            temperature=cfg.sampling_temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            seed=seed_of(self.seed, "eval"),
        )
        completions = generate(
            model, prompts, max_new_tokens=cfg.max_new_tokens, sampling=sampling, stop_ids=self.rollouts_stop_ids,
            context=self.rollouts.context, indices=slots, vocab_limit=self.rollouts.tokenizer.vocab_size,
        )  # fmt: skip
        batch = padded_rows(
            prompts, [c.ids + ([c.eos_id] if c.eos_id is not None else []) for c in completions]
        )
        counted = torch.tensor([slot < count for slot in slots])[:, None]
        batch["labels"] = torch.where(counted, batch["labels"], torch.full_like(batch["labels"], -100))
        batch = {k: v.to(dist.device) for k, v in batch.items()}
        model.eval()
        with autocast(eval_dtype(parts.spec.precision), dist.device.type):
            kl = objective.kl_sum(model(batch["input_ids"]), objective.teacher_logits(batch), batch["labels"])
        model.train()
        kl_sum, tokens = dist.data_sum([float(kl), float((batch["labels"] != -100).sum())])
        return {"eval_kl": kl_sum / max(tokens, 1.0), "eval_completion_len": tokens / count}

    @property
    def rollouts_stop_ids(self) -> tuple[int, ...]:
        """The ids a completion stops at: the tokenizer's eos, as the rollouts stop."""
        eos = self.rollouts.tokenizer.eos_id
        return () if eos is None else (eos,)

    def record(self) -> dict[str, float]:
        """The rollouts' generation share and tokens/s, and passes over the prompts so far (`epoch`)."""
        return {**self.rollouts.record(), "epoch": self.rollouts.position / len(self.spans)}

    def state_dict(self) -> dict[str, Any]:
        """The prompt stream's position (the rollouts' and the data steps' alike)."""
        return self.rollouts.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the prompt stream at `state`'s position."""
        self.rollouts.load_state_dict(state)


def build_source(
    spec: RunSpec, corpus: Corpus, dist: DistContext, dtype: torch.dtype, run_dir: Path | None
) -> OnPolicySource:
    """The on-policy source over `corpus`: its training documents' prompts, its held-out ones for eval_kl."""
    from launcher.components.data.sequences import PackedSequences, check_held_out
    from launcher.components.data.tokenizer import load_tokenizer

    cfg, seq_len = spec.distill, spec.data.seq_len
    spans = prompt_spans(corpus.train, prompt_tokens=cfg.prompt_tokens, max_new_tokens=cfg.max_new_tokens)
    eval_spans = prompt_spans(corpus.val, prompt_tokens=cfg.prompt_tokens, max_new_tokens=cfg.max_new_tokens)
    if not len(spans):
        raise ValueError("on-policy distillation found no prompt in the training data")
    val = PackedSequences(corpus.val, seq_len, document_mask=False)
    if spec.train.evaluates():
        check_held_out(val, dist.dp_size)
    tokenizer = load_tokenizer(spec.tokenizer)
    sampling = dataclasses.replace(
        spec.objective, num_generations=1, max_completion_length=cfg.max_new_tokens, num_iterations=1,
        temperature=cfg.sampling_temperature, top_k=cfg.top_k, top_p=cfg.top_p, log_rollouts=0,
    )  # fmt: skip
    prompts: Any = CorpusPrompts(spans, tokenizer)  # a lazy sequence of Prompt records
    rollouts = RolloutSource(
        prompts, objective=sampling, tokenizer=tokenizer, scoring=RowFlags(), seed=spec.train.seed,
        context=seq_len, dtype=dtype, run_dir=run_dir,
    )  # fmt: skip
    held_out = (HeldOut(name="", sequences=val, weight=1.0),)
    return OnPolicySource(rollouts, spans, eval_spans, cfg=cfg, seed=spec.train.seed, held_out=held_out)
