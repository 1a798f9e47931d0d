"""The built-in GPT: shapes, initial loss, loss semantics, tying, size formula, determinism, learning."""

from __future__ import annotations

import math

import pytest
import torch

from launcher.components.model.build import build_model, flops_per_token, num_params
from launcher.components.model.gpt import GPT
from launcher.components.model.loss import lm_loss
from launcher.config.model import ModelConfig

SMALL = ModelConfig(n_layer=2, n_head=2, d_model=32, max_seq_len=16)


def _model(cfg: ModelConfig = SMALL, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return build_model(cfg)


def _batch(batch: int = 4, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_logits_have_batch_time_vocab_shape() -> None:
    logits = _model()(_batch(3, 11))
    assert logits.shape == (3, 11, 256) and logits.dtype == torch.float32


def test_sequence_longer_than_the_context_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds the context of 16"):
        _model()(_batch(1, 17))


def test_untrained_loss_is_close_to_uniform() -> None:
    ids = _batch(8, 16)
    loss_sum, count = lm_loss(_model()(ids[:, :-1]), ids[:, 1:])
    assert count.item() == 8 * 15
    assert (loss_sum / count).item() == pytest.approx(math.log(256), abs=0.1)


def test_lm_loss_sums_counted_tokens_and_skips_ignored_ones() -> None:
    logits = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    labels = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(3))
    labels[0, :2] = -100
    loss_sum, count = lm_loss(logits, labels)
    assert loss_sum.dtype == torch.float32 and count.item() == 8
    per_token = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, 256), labels.reshape(-1), reduction="none", ignore_index=-100
    )
    assert loss_sum.item() == pytest.approx(per_token.sum().item(), rel=1e-5)
    halves = [lm_loss(logits[i : i + 1], labels[i : i + 1]) for i in range(2)]
    assert sum(s for s, _ in halves).item() == pytest.approx(loss_sum.item(), rel=1e-5)
    assert sum(n for _, n in halves).item() == count.item()
    labels[0, :2] = 7
    assert lm_loss(logits, labels, ignore_index=7)[1].item() == (labels != 7).sum().item()


def test_tied_embeddings_share_storage_and_untied_do_not() -> None:
    tied = _model()
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert tied.lm_head.weight.data_ptr() == tied.tok_emb.weight.data_ptr()
    untied = _model(ModelConfig(n_layer=1, n_head=2, d_model=32, max_seq_len=16, tie_embeddings=False))
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()


@pytest.mark.parametrize(
    "cfg",
    [
        SMALL,
        ModelConfig(n_layer=3, n_head=4, d_model=32, d_ff=48, max_seq_len=8, tie_embeddings=False, bias=True),
        ModelConfig(n_layer=1, n_head=1, d_model=16, vocab_size=300, max_seq_len=4, bias=True),
    ],
    ids=["tied", "untied-bias", "bias"],
)
def test_num_params_matches_the_formula_of_flops_per_token(cfg: ModelConfig) -> None:
    seq_len = 8
    attention_flops = 12 * cfg.n_layer * cfg.d_model * seq_len
    assert flops_per_token(cfg, seq_len) == 6 * num_params(_model(cfg)) + attention_flops


def test_init_follows_gpt2() -> None:
    cfg = ModelConfig(n_layer=8, n_head=4, d_model=256, max_seq_len=16, bias=True)
    model = _model(cfg)
    assert model.blocks[0].attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual = torch.cat([b.mlp.down.weight.flatten() for b in model.blocks])
    assert residual.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert all(b.attn.o_proj.bias.abs().sum() == 0 for b in model.blocks)


def test_build_is_deterministic_under_a_fixed_seed() -> None:
    first, second, other = _model(seed=5), _model(seed=5), _model(seed=6)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(first.tok_emb.weight, other.tok_emb.weight)


def test_heads_follow_the_local_projection_width() -> None:
    """Column-sharding q/k/v to half their outputs (as tensor parallelism does) halves the heads."""
    attn = _model().blocks[0].attn
    half = attn.head_dim  # one of the two heads
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        proj.weight = torch.nn.Parameter(proj.weight[:half].clone())
    attn.o_proj.weight = torch.nn.Parameter(attn.o_proj.weight[:, :half].clone())
    assert attn(torch.randn(2, 5, 32)).shape == (2, 5, 32)


def test_a_few_adamw_steps_on_one_batch_lower_the_loss() -> None:
    model = _model()
    ids = _batch(4, 17)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss_sum, count = lm_loss(model(ids[:, :-1]), ids[:, 1:])
        (loss_sum / count).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append((loss_sum / count).item())
    assert losses[-1] < losses[0] - 1.0
