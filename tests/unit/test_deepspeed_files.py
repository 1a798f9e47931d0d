"""DeepSpeed JSONs and accelerate YAMLs as users have them: the file's explicit values decide the spec
keys nobody set, a key someone set and the file contradict is refused naming both, AutoTP is refused,
an accelerate config is read for its DeepSpeed settings, and the dry run credits the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY
from launcher.front import cli, command_line, compose, deepspeed_file, provenance
from launcher.front.cli import precheck
from launcher.parallel import deepspeed_user_config as ds_user

ASSETS = Path(__file__).parents[1] / "assets" / "deepspeed"
ZERO2, ZERO3 = ASSETS / "transformers_zero2.json", ASSETS / "transformers_zero3.json"


def _validated(*argv: str):
    spec, errors = compose.validate(compose.compose(list(argv)))
    assert errors == [], errors
    return spec


def _keys(*argv: str) -> list[tuple[str, ...]]:
    return [e.keys for e in precheck(list(argv))]


@pytest.mark.parametrize("strategy", [[], ["parallel=zero2"]], ids=["file-alone", "parallel=zero2"])
def test_zero2_template_offloads_as_it_says(strategy: list[str], capsys) -> None:
    spec = _validated(*strategy, f"parallel.deepspeed_config={ZERO2}", *TINY)
    p = spec.parallel
    assert (p.strategy, p.zero_stage, p.offload_optimizer, p.offload_params) == ("deepspeed", 2, True, False)
    assert "parallel.offload_optimizer=true (transformers_zero2.json" in capsys.readouterr().err
    config, errors = ds_user.resolve(spec, ranks=2)
    assert errors == [] and config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_zero3_template_alone_selects_zero3_with_both_offloads() -> None:
    spec = _validated(f"parallel.deepspeed_config={ZERO3}", *TINY)
    p = spec.parallel
    assert (p.strategy, p.zero_stage, p.offload_optimizer, p.offload_params) == ("deepspeed", 3, True, True)
    assert ds_user.resolve(spec, ranks=2)[1] == []


@pytest.mark.parametrize(
    ("argv", "keys"),
    [
        (["parallel.offload_optimizer=false"], ("zero_optimization.offload_optimizer.device", "parallel.offload_optimizer")),
        (["parallel=zero3"], ("zero_optimization.stage", "parallel.zero_stage")),
    ],
    ids=["typed-key", "chosen-option"],
)  # fmt: skip
def test_a_value_someone_set_is_not_overridden(argv: list[str], keys: tuple[str, str]) -> None:
    json_key, spec_key = keys
    assert _keys(*argv, f"parallel.deepspeed_config={ZERO2}", *TINY) == [
        (f"deepspeed_config:{json_key}", spec_key)
    ]


def test_explicit_keys_are_typed_chosen_or_from_a_recipe() -> None:
    cfg = compose.compose(["parallel=zero3_offload", "train.max_steps=5"])
    explicit = provenance.explicit(cfg)
    assert explicit["parallel.offload_params"] == "parallel=zero3_offload"
    assert explicit["train.max_steps"] == "command line"
    assert "precision.bf16" not in explicit  # precision=fp32 is train.yaml's pick, nobody's choice
    assert "optimizer.lr" not in explicit


def test_dry_run_credits_the_file(tmp_path, capsys) -> None:
    argv = [f"parallel.deepspeed_config={ZERO2}", *TINY, "dry_run=true", f"run_dir={tmp_path / 'run'}"]
    assert cli.run(command_line.normalize(argv)) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "parallel.offload_optimizer True transformers_zero2.json: zero_optimization.offload_optimizer.device"
        in out
    )
    assert "parallel.strategy 'deepspeed' deepspeed_config transformers_zero2.json" in out


def test_autotp_section_is_refused_before_launch(tmp_path) -> None:
    path = tmp_path / "tp.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}}))
    errors = precheck([f"parallel.deepspeed_config={path}", *TINY])
    assert [e.keys for e in errors] == [("deepspeed_config:tensor_parallel", "parallel.strategy")]
    assert "parallel=tp" in errors[0].message and "autotp" in errors[0].message.lower()
    run_dir = tmp_path / "run"
    argv = command_line.normalize([f"parallel.deepspeed_config={path}", *TINY, f"run_dir={run_dir}"])
    assert cli.run(argv) == 2 and not run_dir.exists()


ACCELERATE = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 2
  gradient_clipping: 0.5
  offload_optimizer_device: cpu
  offload_param_device: cpu
  zero3_init_flag: true
  zero_stage: 3
distributed_type: DEEPSPEED
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""


def test_accelerate_yaml_is_read_as_accelerate_maps_it(tmp_path, capsys) -> None:
    path = tmp_path / "accelerate.yaml"
    path.write_text(ACCELERATE)
    spec = _validated(f"parallel.deepspeed_config={path}", *TINY)
    p, t = spec.parallel, spec.train
    assert (p.strategy, p.zero_stage, p.offload_optimizer, p.offload_params) == ("deepspeed", 3, True, True)
    assert (t.grad_accum_steps, t.max_grad_norm, spec.precision.bf16) == (2, 0.5, True)
    assert spec.launcher.nproc == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "zero_stage=3" in err and "num_processes=2" in err
    assert "not used here:" in err and "deepspeed_config.zero3_init_flag" in err
    config, errors = ds_user.resolve(spec)
    assert errors == [] and config["gradient_clipping"] == 0.5 and config["bf16"]["enabled"] is True


def test_accelerate_yaml_naming_a_json_and_a_contradicting_nproc(tmp_path) -> None:
    path = tmp_path / "accelerate.yml"
    path.write_text(
        f"distributed_type: DEEPSPEED\nnum_processes: 4\ndeepspeed_config:\n  deepspeed_config_file: {ZERO2}\n"
    )
    spec = _validated(f"parallel.deepspeed_config={path}", *TINY)
    assert (spec.parallel.zero_stage, spec.parallel.offload_optimizer, spec.launcher.nproc) == (2, True, 4)
    keys = _keys(f"parallel.deepspeed_config={path}", "launcher.nproc=2", *TINY)
    assert keys == [("deepspeed_config:num_processes", "launcher.nproc")]


def test_accelerate_yaml_without_deepspeed_is_refused(tmp_path) -> None:
    path = tmp_path / "fsdp.yaml"
    path.write_text("distributed_type: FSDP\nnum_processes: 2\n")
    errors = precheck([f"parallel.deepspeed_config={path}", *TINY])
    assert [e.keys for e in errors] == [("parallel.deepspeed_config",)]
    assert "parallel=fsdp" in errors[0].message


def test_taken_is_what_the_dry_run_credits() -> None:
    cfg = compose.compose(["parallel=zero2", f"parallel.deepspeed_config={ZERO2}", *TINY])
    taken = {t.spec_key: t.credit for t in deepspeed_file.taken(cfg)}
    assert taken == {
        "parallel.offload_optimizer": "transformers_zero2.json: zero_optimization.offload_optimizer.device"
    }


def test_explicit_train_batch_size_gives_the_accumulation_steps(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}}
        )
    )
    spec = _validated(f"parallel.deepspeed_config={path}", *TINY, "launcher.nproc=2")
    assert (spec.parallel.zero_stage, spec.train.grad_accum_steps) == (1, 4)  # 32 = 4 x 4 x 2 ranks
    keys = _keys(f"parallel.deepspeed_config={path}", *TINY, "launcher.nproc=2", "train.grad_accum_steps=1")
    assert keys == [
        (
            "deepspeed_config:train_batch_size",
            "train.micro_batch_size x train.grad_accum_steps x launcher.nproc x launcher.nnodes",
        )
    ]
