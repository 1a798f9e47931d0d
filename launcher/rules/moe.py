"""Rules of the built-in GPT's experts (model.moe.*), checked before launch.

The numbers must describe a router that can choose (1 <= top_k <= num_experts), an interleave that leaves
at least one MoE block, widths and coefficients in range. model.moe is the built-in GPT's: a Hugging Face
folder's config.json decides its own experts. What the MoE blocks do not compose with yet is refused with
the reason: sequence parallelism (a router takes whole sequences; tensor parallel without it splits the
attention and dense MLPs and keeps routers and experts whole), a capacity factor under context parallel
(each rank routes only its chunks of the sequences), the zero_bubble pipeline schedule (it detaches the stage
outputs the auxiliary losses ride on), DeepSpeed (its engine owns the gradient reduction), torch.compile (the
routing's per-step bookkeeping breaks its graphs), and objectives other than sft (the auxiliary losses
are counted per trained token). Expert parallelism (parallel.ep_size) needs experts to split, a world
size and an expert count it divides, and DDP or FSDP2 (the strategies it is built on so far); with tensor
parallel or pipeline stages the ep groups are data-parallel ranks sharing those coordinates, one stage a rank.
On a Hugging Face folder, one of the MoE families the launcher trains (their experts modules share one
forward), without tensor parallel, pipelines, context parallel, adapters, quantization or compile.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

from launcher.components import checkpoint
from launcher.components.model.hf_experts import MOE_FAMILIES, num_experts
from launcher.components.model.hf_files import local_dir, read_local_config
from launcher.config.moe import ROUTERS, MoEConfig
from launcher.parallel.checkpoint_layout import checkpoint_kind
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, choice
from launcher.spec import RunSpec, SpecError

DENSE = "model.moe.num_experts=0 (a dense model)"
"""The fix that turns experts off."""


def _numbers(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    moe, n_layer = spec.model.moe, spec.model.n_layer
    if moe.num_experts < 0:
        yield SpecError(
            ("model.moe.num_experts",), f"counts experts, so it must be 0 or more, got {moe.num_experts}."
        )
    if moe.num_experts <= 0:
        if dataclasses.replace(moe, num_experts=0) != MoEConfig():
            yield SpecError(
                ("model.moe.num_experts",),
                "model.moe's other keys are set but model.moe.num_experts is 0, so the model has no experts and "
                "they would be ignored. Set model.moe.num_experts (e.g. `model=gpt_moe_tiny`) or drop them.",
            )
        return
    if spec.model.kind != "gpt":
        yield SpecError(
            ("model.moe.num_experts", "model.kind"),
            "model.moe describes the built-in GPT's experts (model.kind=gpt); a Hugging Face model's experts come "
            f"from its config.json. Drop model.moe or use model.kind=gpt. Or {DENSE}.",
        )
    if not 1 <= moe.top_k <= moe.num_experts:
        yield SpecError(
            ("model.moe.top_k", "model.moe.num_experts"),
            f"each token goes to top_k of the num_experts experts, so 1 <= top_k <= {moe.num_experts}, got "
            f"{moe.top_k}. E.g. model.moe.top_k={min(2, moe.num_experts)}.",
        )
    if moe.shared_experts < 0:
        yield SpecError(
            ("model.moe.shared_experts",),
            f"counts shared experts, so it must be 0 or more, got {moe.shared_experts}.",
        )
    if not 1 <= moe.every <= n_layer:
        yield SpecError(
            ("model.moe.every", "model.n_layer"),
            f"every `every`-th block holds experts, so it must lie in 1..model.n_layer ({n_layer}) for at least "
            f"one MoE block, got {moe.every}. E.g. model.moe.every=1 (every block) or 2 (alternate).",
        )
    if moe.d_ff is not None and moe.d_ff < 1:
        yield SpecError(
            ("model.moe.d_ff",),
            f"is each expert's hidden width, so it must be 1 or more, got {moe.d_ff}. E.g. model.moe.d_ff=null (model.d_ff).",
        )
    yield from choice("model.moe.router", moe.router, ROUTERS, "router")
    for key in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
        value = getattr(moe, key)
        if not (math.isfinite(value) and value >= 0):
            yield SpecError(
                (f"model.moe.{key}",),
                f"is a weight, so it must be a finite number >= 0 (0: off), got {value}.",
            )
    if moe.capacity_factor is not None and not (
        math.isfinite(moe.capacity_factor) and moe.capacity_factor > 0
    ):
        yield SpecError(
            ("model.moe.capacity_factor",),
            f"scales each expert's share of a micro batch's assignments, so it must be above 0, got "
            f"{moe.capacity_factor}. E.g. 1.25, or null: dropless.",
        )


_WHY_NOT = (
    ("parallel.sequence_parallel", lambda s: s.parallel.tp_size > 1 and s.parallel.sequence_parallel, "a router takes whole sequences (its auxiliary losses are per sequence), and sequence parallelism hands each tensor-parallel rank a shard of them", "parallel.sequence_parallel=false"),
    ("parallel.pp_schedule", lambda s: s.parallel.pp_size > 1 and s.parallel.pp_schedule == "zero_bubble", "zero_bubble splits each stage's backward in two and detaches the stage's outputs in place, which the auxiliary losses each stage attaches to its output do not survive", "parallel.pp_schedule=1f1b or interleaved_1f1b"),
    ("model.moe.capacity_factor", lambda s: s.parallel.cp_size > 1 and s.model.moe.capacity_factor is not None, "an expert's capacity counts a micro batch's assignments, and each context-parallel rank routes only its chunks of the sequences", "model.moe.capacity_factor=null (dropless) or parallel.cp_size=1"),
    ("parallel.strategy", lambda s: s.parallel.method.owns_engine, "DeepSpeed's engine owns the gradient reduction, which the experts' does not fit yet", "`parallel=fsdp` or `parallel=ddp`"),
    ("compile.mode", lambda s: s.compile.mode != "off", "the routing's per-step bookkeeping breaks torch.compile's graphs", "compile.mode=off"),
    ("objective.name", lambda s: s.objective.name != "sft", "the auxiliary losses are counted per trained token, as sft counts its loss", "objective.name=sft"),
)  # fmt: skip
"""(key, whether the spec uses it, why MoE blocks do not compose with it yet, the fix)."""


def _composition(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    if spec.model.moe.num_experts <= 0:
        return
    for key, uses, why, fix in _WHY_NOT:
        if uses(spec):
            yield SpecError(
                (key, "model.moe.num_experts"),
                f"the built-in GPT's MoE blocks do not compose with {key} yet: {why}. Use {fix}, or {DENSE}.",
            )


def _expert_parallel(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    ep, moe = spec.parallel.ep_size, spec.model.moe
    if ep <= 1 or spec.model.kind == "hf":  # a folder's experts: _hf_expert_parallel
        return
    if spec.model.kind != "gpt":
        yield SpecError(
            ("parallel.ep_size", "model.kind"),
            f"splits the experts of the built-in GPT's MoE blocks (`model=gpt_moe_tiny`) or of a Hugging Face MoE "
            f"folder (model.kind=hf); a model.kind={spec.model.kind} model has none to split. Set parallel.ep_size=1.",
        )
        return
    if moe.num_experts <= 0:
        yield SpecError(
            ("parallel.ep_size", "model.moe.num_experts"),
            "splits the experts of MoE blocks over ranks, and this model has none. Use a model with experts "
            "(e.g. `model=gpt_moe_tiny`) or parallel.ep_size=1.",
        )
        return
    if moe.num_experts % ep:
        yield SpecError(
            ("parallel.ep_size", "model.moe.num_experts"),
            f"each rank of an expert-parallel group holds num_experts / ep_size experts, so "
            f"model.moe.num_experts ({moe.num_experts}) must be a multiple of parallel.ep_size ({ep}). "
            "Change either.",
        )
    yield from _ep_layout(spec)


def _ep_layout(spec: RunSpec) -> Iterator[SpecError]:
    """The world size and the strategy expert parallelism is built on (the built-in GPT's and a folder's)."""
    ep, world = spec.parallel.ep_size, spec.launcher.world_size
    others = spec.parallel.tp_size * spec.parallel.pp_size
    if world % ep and others == 1:
        yield SpecError(
            ("parallel.ep_size", "launcher.nproc", "launcher.nnodes"),
            f"the world size ({world} = launcher.nnodes x launcher.nproc) must be a multiple of parallel.ep_size "
            f"({ep}): the data-parallel ranks form groups of ep_size that split the experts. Change launcher.nproc "
            "or parallel.ep_size.",
        )
    elif others > 1 and (world % others or (world // others) % ep):
        yield SpecError(
            ("parallel.ep_size", "launcher.nproc", "parallel.tp_size", "parallel.pp_size"),
            f"the ranks that split the experts share their tensor-parallel and pipeline coordinates, so the "
            f"data-parallel ranks (the world size {world} over parallel.tp_size x parallel.pp_size = "
            f"{spec.parallel.tp_size} x {spec.parallel.pp_size}) must be a multiple of parallel.ep_size ({ep}). "
            "Change launcher.nproc or parallel.ep_size.",
        )
    if spec.parallel.pp_size > 1 and spec.parallel.pp_stages_per_rank > 1:
        yield SpecError(
            ("parallel.ep_size", "parallel.pp_stages_per_rank"),
            "expert parallelism inside pipeline stages is built for one stage per rank; "
            f"parallel.pp_stages_per_rank={spec.parallel.pp_stages_per_rank} (parallel.pp_schedule="
            f"{spec.parallel.pp_schedule}) gives each rank several. Use parallel.pp_schedule=1f1b with "
            "parallel.pp_stages_per_rank=1, or parallel.ep_size=1.",
        )
    if spec.parallel.data_parallel not in ("ddp", "fsdp") or spec.parallel.replicate_degree > 1:
        yield SpecError(
            ("parallel.ep_size", "parallel.strategy"),
            f"expert parallelism is built on DDP and FSDP2 so far (without hybrid replicas); "
            f"parallel.strategy={spec.parallel.strategy} does not compose with it yet. Use `parallel=ddp` or "
            "`parallel=fsdp`, or parallel.ep_size=1.",
        )


_HF_WHY_NOT = (
    ("parallel.tp_size", lambda s: s.parallel.tp_size > 1, "tensor parallel keeps a folder's experts whole on every tp rank as replicated DTensors, which the expert slices do not fit yet"),
    ("parallel.pp_size", lambda s: s.parallel.pp_size > 1, "pipeline stages are not built on the expert-parallel groups yet"),
    ("parallel.cp_size", lambda s: s.parallel.cp_size > 1, "context parallel is not built on the expert-parallel groups yet"),
    ("quantization.method", lambda s: s.quantization.method != "none" or s.quantization.lora.rank > 0, "adapters and quantized layers wrap the expert tensors the groups split"),
    ("compile.mode", lambda s: s.compile.mode != "off", "the token exchange's per-step counts break torch.compile's graphs"),
)  # fmt: skip
"""(key, whether the spec uses it, why expert parallelism on a Hugging Face folder does not compose with it yet)."""


def _hf_expert_parallel(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    ep, m = spec.parallel.ep_size, spec.model
    if ep <= 1 or m.kind != "hf":
        return
    key = "model.path" if m.path is not None else "model.hf_config"
    folder = local_dir(m)
    try:
        config = read_local_config(folder) if folder and (Path(folder) / "config.json").is_file() else {}
    except ValueError:
        return  # the model's rules say so
    experts, family = num_experts(config), config.get("model_type")
    if not experts:
        what = (
            f"'{folder}/config.json' describes a dense model"
            if folder
            else f"the {m.hf_config} preset is dense"
        )
        yield SpecError(
            ("parallel.ep_size", key),
            f"splits the routed experts of a Mixture-of-Experts model over ranks, and {what} (no "
            f"num_experts, num_local_experts or n_routed_experts above 1). Set parallel.ep_size=1, or use a MoE "
            f"folder ({', '.join(sorted(MOE_FAMILIES))}).",
        )
        return
    if family not in MOE_FAMILIES:
        return  # the model's rules refuse the family
    if experts % ep:
        yield SpecError(
            ("parallel.ep_size", key),
            f"each rank of an expert-parallel group holds num_experts / ep_size of every layer's experts, and "
            f"'{folder}/config.json' has {experts} experts per layer, not a multiple of parallel.ep_size ({ep}). "
            f"Use a parallel.ep_size that divides {experts}, or 1.",
        )
    for used, uses, why in _HF_WHY_NOT:
        if uses(spec):
            yield SpecError(
                ("parallel.ep_size", used),
                f"expert parallelism on a Hugging Face folder does not compose with {used} yet: {why}. Set "
                f"{used} back to its default, or parallel.ep_size=1 (the experts then train whole on every rank).",
            )
    yield from _ep_layout(spec)


def _expert_parallel_resume(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    if spec.parallel.ep_size <= 1 or spec.parallel.data_parallel != "ddp" or spec.resume is None:
        return
    run_dir = Path(spec.run_dir) if spec.run_dir else None
    found = checkpoint.resolve_resume(spec.resume, run_dir) if spec.resume != "auto" or run_dir else None
    kind = checkpoint_kind(found[0]) if found else "files"
    if kind != "files":
        yield SpecError(
            ("resume", "parallel.ep_size", "parallel.strategy"),
            f"expert parallelism under DDP resumes from a whole-model checkpoint (single or ddp), and "
            f"{found[0]} was written by {kind}. Resume it with `parallel=fsdp` and parallel.ep_size, or with "
            "parallel.ep_size=1.",
        )


RULES: tuple[Rule, ...] = (
    _numbers,
    _composition,
    _expert_parallel,
    _hf_expert_parallel,
    _expert_parallel_resume,
)
"""This module's rules, in the order they report."""
