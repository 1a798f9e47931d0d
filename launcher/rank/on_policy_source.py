"""The step-input source of on-policy distillation: prompts from the data, completions sampled by the student.

Each step takes the next micro_batch_size x grad_accum_steps x data-parallel ranks prompts of a seeded
pass over the corpus's prompts (launcher.components.data.prompts), slot `g` of step `s` being prompt
permutation(epoch)[(s * per_step + g) % N]: a pure function of the seed and the step, so a resumed run
draws the same prompts and the state a checkpoint keeps is the next step alone. Slot g goes to rank r
and micro batch k where g = (k * ranks + r) * micro_batch_size + row, so a micro batch of one process
is the same rows as the same micro batch on a rank of a wider job.

A step is on-policy with probability distill.lmbda (seeded by the seed and the step, the same on every
rank): each micro batch's prompts are then continued by the student, as it is after the previous step,
with launcher.components.model.generation.generate on the training ranks (the model as trained: DDP's
module, FSDP2's shards gathered), its sampling seeded per (seed, step, prompt slot), so any world size
samples the same tokens. Otherwise each prompt keeps the data's own completion. A row is the prompt and
its completion (the stop token kept when the student chose it), right-padded; its labels are the
completion's tokens alone, so the objective (launcher.components.objectives.on_policy) scores exactly
the tokens the student wrote. The teacher scores them there: the source never reads it.

At an evaluation, `held_out_scores` samples completions of the first distill.eval_prompts held-out
prompts (the same seed each time) and reports the student-teacher KL per completion token (`eval_kl`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from launcher.components.data.interleave import HeldOut
from launcher.components.data.corpus_prompts import Prompts, read_prompts
from launcher.components.data.tokens import Corpus
from launcher.components.model.generation import Completion, Sampling, generate
from launcher.components.objectives.on_policy import CLIPPED, SAMPLED, OnPolicyDistiller
from launcher.components.precision import autocast, eval_dtype
from launcher.config.distill import DistillConfig
from launcher.parallel.dims import DistContext
from launcher.rank.sources import Batch, SourceContext
from launcher.spec import RunSpec

if TYPE_CHECKING:
    from launcher.rank.loop_parts import Components


def seed_of(seed: int, *parts: object) -> int:
    """A 63-bit seed from the run's seed and what it is for (the step, 'lmbda', 'eval', ...)."""
    digest = hashlib.sha256(":".join(str(p) for p in (seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


def student_of(model: nn.Module) -> nn.Module:
    """The module that decodes: DDP's wrapped module (its forward would sync buffers), a compiled one's original."""
    while hasattr(model, "module") and isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    return getattr(model, "_orig_mod", model)


def rows_of(
    prompts: list[list[int]], completions: list[list[int]], clipped: list[bool], sampled: bool
) -> Batch:
    """One micro batch: prompt + completion rows right-padded, labels the completion tokens alone."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True)) - 1
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    labels = torch.full((len(prompts), width), -100, dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        text = torch.tensor(prompt + completion, dtype=torch.long)
        ids[row, : len(text) - 1] = text[:-1]
        labels[row, len(prompt) - 1 : len(text) - 1] = text[len(prompt) :]
    return {
        "input_ids": ids,
        "labels": labels,
        CLIPPED: torch.tensor(clipped, dtype=torch.float32),
        SAMPLED: torch.full((len(prompts),), float(sampled)),
    }


class OnPolicySource:
    """Prompts from the corpus, completed by the student (or the data) each step (the StepSource protocol)."""

    def __init__(
        self,
        prompts: Prompts,
        eval_prompts: Prompts,
        *,
        cfg: DistillConfig,
        seed: int,
        context: int,
        stop_ids: tuple[int, ...],
        vocab_limit: int,
        held_out: tuple[HeldOut, ...],
    ) -> None:
        if not len(prompts):
            raise ValueError("on-policy distillation found no prompt in the training data")
        self.prompts, self.eval_prompts, self.cfg, self.seed = prompts, eval_prompts, cfg, seed
        self.context, self.stop_ids, self.vocab_limit = context, stop_ids, vocab_limit
        self.held_out = held_out
        self._next_step = 0
        self._drawn = 0  # prompt slots drawn so far, for the record's epoch
        self._epoch: tuple[int, torch.Tensor] | None = None

    def _prompt_index(self, slot: int) -> int:
        """The prompt at global slot `slot` of the seeded passes over the prompts."""
        epoch, position = divmod(slot, len(self.prompts))
        if self._epoch is None or self._epoch[0] != epoch:
            generator = torch.Generator().manual_seed(seed_of(self.seed, "prompts", epoch))
            self._epoch = (epoch, torch.randperm(len(self.prompts), generator=generator))
        return int(self._epoch[1][position])

    def on_policy(self, step: int) -> bool:
        """Whether step `step` trains on the student's samples (a share distill.lmbda of the steps)."""
        if self.cfg.lmbda >= 1.0:
            return True
        generator = torch.Generator().manual_seed(seed_of(self.seed, "lmbda", step))
        return float(torch.rand((), generator=generator)) < self.cfg.lmbda

    def sample(
        self, model: nn.Module, prompts: list[list[int]], *, seed: int, slots: list[int]
    ) -> list[Completion]:
        """The student's completions of `prompts`, prompt i's sampling seeded by (`seed`, slots[i])."""
        cfg = self.cfg
        sampling = Sampling(temperature=cfg.sampling_temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=seed)
        return generate(
            model, prompts, max_new_tokens=cfg.max_new_tokens, sampling=sampling, stop_ids=self.stop_ids,
            context=self.context, indices=slots, vocab_limit=self.vocab_limit,
        )  # fmt: skip

    def _completed(self, completions: list[Completion]) -> tuple[list[list[int]], list[bool]]:
        """Each completion's tokens with the stop token it chose, and whether it was cut at max_new_tokens."""
        tokens = [c.ids + ([c.eos_id] if c.eos_id is not None else []) for c in completions]
        return tokens, [c.stop == "max_new_tokens" for c in completions]

    def micro_batches(self, step: int, ctx: SourceContext) -> list[Batch]:
        """This rank's grad_accum_steps micro batches of step `step`: its slots' prompts and their completions."""
        size, ranks, rank = ctx.batch.micro_batch_size, ctx.dist.dp_size, ctx.dist.dp_rank
        per_step, sampled = size * ctx.batch.grad_accum_steps * ranks, self.on_policy(step)
        model = student_of(ctx.strategy.model)
        batches = []
        for k in range(ctx.batch.grad_accum_steps):
            slots = [(k * ranks + rank) * size + row for row in range(size)]
            indices = [self._prompt_index(step * per_step + slot) for slot in slots]
            prompts = [self.prompts.prompt(i) for i in indices]
            if sampled:
                completions = self.sample(model, prompts, seed=seed_of(self.seed, "step", step), slots=slots)
                tokens, clipped = self._completed(completions)
            else:
                tokens = [self.prompts.completion(i) for i in indices]
                clipped = [len(t) >= self.cfg.max_new_tokens for t in tokens]
            batches.append(rows_of(prompts, tokens, clipped, sampled))
        self._next_step, self._drawn = step + 1, (step + 1) * per_step
        return batches

    @torch.no_grad()
    def held_out_scores(self, parts: Components) -> dict[str, float]:
        """eval_kl (KL(student || teacher) per completion token) and eval_completion_len over the held-out
        prompts, summed over data-parallel ranks (collective: every rank runs the same forwards)."""
        objective, dist = parts.objective, parts.dist
        count = min(self.cfg.eval_prompts, len(self.eval_prompts))
        if count == 0 or not isinstance(objective, OnPolicyDistiller):
            return {}
        per_rank = -(-count // dist.dp_size)
        slots = [dist.dp_rank + i * dist.dp_size for i in range(per_rank)]
        prompts = [self.eval_prompts.prompt(slot % count) for slot in slots]
        model = student_of(parts.strategy.model)
        tokens, _ = self._completed(self.sample(model, prompts, seed=seed_of(self.seed, "eval"), slots=slots))
        batch = rows_of(prompts, tokens, [False] * len(prompts), True)
        weight = torch.tensor([1.0 if slot < count else 0.0 for slot in slots])  # the wrapped ones count 0
        batch["labels"] = torch.where(
            weight[:, None] > 0, batch["labels"], torch.full_like(batch["labels"], -100)
        )
        batch = {k: v.to(dist.device) for k, v in batch.items()}
        model.eval()
        with autocast(eval_dtype(parts.spec.precision), dist.device.type):
            student = model(batch["input_ids"])
            kl = objective.kl_sum(student, objective.teacher_logits(batch), batch["labels"])
        model.train()
        kl_sum, completion_tokens, rows = dist.data_sum(
            [float(kl), float((batch["labels"] != -100).sum()), float(weight.sum())]
        )
        return {
            "eval_kl": kl_sum / max(completion_tokens, 1.0),
            "eval_completion_len": completion_tokens / max(rows, 1.0),
        }

    def record(self) -> dict[str, float]:
        """Passes over the prompts so far (`epoch`)."""
        return {"epoch": self._drawn / len(self.prompts)}

    def state_dict(self) -> dict[str, Any]:
        """The next step to draw (the prompts and seeds are a function of it)."""
        return {"next_step": self._next_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a position `state_dict` returned."""
        self._next_step = int(state["next_step"])


def build_source(spec: RunSpec, corpus: Corpus, dist: DistContext) -> OnPolicySource:
    """The on-policy source over `corpus`: its training documents' prompts, its held-out ones for eval_kl."""
    from launcher.components.data.sequences import PackedSequences, check_held_out
    from launcher.components.data.tokenizer import load_tokenizer

    cfg, seq_len = spec.distill, spec.data.seq_len
    read = partial(read_prompts, prompt_tokens=cfg.prompt_tokens, max_new_tokens=cfg.max_new_tokens)
    val = PackedSequences(corpus.val, seq_len, document_mask=False)
    if spec.train.evaluates():
        check_held_out(val, dist.dp_size)
    tokenizer = load_tokenizer(spec.tokenizer)
    return OnPolicySource(
        read(corpus.train), read(corpus.val), cfg=cfg, seed=spec.train.seed, context=seq_len,
        stop_ids=() if tokenizer.eos_id is None else (tokenizer.eos_id,), vocab_limit=tokenizer.vocab_size,
        held_out=(HeldOut(name="", sequences=val, weight=1.0),),
    )  # fmt: skip
