"""Batched decoding with a key-value cache over a model part as training holds it.

`generate(model, prompts, ...)` continues token-id prompts: left-padded into one batch, one prefill,
then one token per row and step through the model's own `forward(ids, positions, cache=...,
attention_mask=...)` (the cache comes from its family's `new_cache` verb, launcher.components.model.family),
so FSDP2's hooks gather the parameters, tensor parallel's styles apply and injected adapters take
part, exactly as in a training step. Logits sharded over the vocabulary (tensor parallel) are
gathered whole. Sequence parallelism (blocks fed a split sequence) does not decode yet. Greedy when the temperature is 0, else sampling from softmax(logits / temperature)
kept to the top-k tokens and the top-p nucleus, on the CPU in float32, each prompt with its own
torch.Generator seeded from (seed, the prompt's global index): the same prompts and seed give the
same tokens however the prompts are spread over ranks and batches. A row stops at one of its stop
ids (not kept) or after max_new_tokens; the others go on. Under torch.distributed every rank of the
group takes the same number of steps (they agree when all rows are done), since sharded parameters
are gathered collectively. When a row outgrows the model's context, the window slides: each step
then runs the last `context` tokens afresh (positions from 0, as the recompute path always did).

Without the cache (`use_cache=False`) each step recomputes the whole window: a plain `model(ids)`
when no row is padded (the training forward), else a fresh cache per step to carry the padding mask.
No file I/O and no spec: a rollout on the training ranks and `train-generate` both call it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from launcher.components.model.family import family_of

Model = nn.Module | Callable[[torch.Tensor], torch.Tensor]
"""A model part with forward(ids, positions, cache=, attention_mask=) and new_cache(); or, for the
recompute path only, any callable from token ids [B, T] to logits [B, T, vocab]."""
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
"""An odd 64-bit constant spreading prompt indices over seeds (prompt 0 keeps the seed itself)."""


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How the next token is chosen from a row's logits."""

    temperature: float = 0.0
    """0 picks the most likely token (greedy); above 0 samples from softmax(logits / temperature)."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0: no limit)."""
    top_p: float = 1.0
    """Sample from the smallest set of most likely tokens whose probability reaches top_p."""
    seed: int = 0
    """With the prompt's global index, seeds the prompt's own generator."""


@dataclass(frozen=True, kw_only=True)
class Completion:
    """New token ids after a prompt, and why generation stopped."""

    ids: list[int]
    """The new token ids (the stop id that ended them not included)."""
    stop: str
    """Why it stopped: "eos" (one of the stop ids came) or "max_new_tokens"."""
    eos_id: int | None = None
    """The stop id chosen, when stop is "eos"."""


def row_generator(seed: int, index: int) -> torch.Generator:
    """The CPU generator of the prompt with global index `index` (index 0 is seeded with `seed` itself)."""
    return torch.Generator().manual_seed((seed + index * GOLDEN_GAMMA) % 2**63)


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One row's next token from its float32 CPU logits [vocab]: greedy, or a top-k / top-p sample."""
    if sampling.temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    keep = sorted_probs.cumsum(-1) - sorted_probs < sampling.top_p  # the smallest prefix reaching top_p
    if sampling.top_k > 0:
        keep[sampling.top_k :] = False
    sorted_probs = sorted_probs * keep
    choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
    return int(order[choice])


def _device(model: Model) -> torch.device:
    """Where the model's inputs go: its first parameter's device (a DTensor's local device under FSDP2/TP)."""
    parameter = next(model.parameters(), None) if isinstance(model, nn.Module) else None
    return parameter.device if parameter is not None else torch.device("cpu")


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Each token's position in its row, counted over the real tokens (left padding gets 0)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _whole(logits: torch.Tensor) -> torch.Tensor:
    """The last position's logits [B, vocab] as a float32 CPU tensor, gathered whole if sharded (DTensor)."""
    last = logits[:, -1]
    if hasattr(last, "full_tensor"):
        last = last.full_tensor()
    return last.float().cpu()


class _Decoder:
    """The running batch: ids and mask so far, the cache, and one forward per step."""

    def __init__(
        self, model: Model, ids: torch.Tensor, mask: torch.Tensor, *, context: int, use_cache: bool
    ) -> None:
        self.model, self.ids, self.mask = model, ids, mask
        self.context, self.use_cache = context, use_cache
        self.cache = None
        self.slid = False
        """Whether the text has outgrown the context (the window slides from then on)."""

    def logits(self) -> torch.Tensor:
        """The next-token logits [B, vocab] of every row, from the cache or recomputed over the window."""
        width = self.ids.shape[1]
        if width > self.context:
            self.slid = True
        if self.use_cache and self.cache is not None and not self.slid:
            new = self.ids[:, -1:]
            positions = _positions(self.mask)[:, -1:]
            return _whole(self.model(new, positions, cache=self.cache, attention_mask=self.mask))
        ids, mask = self.ids[:, -self.context :], self.mask[:, -self.context :]
        if not self.use_cache and bool(mask.all()):
            return _whole(self.model(ids))
        self.cache = family_of(self.model).new_cache(self.model)
        return _whole(self.model(ids, _positions(mask), cache=self.cache, attention_mask=mask))

    def append(self, tokens: list[int]) -> None:
        """Add one token per row (a finished row's stop id again: its output is not read)."""
        column = torch.tensor(tokens, device=self.ids.device)[:, None]
        self.ids = torch.cat([self.ids, column], dim=1)
        self.mask = torch.cat([self.mask, torch.ones_like(column, dtype=torch.bool)], dim=1)


def _all_done(done: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether every rank of the group (this process alone without torch.distributed) is done."""
    if not dist.is_available() or not dist.is_initialized():
        return done
    device = torch.device("cpu") if dist.get_backend(group) == "gloo" else device
    flag = torch.tensor([0 if done else 1], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item()) == 0


def _padded(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts left-padded into ids [B, P] and the mask of their real tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = True
    return ids.to(device), mask.to(device)


def _choose(
    logits: torch.Tensor,
    generators: list[torch.Generator],
    sampling: Sampling,
    stop_ids: Sequence[int],
    new: list[list[int]],
    ended: list[int | None],
) -> list[int]:
    """Each running row's next token, kept in `new` or ending the row in `ended` (a stop id); the column to feed."""
    tokens = []
    for row, generator in enumerate(generators):
        if ended[row] is None:
            token = next_token(logits[row], sampling, generator)
            if token in stop_ids:
                ended[row] = token
            else:
                new[row].append(token)
        tokens.append(ended[row] if ended[row] is not None else new[row][-1])
    return tokens


@torch.no_grad()
def generate(
    model: Model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    stop_ids: Sequence[int] = (),
    context: int,
    indices: Sequence[int] | None = None,
    vocab_limit: int | None = None,
    pad_id: int = 0,
    use_cache: bool = True,
    group: dist.ProcessGroup | None = None,
    note: Callable[[str], None] | None = None,
) -> list[Completion]:
    """Continue each token-id prompt (non-empty) by at most `max_new_tokens`, in one left-padded batch.

    `context` is the model's position count; `indices` are the prompts' global indices (default
    0..B-1) that seed their sampling; ids from `vocab_limit` on are never chosen (padding rows of the
    vocabulary); `note` hears once when the text outgrows the context. The model runs in eval mode
    (dropout off) and each module's training flag is restored after.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and every prompt at least one token.")
    indices = list(range(len(prompts))) if indices is None else list(indices)
    generators = [row_generator(sampling.seed, index) for index in indices]
    modules = list(model.modules()) if isinstance(model, nn.Module) else []
    flags = [module.training for module in modules]
    for module in modules:
        module.training = False
    device = _device(model)
    try:
        decoder = _Decoder(model, *_padded(prompts, pad_id, device), context=context, use_cache=use_cache)
        new: list[list[int]] = [[] for _ in prompts]
        ended: list[int | None] = [None] * len(prompts)
        for _ in range(max_new_tokens):
            logits = decoder.logits()
            if decoder.slid and note is not None:
                note(
                    f"note: the text outgrew the model's context of {context} tokens; the oldest are dropped."
                )
                note = None
            if vocab_limit is not None:
                logits[:, vocab_limit:] = float("-inf")
            tokens = _choose(logits, generators, sampling, stop_ids, new, ended)
            if _all_done(all(end is not None for end in ended), group, device):
                break
            decoder.append(tokens)
    finally:
        for module, training in zip(modules, flags, strict=True):
            module.training = training
    return [
        Completion(ids=ids, stop="max_new_tokens")
        if end is None
        else Completion(ids=ids, stop="eos", eos_id=end)
        for ids, end in zip(new, ended, strict=True)
    ]
