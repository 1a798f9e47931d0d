"""The built-in GPT decoder: pre-norm blocks, SDPA attention, learned positions, tied embeddings.

`position_ids` that restart inside a row mark packed documents: positions restart there and a
block-diagonal causal mask keeps attention inside each document, so a packed row gives every
document the logits it gets alone. Without them attention is plain causal (the fused kernel).

The module layout is kept stable and tensor-parallel friendly (separate q/k/v/o and up/down
projections, head count derived from the local projection width) because parallel strategies
refer to these names when they shard the model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from launcher.config.model import ModelConfig, ff_width, vocab_size


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] boolean mask: causal, and only within the document (a position-0 token starts one)."""
    document = (position_ids == 0).cumsum(dim=1)
    same = document.unsqueeze(2) == document.unsqueeze(1)
    causal = torch.ones(
        position_ids.shape[1], position_ids.shape[1], dtype=torch.bool, device=position_ids.device
    ).tril()
    return (same & causal).unsqueeze(1)


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

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T, d_model] -> [B, T, d_model]; heads counted from q's width so sharded q/k/v work.

        `attn_mask` ([B, 1, T, T], True = may attend) replaces the causal mask when documents are packed.
        """
        batch, seq, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        num_local_heads = q.shape[-1] // self.head_dim
        q, k, v = (t.reshape(batch, seq, num_local_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.attn_dropout if self.training else 0.0,
            is_causal=attn_mask is None,
        )
        y = y.transpose(1, 2).reshape(batch, seq, num_local_heads * self.head_dim)
        return self.resid_dropout(self.o_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: up projection, GELU, down projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, ff_width(cfg), bias=cfg.bias)
        self.act = nn.GELU(approximate="tanh")
        self.down = nn.Linear(ff_width(cfg), cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d_model] -> [B, T, d_model]."""
        return self.dropout(self.down(self.act(self.up(x))))


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm_attn = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.norm_mlp = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Apply both residual branches (the mask is a keyword, so tensor-parallel input hooks pass it on)."""
        x = x + self.attn(self.norm_attn(x), attn_mask=attn_mask)
        return x + self.mlp(self.norm_mlp(x))


class GPT(nn.Module):
    """A GPT-2 style decoder: token and learned position embeddings, pre-norm blocks, LM head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(vocab_size(cfg), cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
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
            nn.init.normal_(block.mlp.down.weight, mean=0.0, std=residual_std)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, T] (and positions [B, T] restarting at packed documents) -> logits [B, T, vocab_size].

        A pipeline stage (launcher.parallel.pipeline_stage) lacks the parts other stages hold: without
        embeddings it takes the previous stage's hidden states [B, T, d_model] instead of token ids,
        and without the head it returns its hidden states.
        """
        seq = input_ids.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {seq} tokens exceeds the context of {self.cfg.max_seq_len}.")
        mask = None
        if position_ids is None:
            position_ids = torch.arange(seq, device=input_ids.device)
        else:
            mask = document_mask(position_ids)
        if self.tok_emb is None:
            x = input_ids
        else:
            x = self.emb_dropout(self.tok_emb(input_ids) + self.pos_emb(position_ids))
        for block in self.blocks:
            x = block(x, attn_mask=mask)
        if self.lm_head is None:
            return x
        return self.lm_head(self.norm_f(x))
