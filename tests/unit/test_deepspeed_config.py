"""The DeepSpeed config generated from the spec, a user's JSON checked against it, and every
DeepSpeed rule's message (all before launch: nothing here starts a rank)."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import TINY, run_cli
from launcher.front import compose
from launcher.front.cli import precheck
from launcher.parallel import deepspeed_config as ds_config


def _spec(*argv: str):
    spec, errors = compose.validate(compose.compose(list(argv)))
    assert errors == [], errors
    return spec


def _json(tmp_path, content: object) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    return str(path)


def test_generated_config_follows_the_spec() -> None:
    spec = _spec(
        "parallel=zero3",
        "precision=bf16",
        "train.micro_batch_size=4",
        "train.grad_accum_steps=2",
        "train.max_grad_norm=0.5",
    )
    config = ds_config.generate(spec, ranks=2)
    assert config["train_micro_batch_size_per_gpu"] == 4
    assert config["gradient_accumulation_steps"] == 2
    assert config["train_batch_size"] == 16
    assert config["gradient_clipping"] == 0.5
    assert config["zero_optimization"] == {"stage": 3}
    assert config["bf16"] == {"enabled": True} and "fp16" not in config
    assert config["zero_force_ds_cpu_optimizer"] is False  # the client torch optimizer, nothing compiled
    assert "optimizer" not in config and "scheduler" not in config


def test_offload_and_fp16_sections() -> None:
    spec = _spec("parallel=zero3_offload", "train.max_grad_norm=null")
    config = ds_config.generate(spec)
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert config["gradient_clipping"] == 0.0
    fp16 = ds_config.generate(_spec("precision=fp16", "precision.loss_scale_init=1024"))["fp16"]
    assert fp16["initial_scale_power"] == 10 and fp16["loss_scale"] == 0 and fp16["hysteresis"] == 1


def test_auto_values_are_filled_from_the_spec(tmp_path) -> None:
    path = _json(
        tmp_path,
        {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
            "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto", "overlap_comm": False},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.95]}},
        },
    )
    spec = _spec("parallel=zero2", f"parallel.deepspeed_config={path}", *TINY)
    config, errors = ds_config.resolve(spec, ranks=2)
    assert errors == []
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["train_batch_size"] == 8
    assert config["gradient_accumulation_steps"] == 1 and config["gradient_clipping"] == 1.0
    assert config["bf16"]["enabled"] is False
    assert config["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 64 * 64, "overlap_comm": False}
    assert "optimizer" not in config  # it only restated the optimizer group, which is used


def _keys(*argv: str) -> list[tuple[str, ...]]:
    return [e.keys for e in precheck(list(argv))]


CONTRADICTIONS = [
    ({"train_micro_batch_size_per_gpu": 8}, "train_micro_batch_size_per_gpu", "train.micro_batch_size"),
    ({"bf16": {"enabled": True}}, "bf16.enabled", "precision.bf16"),
    ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage", "parallel.zero_stage"),
    ({"gradient_clipping": 0.3}, "gradient_clipping", "train.max_grad_norm"),
    ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps", "train.grad_accum_steps"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, "optimizer.params.lr", "optimizer.lr"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type", "optimizer.name"),
]


@pytest.mark.parametrize(
    ("content", "json_key", "spec_key"), CONTRADICTIONS, ids=[c[1] for c in CONTRADICTIONS]
)
def test_contradicting_json_value_names_both_keys(
    tmp_path, content: dict, json_key: str, spec_key: str
) -> None:
    path = _json(tmp_path, content)
    errors = precheck(["parallel=zero2", f"parallel.deepspeed_config={path}", *TINY])
    assert [e.keys for e in errors] == [(f"deepspeed_config:{json_key}", spec_key)], errors
    assert json_key in errors[0].message and spec_key in errors[0].message


def test_contradicting_json_exits_2_before_anything_starts(tmp_path) -> None:
    path = _json(tmp_path, {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}})
    run_dir = tmp_path / "run"
    proc = run_cli(
        ["parallel=zero2", f"parallel.deepspeed_config={path}", f"run_dir={run_dir}", *TINY], tmp_path
    )
    assert proc.returncode == 2, proc.stderr
    text = " ".join(proc.stderr.split())
    assert "deepspeed_config:train_micro_batch_size_per_gpu, train.micro_batch_size" in text
    assert "deepspeed_config:bf16.enabled, precision.bf16" in text
    assert not run_dir.exists()


def test_unfillable_auto_and_refused_sections(tmp_path) -> None:
    path = _json(
        tmp_path, {"scheduler": {"type": "WarmupLR"}, "zero_optimization": {"sub_group_size": "auto"}}
    )
    assert sorted(_keys("parallel=zero2", f"parallel.deepspeed_config={path}")) == [
        ("deepspeed_config:scheduler",),
        ("deepspeed_config:zero_optimization.sub_group_size",),
    ]


RULES = [
    (["parallel=zero2", "precision=fp16"], ("precision.fp16", "parallel.strategy"), "`precision=bf16`"),
    (
        ["parallel=zero2", "parallel.offload_params=true"],
        ("parallel.offload_params", "parallel.zero_stage"),
        "stage 3",
    ),
    (
        ["parallel=zero0", "parallel.offload_optimizer=true"],
        ("parallel.offload_optimizer", "parallel.zero_stage"),
        "stage 1",
    ),
    (["parallel=zero2", "parallel.zero_stage=5"], ("parallel.zero_stage",), "0, 1, 2 and 3"),
    (["parallel.zero_stage=2"], ("parallel.strategy", "parallel.zero_stage"), "exclusive"),
    (
        ["parallel=ddp", "parallel.offload_optimizer=true"],
        ("parallel.strategy", "parallel.offload_optimizer"),
        "zero3",
    ),
    (
        ["parallel=zero3", "parallel.cpu_offload=true"],
        ("parallel.strategy", "parallel.cpu_offload"),
        "exclusive",
    ),
    (
        ["parallel=zero1", "parallel.comm_hook=bf16"],
        ("parallel.strategy", "parallel.comm_hook"),
        "parallel=ddp",
    ),
    (
        ["parallel=zero2", "parallel.deepspeed_config=/nonexistent/ds.json"],
        ("parallel.deepspeed_config",),
        "no DeepSpeed JSON",
    ),
]


@pytest.mark.parametrize(("argv", "keys", "phrase"), RULES, ids=[" ".join(r[0]) for r in RULES])
def test_rule_message(argv: list[str], keys: tuple[str, ...], phrase: str) -> None:
    errors = precheck(argv)
    assert [e.keys for e in errors] == [keys], errors
    assert phrase in errors[0].message


def test_fp16_loss_scale_must_be_a_power_of_two_for_deepspeed() -> None:
    errors = precheck(["parallel=zero2", "precision=fp16", "precision.loss_scale_init=1000"])
    assert ("precision.loss_scale_init",) in [e.keys for e in errors]


def test_nf4_with_zero3_is_refused() -> None:
    errors = precheck(["parallel=zero3", "quantization=nf4"])
    assert any("quantization.method" in e.keys and "parallel.zero_stage" in e.keys for e in errors), errors


def test_missing_deepspeed_package_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # Python's own way to make `import deepspeed` fail
    errors = precheck(["parallel=zero2"])
    assert [e.keys for e in errors] == [("parallel.strategy",)]
    assert "pip install deepspeed" in errors[0].message
