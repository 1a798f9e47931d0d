"""Pure bf16 (precision.param_dtype=bf16): the rounding keeps small updates, the AdamW is torch's, eval_cast
leaves the training weights alone, the rules refuse what does not compose, and the planner counts 2+2+4."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from launcher.components.bf16_adamw import StochasticRoundingAdamW, round_stochastic_
from launcher.components.precision import cast_weights
from launcher.front import compose
from launcher.front.cli import precheck
from launcher.plan.states import model_states
from launcher.spec import to_spec


def _errors(*argv: str) -> dict[tuple[str, ...], str]:
    return {e.keys: e.message for e in precheck(list(argv))}


def test_stochastic_rounding_keeps_an_update_below_bf16_resolution_in_expectation() -> None:
    """1 + 1e-4 is 1.0 in bf16 (its spacing there is 2^-7); rounded stochastically it averages 1 + 1e-4."""
    value = torch.full((200_000,), 1.0 + 1e-4)
    assert torch.equal(
        value.to(torch.bfloat16), torch.ones(200_000, dtype=torch.bfloat16)
    )  # nearest drops it
    out = torch.empty(200_000, dtype=torch.bfloat16)
    round_stochastic_(out, value.clone(), torch.Generator().manual_seed(0))
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2**-7}  # only the two neighbours
    assert out.double().mean().item() == pytest.approx(1.0 + 1e-4, abs=2e-5)
    signs = torch.tensor([-3.0, float("inf"), float("-inf")])
    round_stochastic_(out[:3], signs.clone(), torch.Generator().manual_seed(0))
    assert out[:3].float().tolist() == [-3.0, float("inf"), float("-inf")]


def _adamw(params: list[nn.Parameter], seed: int = 0) -> StochasticRoundingAdamW:
    return StochasticRoundingAdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, seed=seed)


def test_on_fp32_parameters_the_update_is_torchs_adamw() -> None:
    ours, theirs = (
        nn.Parameter(torch.randn(64, 32, generator=torch.Generator().manual_seed(1))) for _ in "ab"
    )
    opt_ours = _adamw([ours])
    opt_theirs = torch.optim.AdamW(
        [theirs], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False
    )
    for step in range(5):
        grad = torch.randn(64, 32, generator=torch.Generator().manual_seed(step))
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt_ours.step(), opt_theirs.step()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_bf16_weights_and_moments_follow_the_fp32_trajectory_where_nearest_rounding_stalls() -> None:
    """100 steps of lr 2e-4 on weights near 1 (bf16 spacing 2^-7): each step is 1/39 of the spacing."""
    start = torch.ones(4096)
    reference = nn.Parameter(start.clone())
    ours = nn.Parameter(start.to(torch.bfloat16))
    nearest = nn.Parameter(start.to(torch.bfloat16))
    optimizers = [
        torch.optim.AdamW([reference], lr=2e-4, weight_decay=0.0, foreach=False),
        StochasticRoundingAdamW([ours], lr=2e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, seed=0),
        torch.optim.AdamW([nearest], lr=2e-4, weight_decay=0.0, foreach=False),  # plain bf16 AdamW
    ]
    for _ in range(100):
        for param, optimizer in zip((reference, ours, nearest), optimizers, strict=True):
            param.grad = torch.ones_like(param)
            optimizer.step()
    moved = 1.0 - reference.detach().mean().item()  # about 100 x 2e-4
    assert moved == pytest.approx(0.02, rel=0.05)
    assert 1.0 - ours.detach().float().mean().item() == pytest.approx(moved, rel=0.03)
    assert torch.equal(nearest.detach(), start.to(torch.bfloat16))  # every step rounded away
    state = optimizers[1].state[ours]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16


def test_the_rounding_is_the_same_for_the_same_seed_step_and_parameter() -> None:
    """DDP replicas and a resumed run round alike: the bits depend on (seed, step, index), not the global RNG."""
    results = []
    for noise in (0, 1):
        torch.manual_seed(noise)  # a different global random state each time
        param = nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
        optimizer = _adamw([param], seed=7)
        for _ in range(3):
            param.grad = torch.full_like(param, 0.5)
            optimizer.step()
        results.append(param.detach().clone())
    assert torch.equal(*results)


def test_eval_cast_casts_a_copy_and_gives_back_the_very_training_weights() -> None:
    model = nn.Linear(8, 8)
    weight = model.weight
    before = weight.detach().clone()
    with cast_weights(model, torch.bfloat16, enabled=True):
        assert model.weight.dtype == torch.bfloat16 and model.weight is weight
        assert torch.equal(model.weight.float(), before.to(torch.bfloat16).float())
    assert model.weight.dtype == torch.float32 and torch.equal(model.weight.detach(), before)  # all 32 bits


def test_conflicts_are_refused_with_the_fix() -> None:
    assert (
        "precision=pure_bf16"
        in _errors("precision.param_dtype=bf16")[("precision.param_dtype", "precision.bf16")]
    )
    keys = ("precision.param_dtype", "optimizer.name", "optimizer.implementation")
    assert "optimizer=adamw" in _errors("precision=pure_bf16", "optimizer=adamw_8bit")[keys]
    assert keys in _errors("precision=pure_bf16", "optimizer.implementation=fused")
    strategy = _errors("precision=pure_bf16", "parallel=zero2")[
        ("precision.param_dtype", "parallel.strategy")
    ]
    assert "DeepSpeed" in strategy and "precision=bf16" in strategy
    quantized = ("precision.param_dtype", "quantization.method", "qat.scheme")
    assert "quantization=none" in _errors("precision=pure_bf16", "quantization=int8_lora")[quantized]
    assert "precision.fp16" in str(_errors("precision=fp16", "precision.param_dtype=bf16"))
    assert "precision.param_dtype" in str(_errors("precision.param_dtype=fp16"))  # the key's own domain
    nothing = _errors("precision.eval_cast=true")[("precision.eval_cast", "precision.eval_dtype")]
    assert "nothing to cast" in nothing and "precision.eval_dtype=bfloat16" in nothing
    sharded = _errors("precision.eval_cast=true", "precision.eval_dtype=bfloat16", "parallel=fsdp")
    assert "parallel=single or ddp" in sharded[("precision.eval_cast", "parallel.strategy")]
    assert _errors("precision=pure_bf16") == {}
    assert (
        _errors(
            "precision=pure_bf16", "parallel=ddp", "precision.eval_cast=true", "precision.eval_dtype=float32"
        )
        == {}
    )
    assert _errors("precision.eval_cast=true", "precision.eval_dtype=bfloat16") == {}


def _states(*argv: str, n: int = 1):
    return model_states(to_spec(compose.strip_hydra(compose.compose(list(argv)))), n)


def test_planner_counts_two_bytes_of_weights_and_gradients_and_four_of_adam_state() -> None:
    mixed, pure = (
        _states("model=gpt_125m", "precision=bf16"),
        _states("model=gpt_125m", "precision=pure_bf16"),
    )
    assert pure.parameters == mixed.parameters / 2 and pure.gradients == mixed.gradients / 2
    assert pure.optimizer_states == mixed.optimizer_states / 2
    assert pure.buffers == 0.0 < mixed.buffers  # no autocast copies of bf16 weights
    sharded = _states("model=gpt_125m", "precision=pure_bf16", "parallel=fsdp", n=2)
    assert sharded.optimizer_states == pure.optimizer_states / 2
