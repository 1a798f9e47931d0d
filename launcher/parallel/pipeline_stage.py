"""Cutting a model into pipeline stages that keep the whole model's parameter names.

A stage is a copy of the model with only its run of decoder layers, the embeddings on the first
stage and the final norm and head on the last; the other parts are set to None and the model's
forward passes hidden states through where they are missing. The kept layers stay under their
index in the whole model (`blocks.5` stays `blocks.5`), so a stage's state-dict keys are the
unwrapped model's: DCP checkpoints of different stage splits, and exports, line up key by key.

A tied embedding and head sit on the first and last stage as two copies with the same initial
values; `TiedCopies` adds their gradients together after backward (one all-reduce between the
two stages' ranks), so both copies take the same update and stay equal, exactly as one tied
matrix would in a single process.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

from launcher.components.model.family import family, family_of
from launcher.components.model.shape import model_shape
from launcher.config.model import ModelConfig
from launcher.parallel.pipeline_split import part_costs, stage_ranges, stages_of_rank

if TYPE_CHECKING:  # torch only where a rank cuts its stages: the dry run plans them without it
    import torch
    from torch import nn

    from launcher.config.parallel import ParallelConfig


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """The stages of a run and the ones this rank holds."""

    ranges: list[range]
    """Layers of every stage, in pipeline order."""
    local: list[int]
    """Stage indices this rank holds, in the order its schedule expects."""

    @property
    def num_stages(self) -> int:
        """Stages of the whole pipeline."""
        return len(self.ranges)


def plan_stages(model_cfg: ModelConfig, parallel: ParallelConfig, seq_len: int, pp_rank: int) -> StagePlan:
    """Which layers make each stage (explicit pp_split or balanced) and which stages `pp_rank` holds."""
    cfg = model_shape(model_cfg).equivalent
    num_stages = parallel.pp_size * parallel.pp_stages_per_rank
    ranges = stage_ranges(cfg.n_layer, num_stages, parallel.pp_split, part_costs(cfg, seq_len))
    local = stages_of_rank(pp_rank, parallel.pp_size, parallel.pp_stages_per_rank, parallel.pp_schedule)
    return StagePlan(ranges=ranges, local=local)


def make_stage(model: nn.Module, layers: range, *, first: bool, last: bool, copy_model: bool) -> nn.Module:
    """The stage of `model` holding `layers` (a copy when the rank holds several stages), cut by its family."""
    stage = copy.deepcopy(model) if copy_model else model
    return family_of(stage).stage(stage, layers, first=first, last=last)


def split_model(model: nn.Module, plan: StagePlan) -> list[nn.Module]:
    """This rank's stage modules, in schedule order."""
    return [
        make_stage(
            model,
            plan.ranges[s],
            first=s == 0,
            last=s == plan.num_stages - 1,
            copy_model=len(plan.local) > 1,
        )
        for s in plan.local
    ]


def tied_pair(model_cfg: ModelConfig) -> tuple[str, str] | None:
    """Names of the tied embedding and head weights the first and last stage each hold a copy of, or None."""
    return family(model_cfg).tied_names(model_cfg)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the tensor itself otherwise), for in-place work on gradients."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class TiedCopies:
    """Keeps the first stage's embedding and the last stage's head, one tied matrix, equal: their gradients are summed.

    Every rank builds the same pair groups (dist.new_group is collective); a rank joins the group
    of its data x tensor coordinate when it holds the first or the last stage on another rank than
    its partner. A rank holding both (the V-shaped schedule) sums locally. `pp_last` is the pipeline
    rank of the last stage, `block` the ranks of one pipeline rank (data x tensor parallel).
    """

    def __init__(
        self, stages: list[nn.Module], names: tuple[str, str], *, pp_last: int, block: int, rank: int
    ) -> None:
        import torch.distributed as dist

        params = {name: p for stage in stages for name, p in stage.named_parameters()}
        self.copies = [params[n] for n in names if n in params]
        """This rank's copies (the embedding first where it holds it)."""
        first_rank, last_rank = 0, pp_last
        self.group = None
        if first_rank != last_rank:
            for coordinate in range(block):
                ranks = [first_rank * block + coordinate, last_rank * block + coordinate]
                group = dist.new_group(ranks)
                if rank in ranks:
                    self.group = group
        self.counted = self.copies[:1] if names[0] in params else []
        """The copy the gradient norm counts (the embedding's, on the first stage), so the tie counts once."""

    def sync_grads(self) -> None:
        """Sum the copies' gradients (local and across the two stages' ranks); every copy gets the sum."""
        grads = [p.grad for p in self.copies if p.grad is not None]
        if not grads:
            return
        total = local_tensor(grads[0]).clone()
        for grad in grads[1:]:
            total += local_tensor(grad)
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(total, group=self.group)
        for grad in grads:
            local_tensor(grad).copy_(total)
