"""The routed experts' computation: stacked expert MLPs over token rows sorted by expert, here or on the
ranks that hold the experts (expert parallelism).

`expert_mlp` runs rows sorted by expert through their experts, a loop over the experts on every device:
torch 2.13's grouped GEMM (`torch._grouped_mm`) fails in backward on the CPU when an expert received no
row, and its CUDA kernel has not been measured against the loop here yet. Under expert parallelism (`ExpertGroup`, set by launcher.parallel.expert_parallel) a
rank holds E / ep_size consecutive experts: `dispatch_compute_combine` sends each sorted row to the rank
holding its expert by all-to-all (differentiable: the gradients travel back the same way), reorders the
arrivals by expert, computes, and returns the outputs by the inverse all-to-all, in the rows' own order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup


@dataclass(frozen=True, kw_only=True)
class ExpertGroup:
    """The expert-parallel group of a rank: which experts it holds and the group its tokens travel in."""

    group: ProcessGroup
    """The ranks that split the experts between them (parallel.ep_size consecutive ranks)."""
    rank: int
    """This rank's position in the group: it holds experts [rank * local, (rank + 1) * local)."""
    size: int
    """Ranks in the group (parallel.ep_size)."""


def expert_mlp(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of `x` sorted by expert ([sum(counts), d]) through their experts' MLPs (w_up [E, d, f], w_down [E, f, d])."""
    outputs = []
    for e, rows in enumerate(x.split(counts)):
        if rows.shape[0]:
            outputs.append(F.gelu(rows @ w_up[e], approximate="tanh") @ w_down[e])
    if outputs:
        return torch.cat(outputs)
    # no row reached these experts: an empty output still tied to the rows (under expert parallelism every rank's
    # backward then runs the same all-to-alls) and to the weights (each gets a zero gradient, as elsewhere)
    return x * 0 + 0 * (w_up.sum() + w_down.sum())


def _exchange(rows: torch.Tensor, receive: list[int], send: list[int], group: ProcessGroup) -> torch.Tensor:
    """All-to-all of `rows` (send[j] rows to rank j of the group, receive[i] from rank i), differentiable."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(rows.contiguous(), receive, send, group))


ExpertsFn = Callable[[torch.Tensor, list[int]], torch.Tensor]
"""Rows sorted by this rank's experts and the rows per expert -> their outputs (a family's expert MLP)."""


def dispatch_compute_combine(
    rows: torch.Tensor,
    counts: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    ep: ExpertGroup,
    *,
    experts: ExpertsFn | None = None,
) -> torch.Tensor:
    """Rows sorted by global expert ([sum(counts), d], counts [E]) through experts held across the group.

    `experts` computes the arrivals (a Hugging Face family's gated MLP); None: `expert_mlp` with w_up and w_down.
    """
    local = counts.numel() // ep.size
    arriving = torch.empty_like(counts)
    dist.all_to_all_single(arriving, counts, group=ep.group)  # [source rank x local expert]
    table = arriving.view(ep.size, local).tolist()
    send = counts.view(ep.size, local).sum(1).tolist()
    receive = [sum(row) for row in table]
    chunks = _exchange(rows, receive, send, ep.group).split([n for row in table for n in row])
    by_expert = [chunks[s * local + e] for e in range(local) for s in range(ep.size)]
    per_expert = [sum(table[s][e] for s in range(ep.size)) for e in range(local)]
    arrived = torch.cat(by_expert)
    out = experts(arrived, per_expert) if experts else expert_mlp(arrived, w_up, w_down, per_expert)
    done = out.split([table[s][e] for e in range(local) for s in range(ep.size)])
    by_source = [done[e * ep.size + s] for s in range(ep.size) for e in range(local)]
    return _exchange(torch.cat(by_source), send, receive, ep.group)
