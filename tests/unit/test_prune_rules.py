"""Every prune setting the rules refuse before launch, with its message; and the schedule itself."""

from __future__ import annotations

import pytest

from launcher.components.prune import sparsity_at, updates_at
from launcher.config.prune import PruneConfig
from launcher.front.cli import precheck


def _errors(*argv: str) -> dict[tuple[str, ...], str]:
    return {e.keys: e.message for e in precheck(list(argv))}


def test_good_prune_options_compose() -> None:
    for option in ("none", "magnitude", "semi_2_4"):
        assert _errors(f"prune={option}") == {}, option
    assert _errors("prune=magnitude", "prune.scope=per_layer", "parallel=ddp", "launcher=local") == {}


@pytest.mark.parametrize("value", ["-0.1", "1.0", "1.5"])
def test_target_sparsity_outside_0_1_is_refused(value: str) -> None:
    message = _errors("prune=magnitude", f"prune.target_sparsity={value}")[("prune.target_sparsity",)]
    assert "must lie in [0, 1)" in message


def test_schedule_values_are_checked() -> None:
    errors = _errors("prune=magnitude", "prune.end_step=400", "prune.every=0")
    assert "prune.end_step=300 or less" in errors[("prune.end_step", "train.max_steps")]
    assert "must be 1 or more" in errors[("prune.every",)]
    order = _errors("prune=magnitude", "prune.start_step=50", "prune.end_step=50")
    assert "start before it ends" in order[("prune.start_step", "prune.end_step")]


def test_2_4_needs_sparsity_one_half_and_inputs_in_fours() -> None:
    errors = _errors("prune=semi_2_4", "prune.target_sparsity=0.6", "model.d_ff=510")
    assert "0.5 by construction" in errors[("prune.target_sparsity", "prune.method")]
    assert "mlp.down (510 in-features)" in errors[("prune.method", "model.d_model", "model.d_ff")]
    assert "prune=semi_2_4" in _errors("prune=magnitude", "prune.method=2_4")[("prune.method",)]


def test_quantized_bases_adapters_and_sharding_are_refused() -> None:
    nf4 = _errors("prune=magnitude", "quantization=nf4_lora")[("prune.method", "quantization.method")]
    assert "frozen integers" in nf4 and "quantization=none" in nf4
    assert (
        "not be sparse"
        in _errors("prune=magnitude", "quantization=lora")[("prune.method", "quantization.lora.rank")]
    )
    for option in ("fsdp", "zero2", "tp"):
        message = _errors("prune=magnitude", f"parallel={option}", "launcher=local")[
            ("prune.method", "parallel.strategy")
        ]
        assert "parallel=ddp" in message, option


def test_cubic_schedule_of_zhu_and_gupta() -> None:
    cfg = PruneConfig(method="magnitude", target_sparsity=0.8, start_step=10, end_step=50, every=10)
    assert [sparsity_at(cfg, t) for t in (0, 10, 19)] == [0.0, 0.0, 0.0]
    # s_t = s_f + (s_i - s_f)(1 - (t - t0)/(n dt))^3 with s_i = 0, t0 = 10, n dt = 40
    assert sparsity_at(cfg, 20) == pytest.approx(0.8 * (1 - 0.75**3))
    assert sparsity_at(cfg, 29) == sparsity_at(cfg, 20)  # held between updates
    assert sparsity_at(cfg, 50) == sparsity_at(cfg, 300) == 0.8
    assert [t for t in range(60) if updates_at(cfg, t)] == [20, 30, 40, 50]
    odd = PruneConfig(method="magnitude", start_step=0, end_step=25, every=10)
    assert [t for t in range(30) if updates_at(odd, t)] == [10, 20, 25]  # end_step always reaches the target


def test_the_plan_counts_one_byte_per_masked_weight() -> None:
    from launcher.front import compose
    from launcher.plan.planner import plan

    dense, errors = compose.validate(compose.compose([]))
    pruned, more = compose.validate(compose.compose(["prune=magnitude"]))
    assert errors == more == []
    masked = 4 * (4 * 128 * 128 + 2 * 128 * 512)  # gpt_tiny: 4 blocks of q, k, v, o, up, down
    assert plan(pruned).buffers - plan(dense).buffers == masked
    assert f"prune masks: {masked:,} weights x 1 B (uint8)" in plan(pruned).notes
