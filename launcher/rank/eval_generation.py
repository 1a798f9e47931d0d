"""The `generation` evaluator: completions of a prompts file scored against reference answers, on the model as
trained (docs/eval.md, "Generation checks").

Each prompt is completed `samples` times through the KV-cache generator
(launcher.components.model.generation) on the model part as training holds it (FSDP2-sharded,
TP-split, with adapters). The prompt x sample items are dealt round-robin over the data-parallel
ranks, each seeded by its global index (prompt * samples + sample), so any world size gives the same
tokens; a rank short of items in the last batch decodes a copy it does not count, since sharded
parameters are gathered by every rank alike. Each rank's correct counts per prompt are summed over
the data-parallel ranks, so every rank returns the same records: `eval/generation/accuracy` (the
share of correct samples) and `eval/generation/pass@K` (launcher.components.generation_checks).
"""

from __future__ import annotations

import torch

from launcher.components.data.tokenizer import Tokenizer, load_tokenizer
from launcher.components.generation_checks import Check, is_correct, read_checks, scores
from launcher.components.model import generation
from launcher.components.precision import eval_dtype
from launcher.components.schedule_free import averaged_weights
from launcher.rank.loop_parts import Components
from launcher.spec import RunSpec


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    """A completion's text: UTF-8 bytes for the byte tokenizer, transformers' decode without special tokens."""
    inner = getattr(tokenizer, "tok", None)
    if inner is None:
        return bytes(ids).decode("utf-8", "replace")
    return inner.decode(ids, skip_special_tokens=True)


def prompt_ids(tokenizer: Tokenizer, spec: RunSpec, text: str) -> list[int]:
    """A prompt as token ids, as training encodes text (a bos first where tokenizer.add_bos asks for one)."""
    if spec.eval.generation.chat:
        text = tokenizer.render_chat([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = tokenizer.encode([(text, False)])[0]
    bos = tokenizer.bos_id
    if spec.tokenizer.add_bos and bos is not None and not tokenizer.adds_bos and ids[:1] != [bos]:
        ids = [bos, *ids]
    return ids


class GenerationChecks:
    """`eval.generation`: accuracy and pass@k of completions against the prompts file's reference answers."""

    name = "generation"

    def __init__(self) -> None:
        self._checks: list[Check] | None = None
        self._prompts: list[list[int]] = []
        self._tokenizer: Tokenizer | None = None

    def metrics(self, spec: RunSpec) -> set[str]:
        """eval/generation/accuracy and eval/generation/pass@K for each K of eval.generation.pass_at."""
        return set(spec.eval.generation.metrics())

    def _load(self, spec: RunSpec) -> None:
        """Read the prompts file and encode its prompts once per process (the rules judged the file before launch)."""
        if self._checks is None:
            self._tokenizer = load_tokenizer(spec.tokenizer)
            self._checks = read_checks(spec.eval.generation)
            self._prompts = [prompt_ids(self._tokenizer, spec, c.prompt) for c in self._checks]

    @torch.no_grad()
    def run(self, parts: Components, step: int) -> dict[str, float]:
        """Generate this rank's share, count the correct samples per prompt over the data-parallel ranks (collective)."""
        spec, dist = parts.spec, parts.dist
        cfg = spec.eval.generation
        self._load(spec)
        assert self._checks is not None and self._tokenizer is not None
        items = len(self._checks) * cfg.samples  # item i: prompt i // samples, seeded by i
        mine: list[int | None] = list(range(dist.dp_rank, items, dist.dp_size))
        mine += [None] * (-(-items // dist.dp_size) - len(mine))  # as many batches on every rank
        correct = [0.0] * len(self._checks)
        model = parts.strategy.model
        model = getattr(model, "module", model)  # DDP's or DeepSpeed's wrapper: the module it wraps
        with averaged_weights(parts.strategy.optimizer), self._autocast(parts):
            for start in range(0, len(mine), cfg.batch_size):
                batch = mine[start : start + cfg.batch_size]
                done = self._generate(model, spec, [0 if i is None else i for i in batch])
                for index, completion in zip(batch, done, strict=True):
                    if index is None:  # a copy decoded in step with the other ranks, not counted
                        continue
                    check = self._checks[index // cfg.samples]
                    if is_correct(decode(self._tokenizer, completion.ids), check.reference, cfg):
                        correct[index // cfg.samples] += 1
        totals = dist.data_sum(correct)
        return scores([round(c) for c in totals], cfg)

    def _generate(
        self, model: torch.nn.Module, spec: RunSpec, batch: list[int]
    ) -> list[generation.Completion]:
        """The completions of the items `batch` (global indices), greedy or seeded by each index."""
        cfg, tokenizer = spec.eval.generation, self._tokenizer
        assert tokenizer is not None
        sampling = generation.Sampling(temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed)
        eos = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
        return generation.generate(
            model, [self._prompts[i // cfg.samples] for i in batch], max_new_tokens=cfg.max_new_tokens,
            sampling=sampling, stop_ids=eos, context=spec.model.max_seq_len, indices=batch,
            vocab_limit=tokenizer.vocab_size, use_cache=True,
        )  # fmt: skip

    @staticmethod
    def _autocast(parts: Components) -> torch.autocast:
        """Autocast to the evaluation dtype (precision.eval_dtype; off for float32)."""
        dtype = eval_dtype(parts.spec.precision)
        device = parts.dist.device.type
        return torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32)
