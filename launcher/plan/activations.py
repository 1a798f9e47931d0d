"""Activation memory of the built-in GPT per rank, from its shapes alone (no model is built).

The model follows Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (2022): a transformer layer keeps about s*b*h*(34 + 5*a*s/h) bytes for backward in 16-bit
with dropout. This decoder differs in three ways, counted tensor by tensor below:

- attention goes through SDPA (flash or memory-efficient kernels on GPU, the flash kernel on CPU),
  which keeps q, k, v, its output and a log-sum-exp row per head instead of the a*s^2 scores;
- under autocast the residual stream and the LayerNorms stay in float32, and each of the three
  q/k/v projections saves its own 16-bit copy of their shared input;
- with `model.dropout=0` no dropout masks are kept.

On top of the layers come the logits, which the loss turns into float32 log-probabilities and two
float32 gradients of the same size during backward: batch*seq*vocab*4 bytes, three times over.
For small models (and large vocabularies) they are often the largest single item. Tensor parallelism
splits the head over the vocabulary, so a rank holds vocab / tp_size of each row, and its loss
(launcher.components.model.vocab_parallel) holds one float32 slice: a copy of the logits beside them
while its forward runs, turned into the softmax in place and kept until backward, which makes the
gradient in that same slice (no further float32 slices). A chunked loss
(`train.loss_chunks`) keeps none of them and recomputes one chunk at a time: one chunk's worth is
counted. Packed documents under `model.attention` resolving to sdpa add the dense [B, 1, T, T]
boolean mask; varlen and flex add nothing of that size. Context parallel (`parallel.cp_size`) divides
the tokens of a rank by cp_size and adds, per block, the keys and values gathered from the other
ranks, and once per forward the chunks' masks. `selective` checkpointing keeps each
block's input and its matmul and attention outputs (all, or every other matmul's).

A Hugging Face Llama-style layer (`ActivationShape.llama`) is counted tensor by tensor too, as its
code saves them: each RMSNorm keeps its float32 input and its float32 normalized output (the
weight multiplies the latter) and a float32 reciprocal RMS per token; the queries at q_proj's width,
the keys and values at k_proj's (copied out to the query heads where SDPA gets a mask and a
rank holds more than one key-value head); SDPA's output
is o_proj's input (no copy); SDPA turns the boolean document mask into its own float copy in every
layer; the gated MLP keeps four [tokens x d_ff] tensors (gate and up outputs, SiLU's output, the
product) and its input (one float32 tensor, or one 16-bit copy each for gate and up under
autocast); the rotary cos and sin tables once per forward. Under FSDP2's mixed precision the
residual stream is 16-bit: the norms cast their input to float32 and keep a 16-bit normalized
output, and the projections share one 16-bit input. Under tensor parallelism the
projections' widths divide by tp_size; under sequence parallelism the norms' tensors do too.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.components.model.shape import LlamaLayer
from launcher.config.model import ModelConfig, ff_width, vocab_size

FP32 = 4
INDEX = 8  # int64 token ids and labels


@dataclass(frozen=True, kw_only=True)
class ActivationShape:
    """What one rank pushes through the model at a time."""

    micro_batch: int
    """Sequences per forward pass on this rank."""
    seq_len: int
    """Tokens per sequence."""
    act_bytes: int
    """Bytes of a 16-bit or 32-bit activation (2 under bf16/fp16 autocast, else 4)."""
    tp_size: int = 1
    """Tensor-parallel degree: attention heads and MLP width are split over this many ranks."""
    sequence_parallel: bool = False
    """Norms and residuals are split along the sequence between tensor-parallel regions."""
    loss_chunks: int = 1
    """Chunks of token rows the loss projects and scores one at a time (1: the whole logits)."""
    dense_mask: bool = False
    """Packed documents are kept apart by a dense [B, 1, T, T] boolean mask (model.attention resolves to sdpa)."""
    selective_matmuls: str = "all"
    """Under selective checkpointing: all matmul outputs are kept, or every_other one."""
    cp_size: int = 1
    """Context-parallel degree: seq_len is this rank's share of a sequence (its two chunks), and each block
    keeps the keys and values gathered from the other cp_size - 1 ranks."""
    llama: LlamaLayer | None = None
    """A Hugging Face Llama-style layer's widths: its own tensors are counted (None: the GPT block's)."""
    residual_bytes: int = FP32
    """Bytes of a residual-stream element: 4, or 2 where FSDP2's mixed-precision policy computes with 16-bit
    weights (nothing promotes the stream to float32 then; read by the Llama-style terms)."""


def _attention_bytes(cfg: ModelConfig, shape: ActivationShape) -> int:
    """Saved by one block's attention branch (its input LayerNorm output onwards)."""
    if shape.llama is not None:
        return _llama_attention_bytes(cfg, shape, shape.llama)
    tokens, d, act = shape.micro_batch * shape.seq_len, cfg.d_model, shape.act_bytes
    local = d // shape.tp_size
    heads = max(cfg.n_head // shape.tp_size, 1)
    # q/k/v inputs: one shared float32 tensor, or three 16-bit copies made by autocast
    proj_inputs = tokens * d * (FP32 if act == FP32 else 3 * act)
    qkv = 3 * tokens * local * act
    sdpa_out = tokens * local * act + tokens * heads * FP32  # output + log-sum-exp
    o_input = tokens * local * act  # the output reshaped to [b, s, h]: a copy
    masks = 2 * tokens * d if cfg.dropout > 0 else 0  # attention and residual dropout (bool)
    gathered = 2 * tokens * (shape.cp_size - 1) * local * act  # cp: the other ranks' keys and values
    return proj_inputs + qkv + sdpa_out + o_input + masks + gathered


def _llama_attention_bytes(cfg: ModelConfig, shape: ActivationShape, layer: LlamaLayer) -> int:
    """Saved by a Llama-style layer's attention (input_layernorm's output onwards)."""
    tokens, act, tp = shape.micro_batch * shape.seq_len, shape.act_bytes, shape.tp_size
    # q/k/v inputs: one shared tensor of the residual's dtype (under sequence parallelism the gathered
    # sequence), or three 16-bit copies made by autocast of a float32 one
    proj_inputs = tokens * cfg.d_model * (shape.residual_bytes if shape.residual_bytes == act else 3 * act)
    # SDPA keeps q and k after the rotary embedding and v; given a mask, transformers repeats the
    # key-value heads to the query heads (grouped-query attention runs in SDPA only without one), a
    # copy unless the rank holds one key-value head (then the repeat is a view of it)
    kv_heads = layer.kv_width // (layer.head_dim * tp)
    kv_width = layer.q_width if shape.dense_mask and kv_heads > 1 else layer.kv_width
    qkv = tokens * (layer.q_width + 2 * kv_width) // tp * act
    heads = max(layer.q_width // (layer.head_dim * tp), 1)
    # SDPA's output (o_proj's input: no copy) and its log-sum-exp
    sdpa_out = tokens * layer.q_width // tp * act + tokens * heads * FP32
    # SDPA turns the boolean document mask into an additive one in the query's dtype, per layer
    mask = shape.micro_batch * shape.seq_len * shape.seq_len * act if shape.dense_mask else 0
    dropout = 2 * tokens * cfg.d_model if cfg.dropout > 0 else 0
    gathered = 2 * tokens * (shape.cp_size - 1) * kv_width // tp * act  # cp: the other ranks' keys and values
    return proj_inputs + qkv + sdpa_out + mask + dropout + gathered


def _mlp_bytes(cfg: ModelConfig, shape: ActivationShape) -> int:
    """Saved by one block's MLP branch (its input LayerNorm output onwards)."""
    tokens, act = shape.micro_batch * shape.seq_len, shape.act_bytes
    if shape.llama is not None:  # gate and up share their input, or each casts a 16-bit copy of a float32 one
        inputs = tokens * cfg.d_model * (shape.residual_bytes if shape.residual_bytes == act else 2 * act)
        return inputs + 4 * tokens * (shape.llama.ff_width // shape.tp_size) * act  # gate, up, SiLU, product
    ff = ff_width(cfg) // shape.tp_size
    up_input = tokens * cfg.d_model * act
    gelu_input, down_input = tokens * ff * act, tokens * ff * act
    mask = tokens * cfg.d_model if cfg.dropout > 0 else 0
    return up_input + gelu_input + down_input + mask


def _norm_bytes(cfg: ModelConfig, shape: ActivationShape) -> int:
    """One LayerNorm: its float32 input (the residual stream) and two float32 statistics per token.

    A Llama-style RMSNorm: its input cast to float32, its normalized output in the residual's dtype (which
    the weight multiplies) and one float32 reciprocal RMS per token.
    """
    tokens = shape.micro_batch * shape.seq_len
    split = shape.tp_size if shape.sequence_parallel else 1
    if shape.llama is not None:
        return (tokens * cfg.d_model * (FP32 + shape.residual_bytes) + tokens * FP32) // split
    return (tokens * cfg.d_model * FP32 + 2 * tokens * FP32) // split


def _selective_bytes(cfg: ModelConfig, shape: ActivationShape) -> int:
    """Kept by a selectively checkpointed block: its input, attention's output, and the kept matmul outputs."""
    tokens, act = shape.micro_batch * shape.seq_len, shape.act_bytes
    local, ff = cfg.d_model // shape.tp_size, ff_width(cfg) // shape.tp_size
    heads = max(cfg.n_head // shape.tp_size, 1)
    # matmul outputs in call order: q, k, v, o, up, down; every_other keeps the 1st, 3rd and 5th
    outputs = [tokens * local * act] * 3 + [
        tokens * cfg.d_model * act,
        tokens * ff * act,
        tokens * cfg.d_model * act,
    ]
    kept = outputs if shape.selective_matmuls == "all" else outputs[::2]
    sdpa_out = tokens * local * act + tokens * heads * FP32
    return tokens * cfg.d_model * FP32 + sum(kept) + sdpa_out


def mask_bytes(shape: ActivationShape) -> int:
    """The dense document mask, one boolean per (query, key) pair of each sequence (0 without one).

    Under context parallel, the additive masks of this rank's two chunks, built once per forward in the
    compute dtype: chunk c of 2 x cp_size sees the keys up to its end, (c + 1) chunks, and a rank's two
    chunks r and 2 cp_size - 1 - r together see 2 cp_size + 1 chunks of keys.
    """
    if shape.cp_size > 1:
        chunk = shape.seq_len // 2
        return shape.micro_batch * chunk * chunk * (2 * shape.cp_size + 1) * shape.act_bytes
    return shape.micro_batch * shape.seq_len * shape.seq_len if shape.dense_mask else 0


def rotary_bytes(shape: ActivationShape) -> int:
    """A Llama-style model's rotary cos and sin tables, one row of positions per sequence (0 for the GPT)."""
    if shape.llama is None:
        return 0
    return 2 * shape.micro_batch * shape.seq_len * shape.llama.head_dim * shape.residual_bytes


def layer_bytes(cfg: ModelConfig, shape: ActivationShape, mode: str = "none") -> int:
    """Bytes one transformer block keeps for backward under a checkpointing mode (none, blocks, attention, selective)."""
    norms = 2 * _norm_bytes(cfg, shape)
    attention, mlp = _attention_bytes(cfg, shape), _mlp_bytes(cfg, shape)
    tokens = shape.micro_batch * shape.seq_len
    if mode == "selective":
        return _selective_bytes(cfg, shape)
    if mode == "blocks":
        return tokens * cfg.d_model * FP32  # the block's input only; the rest is recomputed
    if mode == "attention":
        return norms + tokens * cfg.d_model * FP32 + mlp  # attention's input kept, its inside recomputed
    return norms + attention + mlp


def logit_rows(shape: ActivationShape) -> int:
    """Token rows whose logits are alive at once: the whole micro batch, or one chunk of it."""
    tokens = shape.micro_batch * shape.seq_len
    return -(-tokens // max(shape.loss_chunks, 1))


def vocab_shard(cfg: ModelConfig, shape: ActivationShape) -> int:
    """Logits per token row on this rank: the whole vocabulary, or its tensor-parallel slice."""
    return -(-vocab_size(cfg) // max(shape.tp_size, 1))


def loss_grad_slices(shape: ActivationShape) -> int:
    """float32 logits-sized tensors the loss's backward makes at once: two, none for the vocabulary-parallel loss.

    The vocabulary-parallel loss turns the float32 softmax it kept from forward into the gradient in
    place (launcher.components.model.vocab_parallel); the slice is counted among the saved tensors.
    """
    return 0 if shape.tp_size > 1 else 2


def loss_grad_bytes(cfg: ModelConfig, shape: ActivationShape) -> int:
    """The loss's float32 logits-sized gradients (of one chunk): alive only while one micro batch runs backward."""
    return loss_grad_slices(shape) * logit_rows(shape) * vocab_shard(cfg, shape) * FP32


def head_bytes(cfg: ModelConfig, shape: ActivationShape) -> int:
    """Final norm, LM head input, logits and the loss's float32 log-probabilities and gradients (one chunk's)."""
    tokens = shape.micro_batch * shape.seq_len
    logits = logit_rows(shape) * vocab_shard(cfg, shape)
    # the 16-bit logits before .float(); the vocabulary-parallel loss's forward holds the logits in any dtype
    held = shape.act_bytes != FP32 or shape.tp_size > 1
    casts = logits * shape.act_bytes if held else 0
    ids = 2 * tokens * INDEX
    saved = _norm_bytes(cfg, shape) + tokens * cfg.d_model * shape.act_bytes + logits * FP32 + casts + ids
    return saved + loss_grad_bytes(cfg, shape)


def layers_bytes(
    cfg: ModelConfig, shape: ActivationShape, layers: range, *, mode: str = "none", checkpoint_every: int = 1
) -> tuple[int, int]:
    """What the decoder `layers` keep for backward, and the extra of recomputing one checkpointed layer.

    Layer i is checkpointed when i is a multiple of `checkpoint_every` (counted over the whole
    model, so a pipeline stage checkpoints the same layers as the unsplit model).
    """
    every = max(checkpoint_every, 1)
    chosen = 0 if mode == "none" else sum(1 for i in layers if i % every == 0)
    full = layer_bytes(cfg, shape)
    kept = (len(layers) - chosen) * full + chosen * layer_bytes(cfg, shape, mode)
    return kept, (full - layer_bytes(cfg, shape, mode)) if chosen else 0


def activation_bytes(
    cfg: ModelConfig, shape: ActivationShape, *, mode: str = "none", checkpoint_every: int = 1
) -> int:
    """Peak activation bytes of one micro batch's forward + backward on one rank.

    With checkpointing, the chosen blocks keep only what their recomputation needs, and one block
    at a time is recomputed in full during backward.
    """
    kept, recompute = layers_bytes(
        cfg, shape, range(cfg.n_layer), mode=mode, checkpoint_every=checkpoint_every
    )
    return kept + recompute + head_bytes(cfg, shape) + mask_bytes(shape) + rotary_bytes(shape)
