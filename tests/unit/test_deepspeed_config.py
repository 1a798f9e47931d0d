"""The DeepSpeed config generated from the spec, a user's JSON checked against it, and every
DeepSpeed rule's message (before launch), plus one short real run of a Hugging Face template."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from conftest import TINY, run_cli
from launcher.front import compose
from launcher.front.cli import precheck
from launcher.parallel import deepspeed_config as ds_config
from launcher.parallel import deepspeed_user_config as ds_user


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


def test_zero_1_and_2_overlap_reduction_with_buckets_sized_from_the_model() -> None:
    for stage in (1, 2):
        zero = ds_config.generate(_spec(f"parallel=zero{stage}", *TINY))["zero_optimization"]
        assert zero == {
            "stage": stage,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 64 * 64,  # d_model squared, as for ZeRO-3's "auto" sizes
            "allgather_bucket_size": 64 * 64,
        }
    assert ds_config.generate(_spec("parallel=zero0", *TINY))["zero_optimization"] == {"stage": 0}


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
    config, errors = ds_user.resolve(spec, ranks=2)
    assert errors == []
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["train_batch_size"] == 8
    assert config["gradient_accumulation_steps"] == 1 and config["gradient_clipping"] == 1.0
    assert config["bf16"]["enabled"] is False
    assert config["zero_optimization"] == {  # the file's overlap_comm wins over the ZeRO-2 default
        "stage": 2,
        "reduce_bucket_size": 64 * 64,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "allgather_bucket_size": 64 * 64,
    }
    assert "optimizer" not in config  # it only restated the optimizer group, which is used


def _keys(*argv: str) -> list[tuple[str, ...]]:
    return [e.keys for e in precheck(list(argv))]


# A file decides the keys nobody set (tests/unit/test_deepspeed_files.py); each case here sets its key.
CONTRADICTIONS = [
    ({"train_micro_batch_size_per_gpu": 8}, "train_micro_batch_size_per_gpu", "train.micro_batch_size", []),
    ({"bf16": {"enabled": True}}, "bf16.enabled", "precision.bf16", ["precision=fp32"]),
    ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage", "parallel.zero_stage", []),
    ({"gradient_clipping": 0.3}, "gradient_clipping", "train.max_grad_norm", ["train.max_grad_norm=1.0"]),
    (
        {"gradient_accumulation_steps": 4},
        "gradient_accumulation_steps",
        "train.grad_accum_steps",
        ["train.grad_accum_steps=1"],
    ),
    (
        {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}},
        "optimizer.params.lr",
        "optimizer.lr",
        ["optimizer.lr=0.001"],
    ),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type", "optimizer.name", []),
]


@pytest.mark.parametrize(
    ("content", "json_key", "spec_key", "typed"), CONTRADICTIONS, ids=[c[1] for c in CONTRADICTIONS]
)
def test_contradicting_json_value_names_both_keys(
    tmp_path, content: dict, json_key: str, spec_key: str, typed: list[str]
) -> None:
    path = _json(tmp_path, content)
    errors = precheck(["parallel=zero2", f"parallel.deepspeed_config={path}", *TINY, *typed])
    assert [e.keys for e in errors] == [(f"deepspeed_config:{json_key}", spec_key)], errors
    assert json_key in errors[0].message and spec_key in errors[0].message


def test_contradicting_json_exits_2_before_anything_starts(tmp_path) -> None:
    path = _json(tmp_path, {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}})
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "parallel=zero2",
            "precision=fp32",
            f"parallel.deepspeed_config={path}",
            f"run_dir={run_dir}",
            *TINY,
        ],
        tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    text = " ".join(proc.stderr.split())
    assert "deepspeed_config:train_micro_batch_size_per_gpu, train.micro_batch_size" in text
    assert "deepspeed_config:bf16.enabled, precision.bf16" in text
    assert not run_dir.exists()


def test_unfillable_autos_are_one_problem(tmp_path) -> None:
    path = _json(
        tmp_path,
        {"zero_optimization": {"sub_group_size": "auto", "stage3_max_live_parameters": "auto"}},
    )
    errors = precheck(["parallel=zero3", f"parallel.deepspeed_config={path}"])
    assert [e.keys for e in errors] == [
        (
            "deepspeed_config:zero_optimization.sub_group_size",
            "deepspeed_config:zero_optimization.stage3_max_live_parameters",
        )
    ]
    assert "sub_group_size, zero_optimization.stage3_max_live_parameters" in errors[0].message


ASSETS = Path(__file__).parents[1] / "assets" / "deepspeed"
FILES = [
    ("transformers_zero2.json", ["parallel=zero2", "parallel.offload_optimizer=true"]),
    ("transformers_zero3.json", ["parallel=zero3_offload"]),
    ("axolotl_zero2.json", ["parallel=zero2", "parallel.offload_optimizer=true"]),
]


@pytest.mark.parametrize(("name", "argv"), FILES, ids=[f[0] for f in FILES])
def test_real_json_files_are_accepted_and_filled(name: str, argv: list[str]) -> None:
    path = ASSETS / name
    spec = _spec(*argv, f"parallel.deepspeed_config={path}", *TINY)
    config, errors = ds_user.resolve(spec, ranks=2)
    assert errors == []
    # checked, then not handed over: the optimizer group's optimizer and the loop's schedule are used
    assert "optimizer" not in config and "scheduler" not in config
    assert config["train_batch_size"] == 8 and config["gradient_clipping"] == 1.0
    assert config["bf16"]["enabled"] is False and config.get("fp16", {}).get("enabled", False) is False
    assert '"auto"' not in json.dumps(config)
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_scheduler_and_optimizer_sections_agreeing_with_the_spec_are_accepted(tmp_path) -> None:
    content = {
        "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "betas": [0.9, 0.95], "weight_decay": "auto"}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 0,
                "warmup_max_lr": 0.002,
                "warmup_num_steps": 2,
                "total_num_steps": 20,
            },
        },
    }
    path = _json(tmp_path, content)
    argv = ["parallel=zero2", f"parallel.deepspeed_config={path}", *TINY, "optimizer.lr=0.002"]
    assert precheck([*argv, "scheduler=linear", "scheduler.min_lr_ratio=0"]) == []
    # An all-"auto" scheduler section is a template: the spec's schedule (cosine here) runs.
    auto = _json(tmp_path, {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}})
    assert precheck(["parallel=zero2", f"parallel.deepspeed_config={auto}", *TINY]) == []


SCHEDULER_CONTRADICTIONS = [
    ({"warmup_max_lr": 0.5}, [], ("deepspeed_config:scheduler.params.warmup_max_lr", "optimizer.lr")),
    ({"total_num_steps": 999}, [], ("deepspeed_config:scheduler.params.total_num_steps", "train.max_steps")),
    (
        {"warmup_num_steps": 7},
        [],
        ("deepspeed_config:scheduler.params.warmup_num_steps", "scheduler.warmup_steps"),
    ),
    (  # the right numbers, but the spec decays by cosine to 10 %, not linearly to 0
        {"warmup_num_steps": 2},
        ["scheduler=cosine"],
        ("deepspeed_config:scheduler.type", "scheduler.name", "scheduler.min_lr_ratio"),
    ),
]


@pytest.mark.parametrize(
    ("params", "argv", "keys"), SCHEDULER_CONTRADICTIONS, ids=[c[2][0] for c in SCHEDULER_CONTRADICTIONS]
)
def test_scheduler_contradictions_are_refused(tmp_path, params: dict, argv: list[str], keys: tuple) -> None:
    path = _json(tmp_path, {"scheduler": {"type": "WarmupDecayLR", "params": params}})
    spec_argv = ["scheduler=linear", "scheduler.min_lr_ratio=0", *argv]
    errors = precheck(["parallel=zero2", f"parallel.deepspeed_config={path}", *TINY, *spec_argv])
    assert [e.keys for e in errors] == [keys], errors


def test_scheduler_without_counterpart_is_refused(tmp_path) -> None:
    path = _json(tmp_path, {"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": "auto"}}})
    errors = precheck(["parallel=zero2", f"parallel.deepspeed_config={path}"])
    assert [e.keys for e in errors] == [("deepspeed_config:scheduler.type", "scheduler.name")]
    assert "remove the `scheduler` section" in errors[0].message


def test_legacy_cpu_offload_is_checked_as_offload_optimizer() -> None:
    path = ASSETS / "legacy_cpu_offload.json"
    typed_off = ["parallel=zero2", "parallel.offload_optimizer=false", f"parallel.deepspeed_config={path}"]
    errors = precheck([*typed_off, *TINY])
    assert [e.keys for e in errors] == [
        ("deepspeed_config:zero_optimization.cpu_offload", "parallel.offload_optimizer")
    ]
    assert "legacy form of zero_optimization.offload_optimizer" in errors[0].message
    spec = _spec(
        "parallel=zero2", f"parallel.deepspeed_config={path}", *TINY
    )  # nobody set it: the file decides
    assert spec.parallel.offload_optimizer is True
    config, errors = ds_user.resolve(spec, ranks=2)
    assert errors == []
    assert "cpu_offload" not in config["zero_optimization"]  # mapped: the modern section stands
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_legacy_boolean_zero_optimization_is_stage_1(tmp_path) -> None:
    path = _json(tmp_path, {"zero_optimization": True})
    errors = precheck(["parallel=zero2", f"parallel.deepspeed_config={path}"])
    assert [e.keys for e in errors] == [("deepspeed_config:zero_optimization.stage", "parallel.zero_stage")]
    assert precheck(["parallel=zero1", f"parallel.deepspeed_config={path}"]) == []


def test_fp16_master_weights_need_zero_offload_with_cpu_adam() -> None:
    path = ASSETS / "fp16_master_weights.json"
    errors = precheck(["parallel=zero2", f"parallel.deepspeed_config={path}", *TINY])
    assert [e.keys for e in errors] == [
        (
            "deepspeed_config:fp16.fp16_master_weights_and_grads",
            "precision.fp16",
            "parallel.offload_optimizer",
        )
    ]
    assert "DeepSpeedCPUAdam" in errors[0].message and "AssertionError" in errors[0].message


def test_auto_bucket_sizes_follow_a_folder_models_real_width(tmp_path) -> None:
    from hf_assets import make_hf_model

    folder = make_hf_model("llama", tmp_path / "llama")  # hidden_size 64; the preset's d_model is 128
    path = ASSETS / "transformers_zero3.json"
    spec = _spec(
        "model=hf", f"model.hf_config={folder}", "parallel=zero3_offload", f"parallel.deepspeed_config={path}",
        "data.seq_len=32", "train.micro_batch_size=4", "train.max_steps=20", "scheduler.warmup_steps=2",
    )  # fmt: skip
    # the preset's width left in the spec (as before the fill) must not be what sizes the buckets
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, d_model=128))
    zero = ds_user.resolve(spec, ranks=1)[0]["zero_optimization"]
    assert zero["reduce_bucket_size"] == 64 * 64
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert zero["stage3_param_persistence_threshold"] == 640


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


def test_transformers_template_trains_a_folder_model_on_the_specs_schedule(tmp_path) -> None:
    """One real run (about 15 s): transformers' ZeRO-2 template, a Llama folder, 4 steps, inline.

    The template's offload device is set to "auto" (filled: none), so no DeepSpeedCPUAdam is built. Its
    explicit gradient_accumulation_steps and gradient_clipping decide those keys, which nobody set
    (launcher.front.deepspeed_file): spec.yaml, the rank's merged config and DeepSpeed agree on them.
    (A second in-process DeepSpeed run in one pytest process would find DeepSpeed's cached group.)
    """
    from hf_assets import make_hf_model

    from launcher.components.metrics import read_metrics
    from launcher.front import rundir
    from launcher.rank import worker

    folder = make_hf_model("llama", tmp_path / "llama")
    template = json.loads((ASSETS / "transformers_zero2.json").read_text())
    template["zero_optimization"]["offload_optimizer"]["device"] = "auto"
    template.update(gradient_accumulation_steps=2, gradient_clipping=0.5)
    run_dir = tmp_path / "run"
    cfg = compose.compose(
        [
            "model=hf", f"model.hf_config={folder}", "parallel=zero2",
            f"parallel.deepspeed_config={_json(tmp_path, template)}", "data.seq_len=32",
            "data.max_bytes=200000", "train.micro_batch_size=4", "train.max_steps=4", "train.log_every=1",
            "scheduler.warmup_steps=2", "checkpoint.every=null", "train.eval_every=null", "log.progress=false",
            "log.summary_table=false", f"run_dir={run_dir}",
        ]
    )  # fmt: skip
    built = compose.build(cfg)
    assert built.errors == ()
    spec = built.spec
    assert (spec.train.grad_accum_steps, spec.train.max_grad_norm) == (2, 0.5)  # taken from the file
    rundir.write(built, run_dir)
    assert worker.run(run_dir / "spec.yaml") == 0
    config = json.loads((run_dir / "deepspeed_config.json").read_text())
    assert "scheduler" not in config and "optimizer" not in config
    assert config["zero_optimization"]["reduce_bucket_size"] == 64 * 64  # the folder's width, not 128
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "none"
    assert (config["gradient_accumulation_steps"], config["gradient_clipping"]) == (2, 0.5)
    assert config["train_batch_size"] == 4 * 2
    lrs = [r["lr"] for r in read_metrics(run_dir / "metrics.jsonl")]
    # The spec's cosine schedule ends at min_lr_ratio x lr; the template's WarmupLR would hold 1e-3.
    assert lrs[-1] == pytest.approx(spec.optimizer.lr * spec.scheduler.min_lr_ratio)
