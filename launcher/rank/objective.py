"""The run's objective on a rank: the module `launcher.components.objectives` names, and the frozen
model it declares (`FrozenModel`), read and placed here like the student.

- teacher (distillation): a run directory gives its spec.yaml (the teacher's architecture) and its
  newest complete checkpoint, consolidated by the strategy that wrote it, as `train-export` reads it;
  a Hugging Face folder is built as model.kind=hf with model.path;
- copy (a preference reference without adapters): the initial policy again, a Hugging Face model read
  again from model.path, or a copy of the freshly built model (before any checkpoint is loaded, so a
  resumed run compares with the same initial weights);
- adapters_off (a reference with LoRA/QLoRA adapters): the wrapped policy itself with every adapter
  switched off for its forward (what peft's `disable_adapter` does; our adapters are injected, so the
  layers are switched directly): no second copy exists. It is bound after the wrap (`bind`).

A teacher or a copy is built with torch's RNG forked, so the student's init, dropout and data order are
those of the same run without it; cast to the training dtype, in eval mode with requires_grad off, and
placed as the strategy places the student: a whole copy on the device (one process, DDP), or under FSDP2
sharded per decoder layer over the same mesh, so that it fits where the student fits.

A `precomputed` reference (objective.reference=precompute) reads every training pair (kto: every example)
once before training, in micro batches shared round-robin over the data-parallel ranks (every rank runs
the same number of forwards: sharded models gather in each), and the rows' summed response log-probs are
gathered on every rank, then it is dropped. They are kept in the token cache beside the corpus,
`ref_logps-<key>.pt`, the key a hash of everything that decides them (model, quantization, adapters'
base, precision, seq_len, objective), so a second run or a resumed one reads them instead. The batches
then carry `ref_logps` and no reference model exists while training.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from launcher.components import checkpoint
from launcher.components.adapters import adapter_layers
from launcher.components.data.batching import PairDocuments
from launcher.components.data.tokens import Corpus, cached_path, uses_cache
from launcher.components.files.token_cache import read_ref_logps
from launcher.components.model.build import build_model
from launcher.components.model.family import decoder_layers, family
from launcher.components.model.loss import model_inputs
from launcher.components.objectives import Frozen, FrozenModel, Objective, objective_module
from launcher.components.objectives.auxiliary import with_auxiliary
from launcher.components.objectives.preference import logits_of, sequence_logps
from launcher.components.precision import autocast
from launcher.config.model import ModelConfig
from launcher.parallel.dims import DistContext
from launcher.parallel.registry import STRATEGIES, strategy_module
from launcher.rank.router_loss import with_router_loss
from launcher.spec import RunSpec, load_spec

SPEC = "spec.yaml"


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Run `model` as its base: every injected LoRA adapter disabled, then enabled again."""
    layers = list(adapter_layers(model).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class PolicyBase:
    """The policy with its adapters off, called as a model: the wrapped policy once `policy` is bound."""

    def __init__(self) -> None:
        self.policy: nn.Module | None = None

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        """The base model's outputs of `inputs` (every adapter off for this forward only)."""
        if self.policy is None:
            raise RuntimeError("the reference's policy is bound after the wrap (RankObjective.bind)")
        with adapters_off(self.policy):
            return self.policy(**inputs)


def load_teacher(path: str) -> nn.Module:
    """The teacher's model on the CPU in float32, weights loaded: from a run directory or a HF folder."""
    folder = Path(path)
    if (folder / SPEC).is_file():
        spec = load_spec(folder / SPEC)
        step_dir = checkpoint.good_checkpoints(folder, warn=False)[0]
        model = build_model(spec.model)
        model.load_state_dict(strategy_module(spec.parallel.strategy).consolidate(step_dir))
        return model
    return build_model(ModelConfig(kind="hf", path=str(folder)))


def _place(frozen: nn.Module, spec: RunSpec, dist: DistContext, mesh: DeviceMesh | None) -> nn.Module:
    """On the device, or FSDP2-sharded like the student (gathered per layer in forward, resharded after)."""
    frozen = frozen.to(dist.device)
    if not STRATEGIES[spec.parallel.strategy].fsdp_teacher:
        return frozen
    from torch.distributed.fsdp import fully_shard

    from launcher.parallel.fsdp import data_mesh

    shard_mesh = data_mesh(mesh, dist.dims.dp_replicate)
    for layer in decoder_layers(frozen) or []:
        fully_shard(layer, mesh=shard_mesh, reshard_after_forward=True)
    fully_shard(frozen, mesh=shard_mesh, reshard_after_forward=True)
    return frozen


def _read(declared: FrozenModel, spec: RunSpec, model: nn.Module) -> nn.Module:
    """The declared teacher (from its folder) or copy of the initial policy, on the CPU, before it is frozen."""
    with torch.random.fork_rng(devices=[]):
        if declared.source == "teacher":
            return load_teacher(str(declared.path))
        if family(spec.model).from_folder(
            spec.model
        ):  # as the policy was built: same vocabulary, same weights
            return build_model(spec.model)
        return copy.deepcopy(model)


def place_frozen(
    declared: FrozenModel,
    spec: RunSpec,
    dist: DistContext,
    mesh: DeviceMesh | None,
    model: nn.Module,
    dtype: torch.dtype,
) -> Frozen:
    """The declared frozen model, read, frozen in the training dtype `dtype` and placed (adapters_off: bound later)."""
    if declared.source == "adapters_off":
        return PolicyBase()
    frozen = _read(declared, spec, model).to(dtype=dtype).eval().requires_grad_(False)
    return _place(frozen, spec, dist, mesh)


@dataclass(kw_only=True)
class RankObjective:
    """The run's objective and its frozen model as this rank holds it."""

    objective: Objective
    """What the loop and the runner ask (the Objective seam)."""
    declared: FrozenModel | None
    """The frozen model the objective's module declared (None: it reads none)."""
    frozen: Frozen | None
    """That model placed; a precomputed one until its log-probs are read (`precompute`), then None."""
    dtype: torch.dtype
    """The training dtype the frozen model is held and run in (launcher.rank.build decided it)."""

    def bind(self, policy: nn.Module) -> None:
        """Give a reference that is the policy's base the wrapped policy (after the strategy wraps it)."""
        if isinstance(self.frozen, PolicyBase):
            self.frozen.policy = policy

    def precompute(self, spec: RunSpec, dist: DistContext, corpus: Corpus | None) -> torch.Tensor | None:
        """A precomputed reference's log-probs of every training pair of `corpus` (then the model is dropped)."""
        if self.declared is None or not self.declared.precomputed or self.frozen is None or corpus is None:
            return None
        pairs = PairDocuments(corpus.train, spec.data.seq_len, kto=spec.objective.name == "kto")
        frozen, self.frozen = self.frozen, None
        return reference_logps(spec, dist, frozen, pairs, self.dtype)


def build_objective(
    spec: RunSpec, dist: DistContext, mesh: DeviceMesh | None, model: nn.Module, dtype: torch.dtype
) -> RankObjective:
    """The run's objective (the registry's module) over its declared frozen model, placed like the student
    and held in the training dtype `dtype`; the model's own auxiliary losses (MoE routers') added to it."""
    module = objective_module(spec.objective, spec.distill)
    declared = module.frozen_model(spec.objective, spec.distill, adapters=bool(adapter_layers(model)))
    frozen = None if declared is None else place_frozen(declared, spec, dist, mesh, model, dtype)
    steps = None if declared is not None and declared.precomputed else frozen  # precomputed: batches carry it
    return RankObjective(
        objective=with_auxiliary(
            with_router_loss(module.build(spec.objective, spec.distill, steps), model), model
        ),
        declared=declared,
        frozen=frozen,
        dtype=dtype,
    )


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


def _compute(
    reference: Frozen, pairs: PairDocuments, spec: RunSpec, dist: DistContext, dtype: torch.dtype
) -> torch.Tensor:
    """[len(pairs), sides] float32 log-probs (under autocast to `dtype`): this rank's share computed, every rank's gathered."""
    size, ranks, rank = spec.train.micro_batch_size, dist.dp_size, dist.dp_rank
    rounds = -(-len(pairs) // (size * ranks))
    sides = 1 if pairs.kto else 2
    mine = torch.zeros((rounds, size, sides), dtype=torch.float32, device=dist.device)
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
    spec: RunSpec, dist: DistContext, reference: Frozen, pairs: PairDocuments, dtype: torch.dtype
) -> torch.Tensor:
    """The reference's log-probs of every pair side (computed in the training dtype `dtype`): read from the
    cache, or computed now and cached."""
    path = cache_file(spec)
    if path is not None and path.is_file():  # checked as it is read back: a damaged one is refused, named
        return read_ref_logps(path, len(pairs), 1 if pairs.kto else 2)
    logps = _compute(reference, pairs, spec, dist, dtype)
    if path is not None and dist.is_main:
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        torch.save(logps, partial)
        partial.rename(path)  # atomic: a file of this name is always whole
    return logps
