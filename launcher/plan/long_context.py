"""The long-sequence terms of a spec's activation shape: loss chunks and whether a dense document mask is built."""

from __future__ import annotations

from launcher.components.model.long_context import loss_chunk_count, loss_chunking_bypass, resolve_attention
from launcher.components.model.shape import model_shape
from launcher.config.model import vocab_size
from launcher.spec import RunSpec


def long_context_terms(spec: RunSpec, micro_batch: int, device_type: str) -> dict:
    """ActivationShape's loss_chunks, dense_mask and selective_matmuls for `micro_batch` sequences on `device_type`."""
    chunks = 1
    if loss_chunking_bypass(spec.parallel, spec.model) is None:
        model = model_shape(spec.model).equivalent
        vocab = vocab_size(model)
        tokens = micro_batch * spec.data.seq_len // max(spec.parallel.cp_size, 1)  # this rank's share
        chunks = loss_chunk_count(spec.train.loss_chunks, tokens=tokens, vocab=vocab)
    packed = spec.data.packing and spec.data.document_mask
    path = resolve_attention(
        spec.model.attention,
        packed=packed,
        device_type=device_type,
        dropout=spec.model.dropout,
        seq_len=spec.data.seq_len,
    )
    return {
        "loss_chunks": chunks,
        "dense_mask": packed and path == "sdpa" and spec.parallel.cp_size < 2,  # cp masks its own chunks
        "selective_matmuls": spec.memory.selective_matmuls,
    }
