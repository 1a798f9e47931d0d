"""Rules of the quantization group (int8 / nf4 weights, LoRA/DoRA adapters through peft), checked before anything starts."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.components.adapters import EXPERT_PARAMETERS
from launcher.components.model.hf_files import PRESET_LINEARS, is_preset
from launcher.components.nf4 import GROUP, shape_problem
from launcher.components.quantization import nf4_backend
from launcher.config.quantization import NF4_BACKENDS
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, installed, missing
from launcher.spec import RunSpec, SpecError

# The linear layers of the built-in GPT's blocks (launcher.components.model.gpt), by name suffix.
GPT_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "up", "down")
TORCHAO_STRATEGIES = ("single", "fsdp")
"""Strategies torchao's NF4 weights are supported under (FSDP2 shards them; one process keeps them whole)."""


def model_linears(spec: RunSpec) -> tuple[str, ...] | None:
    """Name suffixes of the model's quantizable linear layers; None when only building it would tell."""
    m = spec.model
    if m.kind == "gpt":
        return GPT_LINEARS
    if m.kind == "hf" and is_preset(m.hf_config):
        return PRESET_LINEARS[m.hf_config]
    return None


def _quantized_needs_adapters(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    q = spec.quantization
    if q.method != "none" and q.lora.rank == 0:
        yield SpecError(
            ("quantization.method", "quantization.lora.rank"),
            f"{q.method} weights are frozen (bitsandbytes stores them as integers), so without adapters "
            f"nothing in the blocks would train. Add LoRA adapters: `quantization={q.method}_lora` "
            "(or quantization.lora.rank=16), or use `quantization=none` for full training.",
        )
    if q.method != "none":
        yield from missing(
            "bitsandbytes",
            ("quantization.method",),
            f"quantization.method={q.method} needs bitsandbytes, which is not installed. "
            "Install it with `pip install -e '.[bnb]'` (or `pip install bitsandbytes`).",
        )
    if q.int8_threshold < 0:
        yield SpecError(
            ("quantization.int8_threshold",),
            f"must be 0 or more (0 turns the fp16 outlier path off; 6.0 is LLM.int8's), got {q.int8_threshold}.",
        )


def _lora_settings(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    lora = spec.quantization.lora
    if lora.rank < 0:
        yield SpecError(("quantization.lora.rank",), f"must be 0 (no adapters) or more, got {lora.rank}.")
    if lora.rank == 0:
        return
    if lora.alpha <= 0:
        yield SpecError(
            ("quantization.lora.alpha",),
            f"must be positive (adapter scale = alpha / rank), got {lora.alpha}.",
        )
    if not 0.0 <= lora.dropout < 1.0:
        yield SpecError(("quantization.lora.dropout",), f"must lie in [0, 1), got {lora.dropout}.")
    yield from missing(
        "peft",
        ("quantization.lora.rank",),
        "LoRA adapters are built by peft, which is not installed. Install it with "
        "`pip install -e '.[hf]'` (or `pip install peft`), or use quantization.lora.rank=0.",
    )
    yield from _lora_targets(spec)
    yield from _dora(spec)


def _dora(spec: RunSpec) -> Iterator[SpecError]:
    q = spec.quantization
    if q.lora.dora and q.method == "int8":
        yield SpecError(
            ("quantization.lora.dora", "quantization.method"),
            "DoRA on int8 weights fails in peft 0.21 with bitsandbytes 0.50: to take the weight's norm, peft "
            "dequantizes the int8 layer and re-creates its weight, which loses the row scales, so the "
            "second forward pass breaks (seen on the CPU). Use DoRA on nf4 (`quantization=nf4_lora "
            "quantization.lora.dora=true`) or full-precision weights (`quantization=dora`), or plain LoRA on int8.",
        )


def _lora_targets(spec: RunSpec) -> Iterator[SpecError]:
    targets = spec.quantization.lora.targets
    if targets is None:
        return
    if not targets:
        yield SpecError(
            ("quantization.lora.targets",),
            "an empty list adapts nothing. Name layers, e.g. [q_proj,v_proj], or use null for every "
            "linear layer of the blocks.",
        )
        return
    experts = [t for t in targets if t.endswith(EXPERT_PARAMETERS)]
    if experts and spec.quantization.lora.dropout:
        yield SpecError(
            ("quantization.lora.targets", "quantization.lora.dropout"),
            f"{', '.join(experts)} name fused expert tensors, which peft adapts per expert (target_parameters) "
            f"without dropout on the adapter's input (its ParamWrapper refuses lora_dropout="
            f"{spec.quantization.lora.dropout}). Set quantization.lora.dropout=0, or leave the experts out of "
            "quantization.lora.targets.",
        )
    known = model_linears(spec)  # None for a local model: the build checks its layers (same message)
    unknown = [t for t in targets if known is not None and t.rsplit(".", 1)[-1] not in known]
    if unknown:
        yield SpecError(
            ("quantization.lora.targets", "model.kind"),
            f"{', '.join(unknown)} {'matches' if len(unknown) == 1 else 'match'} none of this model's adaptable "
            f"linear layers ({', '.join(known)}); embeddings and the output head (tied to the token "
            "embedding) stay full precision and untargeted. Choose from that list, or use null for all.",
        )


def _tensor_parallel(spec: RunSpec) -> bool:
    p = spec.parallel
    return p.strategy == "tp" or (p.strategy == "fsdp" and p.tp_size > 1)


def _strategies(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    q, p = spec.quantization, spec.parallel
    keys = ("quantization.method", "parallel.strategy")
    if q.method != "none" and _tensor_parallel(spec):
        yield SpecError(
            (*keys, "parallel.tp_size"),
            f"{q.method} weights cannot be split by tensor parallelism (it re-lays out each projection as a "
            "DTensor shard; low-bit weights keep their scales in blocks). Use `parallel=fsdp` with "
            "parallel.tp_size=1 (nf4), `parallel=ddp` or DeepSpeed ZeRO 0-2.",
        )
    elif q.method == "int8" and p.strategy == "fsdp":
        yield SpecError(
            keys,
            "int8 weights cannot be sharded by FSDP2: bitsandbytes keeps each int8 matrix with its row scales "
            "as one packed tensor. Use `quantization=nf4_lora` (FSDP2 shards torchao's NF4 tensors), "
            "`parallel=ddp` or DeepSpeed ZeRO 0-2.",
        )
    elif q.method == "nf4" and p.strategy == "fsdp" and q.nf4_backend == "bitsandbytes":
        yield SpecError(
            ("quantization.nf4_backend", "parallel.strategy"),
            "bitsandbytes' 4-bit matrices cannot be sharded by FSDP2 (the packed codes and their scales are "
            "one tensor plus a side object). Use quantization.nf4_backend=torchao (or auto, the default), "
            "whose NF4 tensors shard with their scales.",
        )
    elif q.method != "none" and p.strategy == "deepspeed" and p.zero_stage == 3:
        yield SpecError(
            (*keys, "parallel.zero_stage"),
            f"{q.method} weights cannot be partitioned by ZeRO-3: bitsandbytes keeps each quantized matrix "
            "with its scales as one packed tensor. Use DeepSpeed ZeRO 0-2 (they replicate the frozen "
            "quantized weights and shard only what trains), `parallel=fsdp` with nf4, or `quantization=lora`.",
        )
    elif (
        q.method == "nf4"
        and nf4_backend(q, p.strategy) == "torchao"
        and p.data_parallel not in TORCHAO_STRATEGIES
    ):
        yield SpecError(
            ("quantization.nf4_backend", "parallel.strategy"),
            f"torchao's NF4 weights are supported under {' and '.join(TORCHAO_STRATEGIES)}; parallel.strategy="
            f"{p.strategy} replicates weights, which bitsandbytes' nf4 does with less overhead. Use "
            "quantization.nf4_backend=bitsandbytes (or auto, the default).",
        )
    if q.lora.rank > 0 and _tensor_parallel(spec):
        yield SpecError(
            ("quantization.lora.rank", "parallel.strategy", "parallel.tp_size"),
            "tensor parallelism shards the q/k/v/o and MLP projections that LoRA wraps, so the two do not "
            "combine. Use `parallel=fsdp` (tp_size 1), `parallel=ddp` or a DeepSpeed option with LoRA, or drop the adapters.",
        )


def _nf4_store(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    q, p = spec.quantization, spec.parallel
    if q.nf4_backend not in NF4_BACKENDS:
        yield SpecError(
            ("quantization.nf4_backend",),
            f"must be one of {', '.join(NF4_BACKENDS)}, got {q.nf4_backend!r}.",
        )
        return
    if q.method != "nf4" or nf4_backend(q, p.strategy) != "torchao":
        return
    if not installed("torchao"):  # the checks below need its NF4 tensors
        yield SpecError(
            ("quantization.nf4_backend",),
            "nf4 weights under FSDP2 are torchao NF4 tensors, and torchao is not installed. Install it with "
            "`pip install -e '.[ao]'` (or `pip install torchao`).",
        )
        return
    if q.lora.dora:
        yield SpecError(
            ("quantization.lora.dora", "quantization.nf4_backend"),
            "DoRA rescales by the dequantized base weight's row norms, and peft dequantizes through "
            "`weight.dequantize()`, whose torchao NF4Tensor form it cannot call (it fails at the first step). "
            "Use LoRA (quantization.lora.dora=false) with torchao's nf4, or DoRA with "
            "`parallel=ddp` (bitsandbytes nf4).",
        )
    if p.ep_size > 1:
        yield SpecError(
            ("quantization.method", "parallel.ep_size"),
            "nf4 under torchao stores each layer's stacked experts as one NF4 tensor of every expert's rows, and "
            "expert parallelism cuts each rank's experts out of the stacked tensors and dispatches tokens to "
            "them, which it does not do on NF4 tensors. Use parallel.ep_size=1 (FSDP2 still shards the NF4 "
            "experts over the ranks), or `quantization=lora` with expert parallelism.",
        )
    yield from _nf4_shapes(spec)


def _nf4_shapes(spec: RunSpec) -> Iterator[SpecError]:
    """Every quantized matrix (the stacked experts' rows too) must split into whole NF4 groups, on every FSDP2 shard."""
    from launcher.components.model.shape import model_shape
    from launcher.components.nf4_experts import stacked_shape_problem, stacked_shapes

    p = spec.parallel
    shards = spec.launcher.world_size // max(p.replicate_degree, 1) if p.strategy == "fsdp" else 1
    targets = spec.quantization.lora.targets or []
    try:
        linears = model_shape(spec.model).block_linears
        experts = {  # those LoRA adapts stay in full precision (launcher.components.nf4_experts)
            name: shape
            for name, shape in stacked_shapes(spec.model).items()
            if spec.quantization.lora.rank == 0
            or not any(t.endswith(name) or name.endswith(t) for t in targets)
        }
    except (OSError, ValueError, KeyError):
        return  # launcher.rules.hf_model says what is wrong with the model folder
    problems = [
        problem
        for name, (fan_in, fan_out) in linears.items()
        if (problem := shape_problem(name, fan_out, fan_in, shards)) is not None
    ]
    problems += [
        problem
        for name, shape in experts.items()
        if (problem := stacked_shape_problem(f"{name} {list(shape)}", shape, shards)) is not None
    ]
    if problems:
        yield SpecError(
            ("quantization.method", "quantization.nf4_backend", "model.d_model"),
            f"torchao's NF4 stores weights in groups of {GROUP} (64 per scale, 256 scales per factor), split "
            f"over {shards} FSDP2 shard(s): {'; '.join(problems[:3])}. Use a model whose block matrices "
            f"hold a multiple of {GROUP} x {shards} weights (a 4096-wide Llama-style model does on up to 256 ranks; "
            "stacked experts count every expert's rows, split between whole experts), fewer ranks, or "
            "`parallel=ddp` with bitsandbytes' nf4.",
        )


RULES: tuple[Rule, ...] = (_quantized_needs_adapters, _lora_settings, _strategies, _nf4_store)
"""This module's rules, in the order they report."""
