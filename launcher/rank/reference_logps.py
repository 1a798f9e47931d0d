"""objective.reference=precompute: the reference's log-probs of every training pair, computed once before training.

The reference (the policy with its LoRA adapters off, or a frozen copy placed like the teacher and
dropped afterwards) reads every pair (kto: every example) of the training corpus once, in micro
batches shared round-robin over the data-parallel ranks (every rank runs the same number of
forwards: sharded models gather in each), and the rows' summed response log-probs are gathered on
every rank. They are kept in the token cache beside the corpus, `ref_logps-<key>.pt`, the key a hash
of everything that decides them (model, quantization, adapters' base, precision, seq_len, objective),
so a second run or a resumed one reads them instead. The batches then carry `ref_logps` and no
reference model exists while training.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from launcher.components.data.batching import PairDocuments
from launcher.components.data.tokens import cached_path, uses_cache
from launcher.components.files.token_cache import read_ref_logps
from launcher.components.model.loss import model_inputs
from launcher.components.precision import autocast, train_dtype
from launcher.components.preference import logits_of, sequence_logps
from launcher.parallel.dims import DistContext
from launcher.rank.reference import adapters_off
from launcher.spec import RunSpec


def cache_file(spec: RunSpec) -> Path | None:
    """Where the reference log-probs of this spec's corpus are kept (None: a corpus the cache does not keep)."""
    if not uses_cache(spec.data, spec.tokenizer):
        return None
    decided = {
        "model": asdict(spec.model), "quantization": asdict(spec.quantization), "precision": asdict(spec.precision),
        "seq_len": spec.data.seq_len, "objective": spec.objective.name, "seed": spec.train.seed,
    }  # fmt: skip
    key = hashlib.sha256(json.dumps(decided, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cached_path(spec.data, spec.tokenizer) / f"ref_logps-{key}.pt"


def _compute(reference: nn.Module, pairs: PairDocuments, spec: RunSpec, dist: DistContext) -> torch.Tensor:
    """[len(pairs), sides] float32 log-probs: this rank's share computed, every rank's gathered."""
    size, ranks, rank = spec.train.micro_batch_size, dist.dp_size, dist.dp_rank
    rounds = -(-len(pairs) // (size * ranks))
    sides = 1 if pairs.kto else 2
    mine = torch.zeros((rounds, size, sides), dtype=torch.float32, device=dist.device)
    dtype = train_dtype(spec.precision)
    with torch.no_grad():
        for k in range(rounds):
            start = (k * ranks + rank) * size
            indices = torch.arange(start, start + size) % len(pairs)  # the last round wraps (discarded)
            batch = {key: v.to(dist.device) for key, v in pairs.batch(indices).items()}
            with autocast(dtype, dist.device.type):
                logits = logits_of(reference(**model_inputs(batch)))
            mine[k] = sequence_logps(logits, batch["labels"])[0].reshape(sides, size).T
    if ranks > 1:
        gathered = [torch.empty_like(mine) for _ in range(ranks)]
        torch.distributed.all_gather(gathered, mine)  # tp and pp are refused: the world is data-parallel
        mine = torch.stack(gathered, dim=1)  # [rounds, ranks, size, sides]: the order the indices were given
    return mine.reshape(-1, sides)[: len(pairs)].cpu()


def reference_logps(
    spec: RunSpec, dist: DistContext, policy: nn.Module, pairs: PairDocuments, copy: nn.Module | None
) -> torch.Tensor:
    """The reference's log-probs of every pair side (read from the cache, or computed now and cached) by
    the policy with its adapters off, or by `copy` (a frozen copy of the initial policy, placed)."""
    path = cache_file(spec)
    if path is not None and path.is_file():  # checked as it is read back: a damaged one is refused, named
        return read_ref_logps(path, len(pairs), 1 if pairs.kto else 2)
    if copy is None:
        with adapters_off(policy):
            logps = _compute(policy, pairs, spec, dist)
    else:
        logps = _compute(copy, pairs, spec, dist)
    if path is not None and dist.is_main:
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        torch.save(logps, partial)
        partial.rename(path)  # atomic: a file of this name is always whole
    return logps
