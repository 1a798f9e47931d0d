"""Model states per device: weights, gradients and optimizer state of a run, from its spec and world size.

Model states follow the ZeRO paper (Rajbhandari et al., 2020). Mixed-precision Adam keeps
2 + 2 + 12 = 16 bytes per parameter (16-bit weights and gradients; float32 master weights, momentum
and variance); ZeRO stage 1 shards the 12, stage 2 also the gradients, stage 3 also the weights:
4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and 16Ψ/N. torch-native strategies autocast over float32 weights instead,
4 + 4 + 8 bytes (the same 16Ψ, differently split); FSDP full_shard divides all three by N like
stage 3 and shard_grad_op (no reshard after forward) keeps whole weights like stage 2. Only
trainable parameters have gradients and optimizer state (LoRA: the adapters); quantized weights
take 0.5 (nf4 with double quantization) or 1 (int8) byte per parameter plus their constants;
offload moves states to host memory; tensor parallelism divides the block weights by tp_size.
Pure bf16 (precision.param_dtype=bf16) stores weights, gradients and AdamW's moments in bf16 without a
master copy: 2 + 2 + 4 = 8 bytes, half of either, and autocast has no 16-bit copies to make.
A Hugging Face model is counted from its config (launcher.components.model.shape: exact parameters
and block linears from a meta-device build).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from launcher.components.model.shape import model_shape
from launcher.config.model import vocab_size
from launcher.spec import RunSpec

# Optimizer state bytes per trainable parameter, beside the weights (float32 states unless 8-bit).
OPTIMIZER_STATE_BYTES = {
    "adamw": 8.0,  # momentum and variance
    "adamw_8bit": 2.0 + 8 / 256,  # 8-bit momentum and variance, a float32 absmax per 256-value block each
    "paged_adamw_8bit": 2.0 + 8 / 256,
    "lion_8bit": 1.0 + 4 / 256,  # momentum only
}
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's default reduce / all-gather bucket size


@dataclass(frozen=True, kw_only=True)
class ParamCounts:
    """The model's parameters by role, counted from its config."""

    total: int
    """All parameters, a tied matrix once."""
    block_linear: int
    """Weights of the blocks' linear layers: what quantization stores in low bits and TP shards."""
    adapters: int
    """LoRA adapter parameters (0 without LoRA)."""
    trainable: int
    """Parameters that get gradients and optimizer state."""
    head: int
    """Weights of the LM head's matrix (vocab x d_model), which autocast copies to 16 bits; 0 where it is not held."""
    experts: int = 0
    """Routed experts' parameters this rank's replica holds (under expert parallelism its ep_size-th); 0: dense."""
    outside_layers: int | None = None
    """Parameters outside the decoder layers (FSDP2's root group), where counted exactly (MoE models); None: derived."""


def gpt_view(spec: RunSpec) -> RunSpec:
    """`spec` with a Hugging Face model replaced by the GPT of the same width, depth and heads (for the formulas)."""
    equivalent = model_shape(spec.model).equivalent  # the built-in GPT's is its own config
    return spec if equivalent is spec.model else dataclasses.replace(spec, model=equivalent)


def lora_targets(spec: RunSpec) -> tuple[str, ...]:
    """Block linear layers that get LoRA adapters (none when lora.rank is 0)."""
    lora = spec.quantization.lora
    if lora.rank <= 0:
        return ()
    names = model_shape(spec.model).block_linears
    if lora.targets is None:
        return tuple(names)
    return tuple(name for name in names if any(name.endswith(t.rsplit(".", 1)[-1]) for t in lora.targets))


def count_params(spec: RunSpec) -> ParamCounts:
    """Parameters of the spec's model by role, without building it."""
    shape = model_shape(spec.model)
    cfg = shape.equivalent
    total = shape.num_params
    shapes = shape.block_linears
    block_linear = cfg.n_layer * sum(i * o for i, o in shapes.values())
    rank, targets = spec.quantization.lora.rank, lora_targets(spec)
    magnitude = 1 if spec.quantization.lora.dora else 0  # DoRA: one trained magnitude per output row
    adapters = cfg.n_layer * sum(
        rank * (i + o) + magnitude * o for name, (i, o) in shapes.items() if name in targets
    )
    quantized = spec.quantization.method != "none"
    trainable = adapters or (total - block_linear if quantized else total)
    head = vocab_size(cfg) * cfg.d_model
    experts = shape.experts
    return ParamCounts(
        total=total,
        block_linear=block_linear,
        adapters=adapters,
        trainable=trainable,
        head=head,
        experts=experts.num_params if experts else 0,
        outside_layers=experts.outside_layers if experts else None,
    )


def expert_parallel_counts(spec: RunSpec, counts: ParamCounts) -> ParamCounts:
    """`counts` as one rank of an expert-parallel group holds them: its ep_size-th of the routed experts.

    Under DDP that is the rank's whole share; FSDP2 shards the slices further over their replicas (the
    ranks holding the same experts), so a rank stores 1 / world of them, as of every other parameter.
    """
    ep = max(spec.parallel.ep_size, 1)
    if ep == 1 or not counts.experts:
        return counts
    others = counts.experts - counts.experts // ep
    return dataclasses.replace(
        counts,
        total=counts.total - others,
        trainable=counts.trainable - others if counts.trainable == counts.total else counts.trainable,
        experts=counts.experts // ep,
    )


def quantized_bytes_per_param(method: str, double_quant: bool = True, in_features: int = 1) -> float:
    """Stored bytes per quantized weight: nf4 4 bits + absmax per 64 (itself 8-bit with double quant); int8 + row scale."""
    if method == "nf4":
        constants = (1 / 64 + 4 / (64 * 256)) if double_quant else 4 / 64
        return 0.5 + constants
    if method == "int8":
        return 1.0 + 4 / in_features
    return 4.0


def optimizer_state_bytes(spec: RunSpec) -> float:
    """Optimizer state bytes per trainable parameter (torch-native float32 weights)."""
    name = spec.optimizer.name
    if name == "sgd":
        return 4.0 if spec.optimizer.momentum else 0.0
    if name == "adafactor":
        # factored second moment: a row and a column vector per d x d-ish matrix, about 2/d per weight
        return 8.0 / max(spec.model.d_model, 1)
    if name == "muon":  # one float32 momentum per hidden matrix weight, AdamW's two moments for the rest
        counts = count_params(spec)
        if counts.adapters:
            return 4.0  # LoRA's A and B are matrices: Muon's
        hidden = counts.block_linear / max(counts.trainable, 1)
        return 4.0 * hidden + 8.0 * (1.0 - hidden)
    return OPTIMIZER_STATE_BYTES.get(name, 8.0)


@dataclass(frozen=True, kw_only=True)
class ModelStates:
    """Model-state bytes per device, and where offload put the rest (what MODEL_STATES' formulas return)."""

    parameters: float
    gradients: float
    optimizer_states: float
    buffers: float
    host_bytes: float
    note: str
    forward_buffers: float = 0.0
    """The part of `buffers` alive only with the activations (autocast's copies, FSDP2's gathered blocks)."""
    backward_buffers: float = 0.0
    """The part of `buffers` alive only at the end of backward (FSDP2's unsharded gradient of one block)."""
    shard: int = 1
    """Ranks FSDP2 shards the gradients over (1: not sharded)."""
    by_moment: bool = True
    """Whether the parts are split by moment (launcher.plan.moments); DeepSpeed's buckets are not: summed."""


def autocasts_16bit(spec: RunSpec) -> bool:
    """Whether the run autocasts to a 16-bit dtype."""
    return spec.precision.bf16 or spec.precision.fp16


def stored_bytes(spec: RunSpec) -> int:
    """Bytes per stored weight, gradient and optimizer-state value of the torch-native strategies."""
    return 2 if spec.precision.param_dtype == "bf16" else 4


def _weight_bytes(spec: RunSpec, counts: ParamCounts, bytes_16: int) -> float:
    """Bytes of all weights on one replica: base weights at `bytes_16` or in low bits, adapters in float32."""
    method = spec.quantization.method
    if method == "none":
        return counts.total * bytes_16 + counts.adapters * 4
    double = spec.quantization.double_quant
    low_bits = counts.block_linear * quantized_bytes_per_param(method, double, spec.model.d_model)
    return low_bits + (counts.total - counts.block_linear) * bytes_16 + counts.adapters * 4


def _replica(spec: RunSpec, counts: ParamCounts, n: int) -> ModelStates:
    """single and tp (and DDP's base): float32 weights and gradients under autocast, a full replica per rank.

    (Tensor parallelism has already divided the block weights in `counts`.)
    """
    w = stored_bytes(spec)  # pure bf16: the optimizer's float32 state is stored in bf16 too
    weights = _weight_bytes(spec, counts, w)
    grads, states = counts.trainable * float(w), counts.trainable * optimizer_state_bytes(spec) * w / 4
    buffers = 0.0
    if (
        autocasts_16bit(spec) and spec.quantization.method == "none" and w == 4
    ):  # autocast caches a 16-bit copy of each matmul weight
        buffers += 2.0 * (counts.block_linear + counts.head)
    return ModelStates(
        parameters=weights,
        gradients=grads,
        optimizer_states=states,
        buffers=buffers,
        host_bytes=0.0,
        note=f"full replica: {w}Ψ weights + {w}Ψ gradients + optimizer state"
        + (" (pure bf16)" if w == 2 else ""),
        forward_buffers=buffers,  # the cache is cleared when the forward's autocast region ends
    )


def _ddp(spec: RunSpec, counts: ParamCounts, n: int) -> ModelStates:
    """A full replica; without gradient_as_bucket_view DDP's buckets hold a second copy of the gradients."""
    states = _replica(spec, counts, n)
    if spec.parallel.gradient_as_bucket_view:
        return states
    return dataclasses.replace(states, buffers=states.buffers + states.gradients)


def _fsdp(spec: RunSpec, counts: ParamCounts, n: int) -> ModelStates:
    """FSDP2: weights, gradients and optimizer state sharded over the data-parallel group (full_shard ~ ZeRO-3)."""
    p = spec.parallel
    shard = max(n // (max(p.tp_size, 1) * max(p.replicate_degree, 1)), 1)
    replica = _replica(spec, counts, n)
    if shard == 1:
        return replica
    weights, grads, states = replica.parameters, replica.gradients, replica.optimizer_states
    gather = 2 if autocasts_16bit(spec) else 4
    cfg = gpt_view(spec).model
    num_layers = max(cfg.n_layer, 1)
    # the root group (embeddings, final norm, head) stays gathered from forward to the end of backward
    root = max(counts.total - counts.block_linear - num_layers * 2 * cfg.d_model * (1 + int(cfg.bias)), 0)
    if counts.outside_layers is not None:  # a MoE model's layers hold experts beside their linears
        root = counts.outside_layers
    # a layer as FSDP2 gathers it: under expert parallelism its experts are this rank's slice, gathered
    # over the replicas (`counts` holds the whole model: the rank stores 1 / shard of everything)
    layer = (counts.total - root - counts.experts * (1 - 1 / max(p.ep_size, 1))) / num_layers
    # + gathered blocks in forward and backward, one block's unsharded gradient at its reduce-scatter; no
    # autocast copies: FSDP2's mixed-precision policy gathers 16-bit weights, autocast casts nothing
    blocks = min(1 + p.prefetch_layers, num_layers) * layer * gather
    buffers = root * gather + blocks + layer * 4
    kept = weights / shard if p.reshard_after_forward else weights / shard + counts.total * gather
    note = f"FSDP over {shard} ranks: " + (
        "full_shard ~ ZeRO-3" if p.reshard_after_forward else "shard_grad_op ~ ZeRO-2"
    )
    if p.cpu_offload:
        host = kept + grads / shard + states / shard
        return ModelStates(
            parameters=0.0,
            gradients=0.0,
            optimizer_states=0.0,
            buffers=buffers,
            host_bytes=host,
            note=note + ", weights/grads/states offloaded to CPU",
            forward_buffers=blocks,
            backward_buffers=layer * 4,
        )
    return ModelStates(
        parameters=kept,
        gradients=grads / shard,
        optimizer_states=states / shard,
        buffers=buffers,
        host_bytes=0.0,
        note=note,
        forward_buffers=blocks,
        backward_buffers=layer * 4,
        shard=shard,
    )


def _deepspeed(spec: RunSpec, counts: ParamCounts, n: int) -> ModelStates:
    """DeepSpeed ZeRO 0-3: 2+2+12 bytes per parameter in mixed precision, 4+4+8 in float32, sharded by stage."""
    p, trainable = spec.parallel, counts.trainable
    mixed = spec.precision.bf16 or spec.precision.fp16
    w = 2 if mixed else 4
    weights, grads = _weight_bytes(spec, counts, w), trainable * float(w)
    states = trainable * (optimizer_state_bytes(spec) + (4.0 if mixed else 0.0))  # + float32 master copy
    stage = p.zero_stage
    states /= n if stage >= 1 else 1
    grads /= n if stage >= 2 else 1
    weights /= n if stage >= 3 else 1
    layer = counts.total / max(spec.model.n_layer, 1)
    buffers = min(trainable, DEEPSPEED_BUCKET_ELEMENTS) * w if stage in (1, 2) and n > 1 else 0.0
    if stage == 3:
        buffers += 2 * layer * w + min(trainable / n, layer) * w  # live gathered blocks + a reduce bucket
    host = 0.0
    if p.offload_optimizer and stage >= 1:
        host, states = host + states, 0.0
    if p.offload_params and stage == 3:
        host, weights = host + weights, 0.0
    formula = {0: "16Ψ", 1: "4Ψ + 12Ψ/N", 2: "2Ψ + 14Ψ/N", 3: "16Ψ/N"}[min(max(stage, 0), 3)]
    note = (
        f"ZeRO stage {stage} over N={n}: {formula} (mixed precision Adam)"
        if mixed
        else f"ZeRO stage {stage} over N={n}, float32"
    )
    return ModelStates(
        parameters=weights,
        gradients=grads,
        optimizer_states=states,
        buffers=buffers,
        host_bytes=host,
        note=note + (", offloaded to CPU" if host else ""),
        by_moment=False,
    )


def _pipeline(spec: RunSpec, counts: ParamCounts, n: int) -> ModelStates:
    """pp: one pipeline rank's stages (`counts` are theirs), FSDP2-sharded over the n / (pp x tp) data-parallel ranks."""
    states = _fsdp(spec, counts, n // max(spec.parallel.pp_size, 1))
    return dataclasses.replace(states, note=f"this pipeline rank's stages only; {states.note}")


MODEL_STATES: dict[str, Callable[[RunSpec, ParamCounts, int], ModelStates]] = {
    "single": _replica,
    "tp": _replica,
    "ddp": _ddp,
    "fsdp": _fsdp,
    "deepspeed": _deepspeed,
    "pp": _pipeline,
}
"""Model-state formulas per parallel strategy (a test holds its keys to the strategy registry's)."""


def model_states(spec: RunSpec, n: int, counts: ParamCounts | None = None) -> ModelStates:
    """Weights, gradients and optimizer state per device for `n` ranks (of `counts`, default the whole model)."""
    counts = counts or count_params(spec)
    tp = max(spec.parallel.tp_size, 1)
    if tp > 1:  # block linears, head and embedding split over the tensor-parallel group; the rest whole
        split = counts.block_linear // tp
        tied = model_shape(spec.model).equivalent.tie_embeddings
        vocab = counts.head * (1 if tied else 2)  # the head's matrix and the embedding's
        total = counts.total - counts.block_linear + split - vocab + vocab // tp
        outside = counts.outside_layers
        counts = ParamCounts(
            total=total,
            block_linear=split,
            adapters=counts.adapters // tp,
            trainable=round(counts.trainable * total / counts.total),
            head=counts.head // tp,
            experts=counts.experts,  # routed experts stay whole on every tensor-parallel rank
            outside_layers=None if outside is None else outside - vocab + vocab // tp,
        )
    formula, pp = MODEL_STATES[spec.parallel.strategy], max(spec.parallel.pp_size, 1)
    if formula is not _fsdp:  # DDP keeps this rank's expert slices whole (FSDP2 shards them: its formula)
        counts = expert_parallel_counts(spec, counts)
    if pp == 1 or formula is _pipeline:
        return formula(gpt_view(spec), counts, n)
    # a pipeline axis: one pipeline rank's stages, wrapped over the n / pp ranks that hold them
    states = formula(gpt_view(spec), counts, max(n // pp, 1))
    return dataclasses.replace(states, note=f"this pipeline rank's stages only; {states.note}")
