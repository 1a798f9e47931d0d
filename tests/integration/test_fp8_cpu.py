"""precision=fp8's model side on torch's CPU float8 kernels: which layers convert, and that the converted
model trains like bf16. The CPU path is refused for runs (no speed to gain there: rules/precision.py), but
torchao's Float8Linear and torch._scaled_mm run on a CPU, so the conversion the GPU runs use is checked here
on real torchao; tests/gpu/test_fp8_cuda.py runs the whole loop on a GPU that has fp8."""

from __future__ import annotations

import copy

import pytest
import torch

from launcher.components.model.build import build_model
from launcher.components.model.loss import lm_loss
from launcher.components.precision import apply_fp8
from launcher.config.model import ModelConfig
from launcher.config.precision import PrecisionConfig

STEPS = 5
TINY_GPT = ModelConfig(n_layer=2, d_model=64, n_head=2, vocab_size=256, max_seq_len=64)


def test_fp8_converts_the_block_linears() -> None:
    from torchao.float8.float8_linear import Float8Linear

    model = apply_fp8(build_model(TINY_GPT), PrecisionConfig(bf16=True, fp8=True))
    converted = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert len(converted) == 2 * 6  # q, k, v, o, up, down of 2 blocks
    assert not any("head" in name or "emb" in name for name in converted)  # logits and embeddings stay bf16


def _train(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> list[float]:
    """Per-step losses of AdamW steps on one batch under bf16 autocast, as the engine runs precision=fp8."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    out = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_sum, count = lm_loss(model(ids[:, :-1]), ids[:, 1:])
        (loss_sum / count).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(float(loss_sum.detach() / count))
    return out


@pytest.fixture(scope="module")
def bf16_run() -> tuple[torch.nn.Module, torch.Tensor, list[float]]:
    """The initial model, its batch, and its per-step losses in plain bf16 autocast."""
    torch.manual_seed(0)
    base = build_model(TINY_GPT)
    ids = torch.randint(0, 256, (4, 33))
    return base, ids, _train(copy.deepcopy(base), ids, STEPS)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_layers_train_like_bf16(bf16_run, recipe: str) -> None:
    base, ids, want = bf16_run
    fp8 = apply_fp8(copy.deepcopy(base), PrecisionConfig(bf16=True, fp8=True, fp8_recipe=recipe))
    got = _train(fp8, ids, STEPS)
    assert got[-1] < got[0] - 0.2  # it learns the batch
    # e4m3 keeps 3 mantissa bits against bf16's 7: measured within 0.1% of bf16 per step over 24 steps
    assert got == pytest.approx(want, rel=0.02)
