"""The routed experts' computation: stacked expert MLPs over token rows sorted by expert, here or on the
ranks that hold the experts (expert parallelism).

`expert_mlp` runs rows sorted by expert through their experts: one grouped GEMM per projection
(`torch.nn.functional.grouped_mm`, the rows of each expert a group) on CUDA in bfloat16 (compute
capability 8.0 and up, widths a multiple of 8), a loop over the experts elsewhere (on the CPU torch's
grouped kernel is no faster: `grouped_gemm_available`). Its backward needs a contiguous incoming
gradient (a broadcast one fails in the kernel), which `_ContiguousGrad` hands it. Under expert
parallelism (`ExpertGroup`, set by launcher.parallel.expert_parallel) a rank holds E / ep_size consecutive experts: `dispatch_compute_combine` sends each sorted row to the rank
holding its expert by all-to-all (differentiable: the gradients travel back the same way), reorders the
arrivals by expert, computes, and returns the outputs by the inverse all-to-all, in the rows' own order.
Under `dry_run=simulate` (fake tensors, a fake process group) the counts cannot travel: each rank takes the
counts it sends as the ones it receives (the simulation routes every expert the same share of the rows,
launcher.rank.simulate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor


@dataclass(frozen=True, kw_only=True)
class ExpertGroup:
    """The expert-parallel group of a rank: which experts it holds and the group its tokens travel in."""

    group: ProcessGroup
    """The ranks that split the experts between them (parallel.ep_size consecutive ranks)."""
    rank: int
    """This rank's position in the group: it holds experts [rank * local, (rank + 1) * local)."""
    size: int
    """Ranks in the group (parallel.ep_size)."""


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (grouped_mm's backward refuses other strides)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_gemm_available(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether rows `x` [N, d] meet stacked weights `w` [E, d, f] in torch's grouped GEMM rather than the loop.

    CUDA in bfloat16 on compute capability 8.0 and up, widths a multiple of 8 (the kernel's 16-byte strides).
    On the CPU torch 2.13's kernel computes the same numbers no faster than the loop (0.76-0.98 of its speed,
    scripts/bench_moe_gemm, docs/moe.md), so the loop stays there.
    """
    if not hasattr(F, "grouped_mm") or is_fake(x) or isinstance(w, DTensor) or x.dtype != w.dtype:
        return False
    if x.device.type != "cuda" or x.dtype != torch.bfloat16 or x.shape[-1] % 8 or w.shape[-1] % 8:
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 0)


def _grouped(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each group of rows of `x` (ending at `offsets`) times its expert's matrix of `w`, one kernel."""
    return _ContiguousGrad.apply(F.grouped_mm(x.contiguous(), w, offs=offsets))


def grouped_mlp(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """`expert_mlp` as two grouped GEMMs (each expert's rows one group); `x` must hold at least one row."""
    offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    return _grouped(F.gelu(_grouped(x, w_up, offsets), approximate="tanh"), w_down, offsets)


def expert_mlp(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of `x` sorted by expert ([sum(counts), d]) through their experts' MLPs (w_up [E, d, f], w_down [E, f, d])."""
    if x.device.type == "cuda" and torch.is_autocast_enabled(
        "cuda"
    ):  # autocast skips grouped_mm: cast as for a matmul
        dtype = torch.get_autocast_dtype("cuda")
        x, w_up, w_down = x.to(dtype), w_up.to(dtype), w_down.to(dtype)
    if x.shape[0] and grouped_gemm_available(x, w_up):  # no row: the loop's tied empty output below
        return grouped_mlp(x, w_up, w_down, counts)
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
    if is_fake(rows):  # dry_run=simulate: no routing to exchange; every rank routes as this one (balanced)
        arriving = counts.view(ep.size, local)[ep.rank].repeat(ep.size)
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
