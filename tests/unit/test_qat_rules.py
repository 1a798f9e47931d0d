"""Every QAT setting the rules refuse before launch, with its message, and the planner's term for it."""

from __future__ import annotations

import pytest

from launcher.front import compose
from launcher.front.cli import precheck
from launcher.plan.planner import plan
from launcher.spec import RunSpec, to_spec


def compose_spec(overrides: list[str]) -> RunSpec:
    return to_spec(compose.strip_hydra(compose.compose(overrides)))


def _errors(*argv: str) -> dict[tuple[str, ...], str]:
    return {e.keys: e.message for e in precheck(list(argv))}


def test_good_qat_options_compose() -> None:
    assert _errors("qat=int8_dynact_int4_weight") == {}
    assert _errors("qat=int4_weight", "parallel=fsdp", "launcher=local") == {}


def test_unknown_scheme_names_the_choices() -> None:
    message = _errors("qat=int4_weight", "qat.scheme=int4_weights")[("qat.scheme",)]
    assert "Did you mean int4_weight?" in message and "int8_dynact_int4_weight" in message


def test_start_step_beyond_the_run_is_refused() -> None:
    message = _errors("qat=int4_weight", "qat.start_step=300")[("qat.start_step", "train.max_steps")]
    assert "[0, 300)" in message


@pytest.mark.parametrize("group_size", ["48", "0"])
def test_group_size_must_divide_the_in_features(group_size: str) -> None:
    errors = _errors("qat=int8_dynact_int4_weight", f"qat.group_size={group_size}")
    if group_size == "0":
        assert "must be positive" in errors[("qat.group_size",)]
    else:  # gpt_tiny: d_model 128, d_ff 512
        message = errors[("qat.group_size", "model.d_model")]
        assert "in-features 128, 512" in message and "e.g. 32" in message


def test_quantized_bases_adapters_and_other_strategies_are_refused() -> None:
    nf4 = _errors("qat=int4_weight", "quantization=nf4_lora")
    assert "quantization=none" in nf4[("qat.scheme", "quantization.method")]
    assert "LoRA" in nf4[("qat.scheme", "quantization.lora.rank")]
    assert "Float8Linear" in _errors("qat=int4_weight", "precision=fp8")[("qat.scheme", "precision.fp8")]
    for option in ("zero2", "tp"):
        message = _errors("qat=int4_weight", f"parallel={option}", "launcher=local")[
            ("qat.scheme", "parallel.strategy")
        ]
        assert "parallel=ddp" in message, option


def test_planner_counts_the_fake_quant_scales() -> None:
    plain = plan(compose_spec([]), 1, "cpu")
    qat = plan(compose_spec(["qat=int4_weight"]), 1, "cpu")
    # gpt_tiny: 4 layers x (4 x 128 x 128/32 + 512 x 128/32 + 128 x 512/32) groups x 8 B = 196,608 B
    assert qat.buffers - plain.buffers == 196_608
    assert any("QAT fake-quant scales: 24,576 groups of 32" in note for note in qat.notes)
