"""Habits from other tools (HF Trainer, torchtune, axolotl, torchrun, sbatch) get our name for the key, and the
multi-rank advice names only options that exist (docs/migrating.md)."""

from __future__ import annotations

import re

import pytest

from conftest import run_cli
from launcher.config.aliases import ALIASES
from launcher.config.launcher import torchrun_world
from launcher.front import command_line, compose, torchrun
from launcher.front.cli import precheck
from launcher.spec import public_keys


def _messages(*argv: str) -> list[str]:
    return [str(e) for e in compose.check_overrides(list(argv))]


@pytest.mark.parametrize(
    ("override", "ours"),
    [
        ("per_device_train_batch_size=8", "train.micro_batch_size"),
        ("gradient_accumulation_steps=4", "train.grad_accum_steps"),
        ("learning_rate=2e-5", "optimizer.lr"),
        ("warmup_ratio=0.03", "use scheduler.warmup_ratio"),
        ("num_train_epochs=3", "set train.max_steps to epochs x examples / global batch"),
        ("bf16=true", "precision=bf16"),
        ("fp16=true", "precision=bf16 (or fp16"),
        ("max_steps=1000", "Did you mean train.max_steps?"),
        ("weight_decay=0.1", "Did you mean optimizer.weight_decay?"),
        ("lr_scheduler_type=cosine", "scheduler=cosine"),
        ("logging_steps=10", "train.log_every"),
        ("save_steps=500", "checkpoint.every"),
        ("eval_steps=200", "train.eval_every"),
        ("seed=42", "Did you mean train.seed?"),
        ("output_dir=out", "run_dir=runs/exp1"),
        ("gradient_checkpointing=true", "memory=checkpoint_all"),
        ("max_grad_norm=1.0", "Did you mean train.max_grad_norm?"),
        ("batch_size=4", "train.micro_batch_size"),  # torchtune
        ("epochs=1", "train.max_steps"),  # torchtune
        ("enable_activation_checkpointing=true", "memory=checkpoint_all"),  # torchtune
        ("sequence_len=2048", "data.seq_len"),  # axolotl
        ("lora_r=16", "quantization.lora.rank"),  # axolotl
        ("load_in_4bit=true", "quantization=nf4_lora"),  # axolotl
        ("nproc_per_node=2", "launcher=local launcher.nproc=2"),  # torchrun
        ("launcher.slurm.ntasks_per_node=4", "launcher.nproc"),  # sbatch
        ("launcher.slurm.nodes=2", "launcher.nnodes"),
        ("launcher.slurm.gres=gpu:4", "launcher.slurm.gpus_per_node=4"),
        ("launcher.slurm.time=2:00:00", "launcher.slurm.time_min"),
        ("launcher.slurm.mem=64", "launcher.slurm.mem_gb"),
        ("partition=gpu", "Did you mean launcher.slurm.partition?"),
        ("fp16_full_eval=true", "precision.eval_dtype"),
        ("train.bf16_full_eval=true", "precision.eval_dtype=bfloat16"),
        ("torch_empty_cache_steps=10", "memory.empty_cache_steps"),
        ("train.auto_find_batch_size=true", "memory=auto_batch"),
        ("group_by_length=true", "data.batching=group_by_length"),
        ("torch_compile_backend=inductor", "compile=default"),
        ("compile.torch_compile_mode=max-autotune", "compile.mode"),
        ("torch_compile_fullgraph=true", "compile.fullgraph=true"),
        ("model.use_flash_attention_2=true", "model.attention=auto"),
        ("ddp_find_unused_parameters=true", "parallel.find_unused_parameters=true"),
        ("fsdp_config=x", "parallel.reshard_after_forward=false"),
        ("launcher.cpus_per_task=8", "Did you mean launcher.slurm.cpus_per_task?"),
    ],
)
def test_another_tools_key_names_ours(override: str, ours: str) -> None:
    key = override.partition("=")[0]
    messages = _messages(override)
    assert any(m.startswith(f"{key}: unknown key.") and ours in m for m in messages), messages


def test_every_alias_hint_names_real_keys_and_options() -> None:
    keys = set(public_keys())
    sections = {key.split(".")[0] for key in keys}
    options = compose.group_options()
    for alias, hint in ALIASES.items():
        named = re.findall(r"\b[a-z_]+(?:\.[a-z_0-9]+)+\b", hint)
        for word in named:
            assert word.split(".")[0] not in sections or word in keys, (alias, word)
        picked = [(g, o) for g, o in re.findall(r"\b([a-z]+)=([a-z_0-9]+)\b", hint) if g in options]
        for group, option in picked:
            assert option in options[group], (alias, group, option)
        top = [word for word in re.findall(r"\b[a-z_]+\b", hint) if word in keys]  # run_dir, name, resume
        assert [w for w in named if w in keys] or picked or top, f"{alias}: its hint names no key of ours"


def test_hf_trainer_habits_on_the_real_cli_exit_2_before_anything_starts(tmp_path) -> None:
    result = run_cli(["per_device_train_batch_size=8", "learning_rate=2e-5", "+warmup_ratio=0.03"], tmp_path)
    err = " ".join(result.stderr.split())
    assert result.returncode == 2, err
    assert "per_device_train_batch_size: unknown key." in err and "use train.micro_batch_size" in err
    assert "learning_rate: unknown key." in err and "use optimizer.lr" in err
    assert list(tmp_path.iterdir()) == []


def test_multi_rank_advice_names_only_real_parallel_options() -> None:
    messages = [str(e) for e in precheck(["launcher=local", "launcher.nproc=2"])]
    advice = next(m for m in messages if "Pick a multi-rank option" in m)
    named = re.search(r"Pick a multi-rank option: (.*?);", advice).group(1)
    parallel = set(compose.group_options()["parallel"])
    assert "parallel=deepspeed" not in advice
    for word in re.findall(r"\b(ddp|fsdp|tp|zero[0-3])\b", named):
        assert word in parallel, word


def test_local_cuda_without_gpus_never_advises_nproc_0() -> None:
    # This machine has no GPU: the advice is the device, not a rank count of zero.
    messages = [str(e) for e in precheck(["launcher=local", "parallel=ddp", "launcher.device=cuda"])]
    assert any("no CUDA GPU is visible" in m for m in messages), messages
    assert any("run on a machine with a GPU" in m for m in messages), messages
    assert not any("nproc=0" in m for m in messages), messages


def test_torchrun_world_is_read_from_its_environment() -> None:
    env = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4", "RANK": "3"}
    assert torchrun_world(env) == (2, 2)
    assert torchrun_world({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2"}) == (2, 1)
    assert (
        torchrun_world({"WORLD_SIZE": "1"}) is None
    )  # a plain process (the inline backend sets these itself)


TORCHRUN = {"TORCHELASTIC_RUN_ID": "job1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4", "RANK": "1"}


def _adopted(
    *overrides: str, env: dict[str, str] = TORCHRUN, multirun: bool = False
) -> tuple[dict, list[str]]:
    cfg = compose.compose(list(overrides))
    cfg, errors = torchrun.adopt(cfg, multirun=multirun, env=env)
    return dict(cfg.launcher), [str(e) for e in errors]


def test_under_torchrun_the_spec_takes_its_world() -> None:
    launcher, errors = _adopted("parallel=ddp", "run_dir=/tmp/x")
    assert errors == [] and (launcher["backend"], launcher["nproc"], launcher["nnodes"]) == ("torchrun", 2, 2)
    cfg = compose.compose(["parallel=ddp", "run_dir=/tmp/x"])
    assert cfg.resume is None
    cfg, errors = torchrun.adopt(cfg, env={**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert errors == [] and cfg.resume == "auto"  # a torchrun restart continues from the newest checkpoint
    assert (
        not torchrun.reports(TORCHRUN)
        and torchrun.reports({**TORCHRUN, "RANK": "0"})
        and torchrun.reports({})
    )


@pytest.mark.parametrize(
    ("overrides", "multirun", "message"),
    [
        (["launcher=local"], False, "launcher.backend: this process was started by torchrun"),
        (["launcher.nproc=4"], False, "launcher.nproc=4 but torchrun started 2 (--nproc_per_node=2)"),
        (["launcher.nnodes=3"], False, "launcher.nnodes=3 but torchrun started 2 (--nnodes=2)"),
        (["launcher.max_restarts=2"], False, "use `torchrun --max-restarts=N`"),
        (["verify_resume=true"], False, "verify_resume=true starts runs of its own"),
        ([], True, "--multirun starts runs of its own"),
    ],
)
def test_under_torchrun_conflicting_settings_are_refused(
    overrides: list[str], multirun: bool, message: str
) -> None:
    launcher, errors = _adopted("parallel=ddp", "run_dir=/tmp/x", *overrides, multirun=multirun)
    assert any(message in e for e in errors), errors
    assert launcher["backend"] != "torchrun"  # nothing recorded when refused


def test_under_torchrun_the_run_dir_must_be_given_and_outside_it_the_backend_is_refused() -> None:
    assert any("give run_dir=PATH (a path every node sees" in e for e in _adopted("parallel=ddp")[1])
    errors = _adopted("launcher.backend=torchrun", env={})[1]
    assert len(errors) == 1 and "torchrun started this process, but it did not" in errors[0]


def test_a_foreign_flag_gets_our_key() -> None:
    """`--learning_rate=3e-5` (HF Trainer's argparse habit) names optimizer.lr, not just 'not a flag'."""
    [error] = command_line.parse(["--learning_rate=3e-5"]).unknown_flags()
    assert "use optimizer.lr" in error.message and "key=value overrides" in error.message
