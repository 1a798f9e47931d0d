"""Long-sequence choices as pure arithmetic (no torch): the attention path and the loss's chunk count.

`resolve_attention` says which path `model.attention` takes (launcher.components.model.attention
runs it); the rest says how many chunks the loss splits a micro batch's tokens into (`train.loss_chunks`).

The final projection and cross-entropy run over chunks of the flattened [B * T] token rows, each
recomputed in backward, so at most one chunk's logits (and their float32 copy and gradient) are
alive at a time instead of the whole [B, T, vocab] tensor.

`auto` leaves the loss whole while the float32 logits of a micro batch stay under
AUTO_MIN_LOGITS_MB (there chunking only adds a second head matmul in backward), and above it cuts
them into chunks of about AUTO_CHUNK_MB each (at least 2, at most one per token).
"""

from __future__ import annotations

from launcher.config.model import ModelConfig
from launcher.config.parallel import ParallelConfig

AUTO_VARLEN_MIN_TOKENS = 2048
"""Sequence length from which `auto` runs packed documents through varlen off CUDA; below it the
dense mask (B x T x T bytes: 16 MiB for 16 x 1024) is small, and measured on this CPU it was faster
and held less memory than per-document spans (docs/memory.md)."""
AUTO_MIN_LOGITS_MB = 256
"""Float32 logits of a micro batch (MiB) from which `auto` chunks the loss."""
AUTO_CHUNK_MB = 64
"""Float32 logits per chunk (MiB) that `auto` aims for."""
MB = 1 << 20


def resolve_attention(
    choice: str, *, packed: bool, device_type: str, dropout: float = 0.0, seq_len: int | None = None
) -> str:
    """The path `model.attention=choice` takes: sdpa (plain or dense mask), varlen or flex.

    auto takes flex only where its backward runs (CUDA) and no attention dropout is asked for
    (FlexAttention has none); elsewhere varlen from AUTO_VARLEN_MIN_TOKENS tokens per sequence
    (`seq_len`; None: long) and the dense mask below; plain SDPA when no documents are packed.
    """
    if choice != "auto":
        return choice
    if not packed:
        return "sdpa"
    if device_type == "cuda" and dropout == 0:
        return "flex"
    return "varlen" if seq_len is None or seq_len >= AUTO_VARLEN_MIN_TOKENS else "sdpa"


def parse_loss_chunks(setting: str) -> int | None:
    """The whole number `train.loss_chunks` names (None for auto); ValueError if it is neither."""
    if str(setting) == "auto":
        return None
    count = int(str(setting))
    if count < 1:
        raise ValueError(f"train.loss_chunks must be auto or a whole number >= 1 (1: off), got {setting}")
    return count


def loss_chunk_count(setting: str, *, tokens: int, vocab: int) -> int:
    """Chunks of `tokens` rows the loss runs over (1: the whole logits at once)."""
    count = parse_loss_chunks(setting)
    if count is None:
        logits_bytes = tokens * vocab * 4
        if logits_bytes < AUTO_MIN_LOGITS_MB * MB:
            return 1
        count = max(2, -(-logits_bytes // (AUTO_CHUNK_MB * MB)))
    return max(1, min(count, tokens))


def loss_chunking_bypass(parallel: ParallelConfig, model: ModelConfig) -> str | None:
    """Why this run computes whole logits whatever train.loss_chunks says (None: chunking applies).

    Tensor parallel splits the head over the vocabulary: each rank projects its [B, T, vocab / tp]
    slice of the logits and the loss runs over the slices (launcher.components.model.vocab_parallel), so a rank holds
    1 / tp_size of the logits, computed at once; chunking the rows is not combined with it. A
    pipeline's last stage hands its logits to torch's schedule; DeepSpeed owns the module calls of
    its engine. Each of these keeps the whole-logits loss.
    """
    if parallel.tp_size > 1:
        return "tensor parallel splits the head over the vocabulary (each rank scores its 1 / tp_size slice of the logits)"
    if parallel.pp_size > 1:
        return "a pipeline's last stage returns logits to torch's schedule, which calls the loss"
    if parallel.method.owns_engine:
        return "DeepSpeed's engine gathers and frees parameters around its own module calls"
    return None
