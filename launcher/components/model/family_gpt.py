"""The built-in GPT family (`model.kind=gpt`, launcher.components.model.gpt): the Family verbs for it.

Its module names (`blocks`, `attn.q_proj`, `mlp.up`, `tok_emb`, `lm_head`, `norm_f`) are spelled here
and in gpt.py only: tensor parallelism, the pipeline cut and the export read them through these verbs.
torch is imported inside the verbs, so the launching process asks a GPT config's shape without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from launcher.components.model.family import TensorParallelPlan
from launcher.components.model.shape import ModelShape, gpt_shape
from launcher.config.model import ModelConfig

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel import ParallelStyle


def build(cfg: ModelConfig, *, empty: bool = False, announce: bool = True) -> nn.Module:
    """The GPT `cfg` describes, float32 on the CPU; init from torch's global seed (never empty: no folder)."""
    if empty:
        raise ValueError("only a pretrained Hugging Face model (model.path) is built empty.")
    from launcher.components.model.gpt import GPT

    return GPT(cfg)


def init_on_meta(cfg: ModelConfig) -> bool:
    """Yes: its init (normal draws, scaled residual projections) replays into the shards."""
    return True


def from_folder(cfg: ModelConfig) -> bool:
    """Never: the GPT's weights start from the seed."""
    return False


def folder(cfg: ModelConfig) -> str | None:
    """None: the model keys shape the GPT."""
    return None


def shape(cfg: ModelConfig) -> ModelShape:
    """Counted from the model keys (no build)."""
    return gpt_shape(cfg)


def source(cfg: ModelConfig) -> str:
    """The dry run's name for it."""
    return "built-in GPT"


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The blocks (a pipeline stage's: the ones it holds)."""
    return model.blocks


def checkpointing(model: nn.Module, every_n_layers: int, options: dict | None) -> bool:
    """False: launcher.components.memory wraps the GPT's blocks itself."""
    return False


def tp_plan(model: nn.Module, *, sequence_parallel: bool) -> TensorParallelPlan:
    """q/k/v and mlp.up column-wise, o_proj and mlp.down row-wise; with sequence parallelism the norms on the shard."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    branch_out = Shard(1) if sequence_parallel else Replicate()
    layer: dict[str, ParallelStyle] = {
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(output_layouts=branch_out),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=branch_out),
    }
    top: dict[str, ParallelStyle] = {}
    moe = _moe_block_plan(model, branch_out)
    if moe is not None:  # MoE blocks lack mlp.up/down: each block's feed-forward gets its own entries
        layer = {path: style for path, style in layer.items() if not path.startswith("mlp.")}
        top.update(moe)
    if sequence_parallel:
        # norms on the sequence shard; each branch gathers the full sequence before its projections
        gather = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
        layer.update(
            {"norm_attn": SequenceParallel(), "norm_mlp": SequenceParallel(), "attn": gather, "mlp": gather}
        )
        # the residual stream enters the blocks split along the sequence; norm_f leaves it so
        top["blocks.0"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        top["norm_f"] = SequenceParallel()
    return TensorParallelPlan(layer=layer, head="lm_head", embedding="tok_emb", top=top)


def _moe_block_plan(model: nn.Module, branch_out: Any) -> dict[str, ParallelStyle] | None:
    """Per-block feed-forward styles where some blocks hold experts (None: a dense model, the layer plan's own).

    A dense block's MLP splits as in the layer plan; an MoE block's shared MLP splits the same way, while its
    router and routed experts stay whole on every tp rank and compute on their local copies
    (launcher.components.model.hf_local_experts): every tp rank holds the same tokens, so each routes and
    computes the same, and each copy's gradient is the whole gradient, counted once.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from launcher.components.model.hf_local_experts import LocalExperts
    from launcher.components.model.moe import MoE

    blocks = list(model.blocks.named_children())
    if not any(isinstance(block.mlp, MoE) for _, block in blocks):
        return None
    plan: dict[str, ParallelStyle] = {}
    for name, block in blocks:
        mlp, dense = f"blocks.{name}.mlp", block.mlp
        if isinstance(block.mlp, MoE):
            plan[mlp] = LocalExperts()
            plan[f"{mlp}.router.gate"] = LocalExperts()
            dense = block.mlp.shared
            mlp = f"{mlp}.shared"
        if dense is not None:
            plan[f"{mlp}.up"] = ColwiseParallel()
            plan[f"{mlp}.down"] = RowwiseParallel(output_layouts=branch_out)
    return plan


def ep_plan(model: nn.Module) -> dict[str, ParallelStyle] | None:
    """None: the GPT has no experts."""
    return None


def stage(model: nn.Module, layers: range, *, first: bool, last: bool) -> nn.Module:
    """Keep `layers` under their indices; the embeddings on the first stage, norm_f and the head on the last."""
    from launcher.components.model.stage_layers import StageLayers

    model.blocks = StageLayers({i: model.blocks[i] for i in layers})
    if not first:
        model.tok_emb = None
        model.pos_emb = None
    if not last:
        model.norm_f = None
        model.lm_head = None
    return model


def tied_names(cfg: ModelConfig) -> tuple[str, str] | None:
    """The token embedding and the head, where tie_embeddings makes them one matrix."""
    return ("tok_emb.weight", "lm_head.weight") if cfg.tie_embeddings else None


def new_cache(model: nn.Module) -> Any:
    """The decode step's key-value cache: one the model's forward with `cache=` fills (its class makes it)."""
    return model.new_cache()


def transformers_prefix() -> str | None:
    """None: the GPT is our own module (its export is a GPT2LMHeadModel, built by to_transformers)."""
    return None


def to_transformers(state: dict[str, torch.Tensor], cfg: ModelConfig) -> Any:
    """The GPT2LMHeadModel computing what the GPT of `cfg` computes, holding `state` (ValueError for MoE blocks)."""
    from launcher.components.model.hf_export import gpt_to_transformers

    if cfg.moe.num_experts > 0:
        raise ValueError(
            "the built-in GPT with MoE blocks (model.moe.num_experts > 0) has no transformers model to be "
            "exported to yet (GPT-2 has no experts). Export its state dict instead: `train-export RUN_DIR OUT.pt`."
        )

    return gpt_to_transformers(state, cfg)
