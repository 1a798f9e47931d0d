"""The built-in GPT decoder: pre-norm blocks, SDPA attention, learned positions, tied embeddings.

`position_ids` that restart inside a row mark packed documents: positions restart there and
attention stays inside each document (`model.attention`: a dense mask, per-document spans or a
FlexAttention block mask, launcher.components.model.attention), so a packed row gives every
document the logits it gets alone. Without them attention is plain causal (the fused kernel).
With a chunked loss (`loss_chunks`, set from train.loss_chunks) the model returns its final hidden
states and head (HeadOutputs) instead of logits, and the loss projects them chunk by chunk.

Decoding goes through the same `forward` with a key-value cache (`new_cache()`, then
`model(ids, positions, cache=cache, attention_mask=mask)`; launcher.components.model.generation):
each block keeps the keys and values of the tokens seen so far, so a step runs only the new tokens,
and FSDP2's hooks and tensor parallel's styles apply as in training. Without a cache the training
path runs exactly as before.

The module layout is kept stable and tensor-parallel friendly (separate q/k/v/o and up/down
projections, head count derived from the local projection width) because parallel strategies
refer to these names when they shard the model.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from launcher.components.model.attention import Documents, attend, documents
from launcher.components.model.context_parallel import ContextGroup, shard_sequence
from launcher.components.model.long_context import loss_chunk_count
from launcher.components.model.loss import HeadOutputs
from launcher.config.model import ModelConfig, expert_width, ff_width, vocab_size
from launcher.config.moe import is_moe_block


class KVCache:
    """The keys and values each block has seen so far, and which of those tokens are real (not left padding)."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        """Per block: the cached keys [B, H, T_seen, D] (local heads under tensor parallel)."""
        self.values: list[torch.Tensor | None] = [None] * num_layers
        """Per block: the cached values, laid out as the keys."""
        self.length = 0
        """Tokens seen so far (the cached columns, padding included)."""
        self.mask: torch.Tensor | None = None
        """This call's [B, 1, T_new, T_seen] boolean mask: causal, padding hidden, each token sees itself."""

    def begin(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Take in a call's new tokens: `attention_mask` [B, T_seen] marks the real ones (None: all are)."""
        new, device = input_ids.shape[1], input_ids.device
        total = self.length + new
        if attention_mask is None:
            attention_mask = torch.ones(input_ids.shape[0], total, dtype=torch.bool, device=device)
        query_at = torch.arange(self.length, total, device=device)[:, None]
        key_at = torch.arange(total, device=device)[None, :]
        real = attention_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
        # a padding query sees itself, so no row is all masked (SDPA would give NaN and spread it)
        self.mask = (real & (key_at <= query_at)) | (key_at == query_at)
        self.length = total

    def layer(self, index: int) -> LayerCache:
        """The view block `index` attends through."""
        return LayerCache(self, index)


class LayerCache:
    """One block's part of a KVCache: appends the new keys and values, then attends over all of them."""

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache = cache
        self.index = index

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Sequence-major q/k/v [B, T_new, H, D] -> [B, T_new, H, D], keys and values cached first."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        cache, index = self.cache, self.index
        if cache.keys[index] is not None:
            k = torch.cat([cache.keys[index], k], dim=2)
            v = torch.cat([cache.values[index], v], dim=2)
        cache.keys[index], cache.values[index] = k, v
        return F.scaled_dot_product_attention(q, k, v, attn_mask=cache.mask).transpose(1, 2)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through torch's fused scaled-dot-product kernel."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model ({cfg.d_model}) must be a multiple of n_head ({cfg.n_head}).")
        self.head_dim = cfg.d_model // cfg.n_head
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.attn_dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, attn_mask: Documents | None = None, cache: LayerCache | None = None
    ) -> torch.Tensor:
        """[B, T, d_model] -> [B, T, d_model]; heads counted from q's width so sharded q/k/v work.

        `attn_mask` says how packed documents are kept apart (None: plain causal attention); with a
        `cache` the new tokens attend to the cached ones as well, and their keys and values join it.
        """
        batch, seq, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        num_local_heads = q.shape[-1] // self.head_dim
        q, k, v = (t.reshape(batch, seq, num_local_heads, self.head_dim) for t in (q, k, v))
        if cache is not None:
            y = cache.attend(q, k, v)
        else:
            dropout_p = self.attn_dropout if self.training else 0.0
            y = attend(q, k, v, attn_mask or Documents(path="sdpa"), dropout_p=dropout_p)
        y = y.reshape(batch, seq, num_local_heads * self.head_dim)
        return self.resid_dropout(self.o_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: up projection, GELU, down projection."""

    def __init__(self, cfg: ModelConfig, width: int | None = None) -> None:
        super().__init__()
        width = width or ff_width(cfg)
        self.up = nn.Linear(cfg.d_model, width, bias=cfg.bias)
        self.act = nn.GELU(approximate="tanh")
        self.down = nn.Linear(width, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d_model] -> [B, T, d_model]."""
        return self.dropout(self.down(self.act(self.up(x))))


def _feed_forward(cfg: ModelConfig, index: int) -> nn.Module:
    """Block `index`'s feed-forward part: the dense MLP, or experts where model.moe makes it an MoE block."""
    if not is_moe_block(cfg.moe, index):
        return MLP(cfg)
    from launcher.components.model.moe import MoE

    shared = cfg.moe.shared_experts
    return MoE(cfg, MLP(cfg, shared * expert_width(cfg)) if shared else None)


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)) (an MLP, or experts)."""

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.norm_attn = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.norm_mlp = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = _feed_forward(cfg, index)

    def forward(
        self, x: torch.Tensor, attn_mask: Documents | None = None, cache: LayerCache | None = None
    ) -> torch.Tensor:
        """Apply both residual branches (mask and cache are keywords, so tensor-parallel input hooks pass them on)."""
        x = x + self.attn(self.norm_attn(x), attn_mask=attn_mask, cache=cache)
        return x + self.mlp(self.norm_mlp(x))


class GPT(nn.Module):
    """A GPT-2 style decoder: token and learned position embeddings, pre-norm blocks, LM head."""

    model_family: ClassVar[str] = "gpt"
    """Its key in launcher.config.model.FAMILIES (launcher.components.model.family.family_of reads it)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.loss_chunks = "1"
        """train.loss_chunks of the run (auto or a count); 1 returns logits."""
        self.context_parallel: ContextGroup | None = None
        """Set under parallel.cp_size > 1: the inputs are this rank's chunks of each sequence, and attention
        gathers keys and values over the group (launcher.components.model.context_parallel)."""
        self.tok_emb = nn.Embedding(vocab_size(cfg), cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, vocab_size(cfg), bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * n_layer), zero biases."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.o_proj.weight, mean=0.0, std=residual_std)
            if isinstance(block.mlp, MLP):
                nn.init.normal_(block.mlp.down.weight, mean=0.0, std=residual_std)
            else:  # an MoE block: its stacked experts and shared MLP
                block.mlp.init_weights(0.02, residual_std)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | HeadOutputs:
        """Token ids [B, T] (and positions [B, T] restarting at packed documents) -> logits [B, T, vocab_size].

        With a chunked loss it returns HeadOutputs (normed hidden states and the head) instead. With a
        `cache` (new_cache) it decodes: the tokens' positions, and `attention_mask` [B, T_seen] marking
        the real tokens among all seen so far (left padding), go with them; it returns logits.

        A pipeline stage (launcher.parallel.pipeline_stage) lacks the parts other stages hold: without
        embeddings it takes the previous stage's hidden states [B, T, d_model] instead of token ids,
        and without the head it returns its hidden states.
        """
        if cache is not None:
            return self._decode(input_ids, position_ids, cache, attention_mask)
        seq = input_ids.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {seq} tokens exceeds the context of {self.cfg.max_seq_len}.")
        if self.context_parallel is not None:
            position_ids, docs = self._context_layout(input_ids, position_ids)
        else:
            docs = documents(
                self.cfg.attention, position_ids, input_ids.device.type, dropout=self.cfg.dropout
            )
        if position_ids is None:
            position_ids = torch.arange(seq, device=input_ids.device)
        if self.tok_emb is None:
            x = input_ids
        else:
            x = self.emb_dropout(self.tok_emb(input_ids) + self.pos_emb(position_ids))
        for block in self.blocks:
            x = block(x, attn_mask=docs)
        if self.lm_head is None:
            return x
        chunks = loss_chunk_count(
            self.loss_chunks, tokens=x.shape[0] * x.shape[1], vocab=vocab_size(self.cfg)
        )
        if chunks > 1:
            return HeadOutputs(self.norm_f(x), self.lm_head, chunks)
        return self.lm_head(self.norm_f(x))

    def new_cache(self) -> KVCache:
        """An empty key-value cache for decoding through forward (one slot per block)."""
        return KVCache(len(self.blocks))

    def _decode(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        cache: KVCache,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The new tokens through every block with the cache: logits [B, T_new, vocab_size]."""
        if self.tok_emb is None or self.lm_head is None or self.context_parallel is not None:
            raise ValueError(
                "decoding with a key-value cache needs the whole model: not a pipeline stage, no context parallel."
            )
        if position_ids is None:
            position_ids = torch.arange(
                cache.length, cache.length + input_ids.shape[1], device=input_ids.device
            )
        cache.begin(input_ids, attention_mask)
        x = self.emb_dropout(self.tok_emb(input_ids) + self.pos_emb(position_ids))
        for index, block in enumerate(self.blocks):
            x = block(x, cache=cache.layer(index))
        return self.lm_head(self.norm_f(x))

    def _context_layout(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, Documents]:
        """Context parallel: the local tokens' global positions (when none are given) and the attention layout."""
        group = self.context_parallel
        if position_ids is None:  # not packed: positions are the tokens' indices in the whole sequence
            whole = torch.arange(input_ids.shape[1] * group.size, device=input_ids.device)
            position_ids = shard_sequence(whole, group.rank, group.size, dim=0).expand(input_ids.shape[0], -1)
        return position_ids, Documents(path="cp", layout=group.layout(position_ids))
