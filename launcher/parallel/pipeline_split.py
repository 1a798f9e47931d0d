"""Which decoder layers each pipeline stage holds: an explicit split, or one balanced by parameters and FLOPs.

A stage is a run of consecutive layers; the first stage also holds the embeddings, the last the
final norm and the LM head. `auto` weighs every part by the mean of its share of the parameters
(memory) and of the training FLOPs (time), so a large vocabulary moves layers off the first and
last stages, and picks the contiguous split whose most loaded stage is lightest. Stage s of
`pp_size` x `stages_per_rank` lives on pipeline rank s mod pp_size (interleaved), or V-shaped for
the zero-bubble schedule (rank r holds stages r and 2 pp_size - 1 - r), as torch's schedules expect.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config.model import ModelConfig, ff_width, vocab_size

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
"""Every option of parallel.pp_schedule."""
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")
"""Schedules that place several stages on each rank."""


@dataclass(frozen=True, kw_only=True)
class PartCosts:
    """Relative cost of the model's parts, each the mean of its parameter share and its FLOP share."""

    layer: float
    """One decoder layer."""
    embedding: float
    """Token (and position) embeddings, on the first stage."""
    head: float
    """Final norm and LM head, on the last stage (a tied head is a copy there)."""


def part_costs(cfg: ModelConfig, seq_len: int) -> PartCosts:
    """The parts' costs of a GPT-shaped config (a Hugging Face model's planner equivalent works too)."""
    d, ff, vocab = cfg.d_model, ff_width(cfg), vocab_size(cfg)
    layer_params = 4 * d * d + 2 * d * ff
    emb_params = vocab * d + cfg.max_seq_len * d
    head_params = vocab * d
    layer_flops = 6 * layer_params + 12 * seq_len * d  # matmuls, forward and backward, plus attention scores
    head_flops = 6 * head_params
    params = cfg.n_layer * layer_params + emb_params + head_params
    flops = cfg.n_layer * layer_flops + head_flops
    return PartCosts(
        layer=0.5 * (layer_params / params + layer_flops / flops),
        embedding=0.5 * emb_params / params,
        head=0.5 * (head_params / params + head_flops / flops),
    )


def balanced_split(n_layer: int, num_stages: int, costs: PartCosts) -> list[int]:
    """First layer of each stage after the first, minimising the most loaded stage (ties: earlier stages lighter)."""
    if num_stages > n_layer:
        raise ValueError(f"{n_layer} layers cannot fill {num_stages} stages (each needs at least one).")

    def stage_cost(start: int, end: int, stage: int) -> float:
        extra = (costs.embedding if stage == 0 else 0.0) + (costs.head if stage == num_stages - 1 else 0.0)
        return (end - start) * costs.layer + extra

    # best[s][i]: (max stage cost, boundaries) for layers [0, i) in stages [0, s].
    best: list[dict[int, tuple[float, list[int]]]] = [
        {i: (stage_cost(0, i, 0), []) for i in range(1, n_layer + 1)}
    ]
    for s in range(1, num_stages):
        row: dict[int, tuple[float, list[int]]] = {}
        for end in range(s + 1, n_layer + 1):
            options = [
                (max(best[s - 1][start][0], stage_cost(start, end, s)), best[s - 1][start][1] + [start])
                for start in range(s, end)
                if start in best[s - 1]
            ]
            row[end] = min(options, key=lambda o: (round(o[0], 12), [-b for b in o[1]]))
        best.append(row)
    return best[num_stages - 1][n_layer][1]


def stage_ranges(n_layer: int, num_stages: int, split: list[int] | None, costs: PartCosts) -> list[range]:
    """The layers of every stage, from the explicit `split` (first layers of stages 1..) or balanced."""
    bounds = list(split) if split else balanced_split(n_layer, num_stages, costs)
    edges = [0, *bounds, n_layer]
    return [range(edges[i], edges[i + 1]) for i in range(num_stages)]


def split_problem(n_layer: int, num_stages: int, split: list[int] | None) -> str | None:
    """Why an explicit split does not describe `num_stages` non-empty stages of `n_layer` layers (None: it does)."""
    if num_stages > n_layer:
        return f"the model has {n_layer} layers, fewer than the {num_stages} pipeline stages (each needs one)"
    if not split:
        return None
    if len(split) != num_stages - 1:
        return f"{len(split)} boundaries given, but {num_stages} stages need {num_stages - 1} (the first layer of each stage after the first)"
    edges = [0, *split, n_layer]
    if any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        return f"the boundaries {list(split)} must rise strictly between 1 and {n_layer - 1} (every stage non-empty)"
    return None


def stages_of_rank(pp_rank: int, pp_size: int, stages_per_rank: int, schedule: str) -> list[int]:
    """The stage indices pipeline rank `pp_rank` holds, in the order its schedule expects them."""
    if schedule == "zero_bubble":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


def rank_of_stage(stage: int, pp_size: int, schedule: str) -> int:
    """The pipeline rank holding `stage`: the inverse of stages_of_rank."""
    if schedule == "zero_bubble":
        return stage if stage < pp_size else 2 * pp_size - 1 - stage
    return stage % pp_size


def bubble_fraction(pp_size: int, microbatches: int, schedule: str, stages_per_rank: int = 1) -> float:
    """The idle share of a step in theory: (p - 1) / (m + p - 1), divided by the stages per rank when interleaved.

    Zero-bubble schedules split the weight gradient off the input gradient to fill most of the
    remaining bubble; their figure here is the interleaved one, an upper bound.
    """
    p, m = pp_size, microbatches
    if p <= 1:
        return 0.0
    v = stages_per_rank if schedule in MULTI_STAGE_SCHEDULES else 1
    return (p - 1) / (v * m + p - 1)
