"""AdamW's kernel choice: `auto` takes torch's fused kernel on the CPU too, and it trains like foreach."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from launcher.components.model.build import build_model
from launcher.components.model.loss import lm_loss
from launcher.components.optimizer import build_optimizer
from launcher.config.model import ModelConfig
from launcher.config.optimizer import OptimizerConfig

MODEL = ModelConfig(n_layer=2, n_head=2, d_model=32, vocab_size=64, max_seq_len=16)


def _losses(implementation: str, dtype: torch.dtype, num_steps: int = 5) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = build_model(MODEL).to(dtype)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-2, implementation=implementation), "cpu")
    batch = torch.randint(0, MODEL.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(num_steps):  # one batch, fitted: the loss must fall
        loss_sum, count = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        (loss_sum / count).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append((loss_sum / count).item())
    return losses, opt.defaults


def test_auto_picks_the_fused_adamw_kernel_on_the_cpu() -> None:
    opt = build_optimizer(build_model(MODEL), OptimizerConfig(), "cpu")
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
    sgd = build_optimizer(build_model(MODEL), OptimizerConfig(name="sgd"), "cpu")
    assert not sgd.defaults["fused"]  # torch's fused CPU SGD is not the default: foreach stays


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_adamw_trains_like_foreach(dtype: torch.dtype) -> None:
    fused, flags = _losses("auto", dtype)
    foreach, _ = _losses("foreach", dtype)
    assert flags["fused"] is True
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # bf16 weights round each update to 8 bits
    assert fused[0] == foreach[0]  # the first loss is before any update: same model, same data
    assert fused[-1] < fused[0]  # it trains
    assert max(abs(a - b) for a, b in zip(fused, foreach, strict=True)) <= tolerance, (fused, foreach)


def test_a_fused_kernel_is_refused_nowhere_it_runs() -> None:
    """Explicit `fused` builds on the CPU with every dtype torch's kernel takes."""
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        model = build_model(dataclasses.replace(MODEL, n_layer=1)).to(dtype)
        opt = build_optimizer(model, OptimizerConfig(implementation="fused"), "cpu")
        model(torch.zeros(1, 4, dtype=torch.long)).float().sum().backward()
        opt.step()
        assert all(p.dtype == dtype and torch.isfinite(p).all() for p in model.parameters())
