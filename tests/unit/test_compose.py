"""Composition of every group option, both selection spellings, and every validation rule's message."""

from __future__ import annotations

import pytest

from launcher.front import command_line, compose
from launcher.front.cli import precheck
from launcher.spec import public_keys

NEEDS_PATH = {
    ("data", "text"): "corpus.txt",
    ("data", "jsonl"): "corpus.jsonl",
    ("data", "files"): "corpus.jsonl",
}
CPU_ONLY_INVALID = {
    ("precision", "tf32"): ("precision.tf32",),
    ("precision", "fp8"): ("precision.fp8",),
    ("compile", "reduce_overhead"): ("compile.mode",),
}
# GPU recipes on this CPU-only machine: refused for the missing GPU alone, no rule judging the absent
# device's bf16 or count (tests/unit/test_recipes.py, test_launch_rules.py).
_GPU = [("launcher.device",)]
GPU_RECIPES_ON_CPU = {
    ("recipe", "small_gpu"): _GPU,
    ("recipe", "large_gpu"): _GPU,
    ("recipe", "multi_gpu_ddp"): _GPU,
    ("recipe", "multi_gpu_fsdp"): _GPU,
    ("recipe", "huge_model_zero3_offload"): _GPU,
}
# Options that are invalid on their own by design (frozen quantized weights need adapters to train).
INVALID_ALONE: dict[tuple[str, str], tuple[str, ...] | list[tuple[str, ...]]] = {
    ("quantization", "int8"): ("quantization.method", "quantization.lora.rank"),
    ("quantization", "nf4"): ("quantization.method", "quantization.lora.rank"),
    ("model", "hf"): ("model.path", "model.hf_config"),  # a model folder to name
    ("distill", "kd"): ("distill.teacher",),  # a teacher to name
    # a teacher to name, and rows of one prompt and completion each, which packing would join
    ("distill", "on_policy"): [("distill.teacher",), ("distill.mode", "data.packing")],
    ("objective", "dpo"): ("objective.name", "data.format"),  # preference data to name
    ("objective", "simpo"): ("objective.name", "data.format"),
    ("objective", "orpo"): ("objective.name", "data.format"),
    ("objective", "kto"): ("objective.name", "data.format"),
    ("objective", "grpo"): ("objective.name", "data.format"),  # prompt data to name
    ("objective", "rloo"): ("objective.name", "data.format"),
    ("optimizer", "adamw_schedule_free"): ("optimizer.name", "scheduler.name"),  # scheduler=constant
    ("reward", "math"): ("reward", "objective.name"),  # rewards are read by objective=grpo or rloo
    ("reward", "math_verify"): ("reward", "objective.name"),
    ("reward", "format"): ("reward", "objective.name"),
    ("reward", "r1"): ("reward", "objective.name"),
}
# Options whose mesh needs several ranks: composed with that many local ranks.
NEEDS_RANKS = {
    ("parallel", "tp"): 2,
    ("parallel", "fsdp_hybrid"): 4,
    ("parallel", "tp_fsdp"): 4,
    ("parallel", "pp"): 2,
    ("parallel", "pp_fsdp"): 4,
    ("parallel", "pp_tp_fsdp"): 8,
}


def _options() -> list[tuple[str, str]]:
    return [(g, o) for g, options in compose.group_options().items() for o in options]


@pytest.mark.parametrize(("group", "option"), _options())
def test_every_option_composes_both_ways(group: str, option: str, tmp_path, request) -> None:
    extra = []
    if (group, option) in NEEDS_PATH:
        corpus = tmp_path / NEEDS_PATH[group, option]
        corpus.write_text('{"text": "hello world"}\n' * 100)
        extra = [f"data.path={corpus}"]
    if (group, option) == ("tokenizer", "hf"):
        extra = [f"tokenizer.path={request.getfixturevalue('hf_tokenizer')}"]
    if (group, option) in NEEDS_RANKS:
        extra = ["launcher=local", f"launcher.nproc={NEEDS_RANKS[group, option]}"]
    if (group, option) == ("launcher", "local"):
        extra = ["parallel=ddp"]  # its two ranks need a multi-rank strategy
    # `+group=option` is rewritten to the very overrides of `group=option`, so the one check below judges both
    assert command_line.normalize([f"+{group}={option}", *extra]) == [f"{group}={option}", *extra]
    bare = precheck([f"{group}={option}", *extra])
    if (group, option) in CPU_ONLY_INVALID:
        assert [e.keys for e in bare] == [CPU_ONLY_INVALID[group, option]]
    elif (group, option) in GPU_RECIPES_ON_CPU:
        assert [e.keys for e in bare] == GPU_RECIPES_ON_CPU[group, option]
    elif (group, option) in INVALID_ALONE:
        expected = INVALID_ALONE[group, option]  # one problem's keys, or a list of several problems' keys
        assert [e.keys for e in bare] == (expected if isinstance(expected, list) else [expected])
    else:
        assert bare == []


def test_design_card_usage_composes() -> None:
    argv = command_line.normalize(["+parallel=single", "+precision=bf16"])
    assert argv == ["parallel=single", "precision=bf16"]
    cfg = compose.compose(argv)
    spec, errors = compose.validate(cfg)
    assert errors == [] and spec.precision.bf16 and spec.parallel.strategy == "single"


def _errors(*argv: str) -> list[str]:
    return [str(e) for e in precheck(list(argv))]


def test_unknown_key_added_with_plus_is_refused_with_hint() -> None:
    (error,) = _errors("+optimizer.lrr=1")
    assert error.startswith("optimizer.lrr: unknown key. Did you mean lr?")


def test_unknown_key_without_plus_is_refused_with_hint() -> None:
    (error,) = _errors("train.max_stpes=3")
    assert "train.max_stpes" in error and "Did you mean max_steps?" in error


def test_unknown_option_gets_hint() -> None:
    (error,) = _errors("precision=bf61")
    assert "no option 'bf61' in group precision. Did you mean bf16?" in error


def test_wrong_type_names_key() -> None:
    (error,) = _errors("train.max_steps=abc")
    assert error.startswith("train.max_steps: wrong type")


def test_target_is_refused() -> None:
    for argv in (["+_target_=os.system"], ["+model._target_=os.system"]):
        (error,) = _errors(*argv)
        assert "`_target_` is refused" in error


def test_all_problems_reported_at_once() -> None:
    errors = _errors("precision=bf61", "+optimizer.lrr=1", "train.max_steps=abc")
    assert len(errors) == 3


RULES = [
    (["precision.fp16=true", "precision.bf16=true"], ("precision.fp16", "precision.bf16"), "Choose one"),
    (["precision=tf32"], ("precision.tf32",), "compute capability 8.0"),
    (["train.max_steps=0"], ("train.max_steps",), "must be positive"),
    (["train.micro_batch_size=-1"], ("train.micro_batch_size",), "must be positive"),
    (["train.grad_accum_steps=0"], ("train.grad_accum_steps",), "must be positive"),
    (["optimizer.lr=0"], ("optimizer.lr",), "must be positive"),
    (
        ["scheduler.warmup_steps=500", "train.max_steps=100"],
        ("scheduler.warmup_steps", "train.max_steps"),
        "never reach its peak",
    ),
    (["train.eval_every=0"], ("train.eval_every",), "eval_every=null"),
    (["checkpoint.every=-5"], ("checkpoint.every",), "checkpoint.every=null"),
    (["data.seq_len=512"], ("data.seq_len", "model.max_seq_len"), "exceed the model's context"),
    (["data=text", "data.path=/nonexistent/*.txt"], ("data.path",), "no file matches"),
    (["data=text"], ("data.path",), "set data.path"),
    (["resume=/nonexistent/run"], ("resume",), "holds no complete checkpoint"),
    (["resume=auto"], ("resume", "run_dir"), "Name the run directory"),
    (["launcher.device=cuda"], ("launcher.device",), "no CUDA GPU"),
    (["launcher=inline", "launcher.nproc=2"], ("launcher.backend", "launcher.nproc"), "launcher=local"),
    (["model.n_head=3"], ("model.d_model", "model.n_head"), "multiple of n_head"),
    (["train.max_grad_norm=0"], ("train.max_grad_norm",), "max_grad_norm=null"),
    (["optimizer.name=adamww"], ("optimizer.name",), "Did you mean adamw?"),
    (["train.on_nonfinite=ignore"], ("train.on_nonfinite",), "Choose one of: skip, stop"),
    (["precision.eval_dtype=float8"], ("precision.eval_dtype",), "Choose one of"),
    (
        ["train.stop_after=300"],
        ("train.stop_after", "train.max_steps"),
        "must lie below max_steps (300): an optimizer step from 1 to 299",
    ),
    (
        ["train.stop_after=0"],
        ("train.stop_after",),
        "must be at least 1 (null: train to train.max_steps), got 0",
    ),
    (["scheduler.min_lr_ratio=2"], ("scheduler.min_lr_ratio",), "must lie in [0, 1]"),
]


@pytest.mark.parametrize(("argv", "keys", "phrase"), RULES, ids=[" ".join(r[0]) for r in RULES])
def test_rule_message(argv: list[str], keys: tuple[str, ...], phrase: str) -> None:
    errors = {e.keys: e.message for e in precheck(argv)}
    assert keys in errors, errors
    assert phrase in errors[keys]


def test_fresh_start_into_run_dir_with_checkpoints_is_refused(tmp_path) -> None:
    (tmp_path / "checkpoints" / "step_10").mkdir(parents=True)
    errors = precheck([f"run_dir={tmp_path}"])
    assert [e.keys for e in errors] == [("resume", "run_dir")]
    assert "resume=auto" in errors[0].message


def test_public_keys_are_locked() -> None:
    """The config surface changes only on purpose: update tests/assets/public_keys.txt with it."""
    from pathlib import Path

    locked = (Path(__file__).parents[1] / "assets" / "public_keys.txt").read_text().split()
    assert public_keys() == locked


def test_auto_backend_picks_local_for_several_ranks() -> None:
    """The design card's usage: `train +parallel=zero3 +precision=bf16 launcher.nproc=2` runs 2 local ranks."""
    spec, errors = compose.validate(
        compose.compose(command_line.normalize(["+parallel=zero3", "+precision=bf16", "launcher.nproc=2"]))
    )
    assert errors == [] and spec.launcher.backend == "local"
    spec, errors = compose.validate(compose.compose([]))
    assert errors == [] and spec.launcher.backend == "inline"


def test_a_default_warmup_is_fitted_to_a_short_run_and_a_typed_one_is_checked(capsys) -> None:
    """`train train.max_steps=5` runs: the default 20 warmup steps become 0 without a word (the user set
    nothing); a warmup a recipe sets is shortened with a note naming it; a typed one is refused."""
    for picked in ([], ["scheduler=linear"]):  # the schema's default, a shipped schedule's default
        spec, errors = compose.validate(compose.compose([*picked, "train.max_steps=5"]))
        assert errors == [] and spec.scheduler.warmup_steps == 0
        assert "warm" not in capsys.readouterr().err
    spec, errors = compose.validate(compose.compose(["recipe=cpu_smoke", "train.max_steps=3"]))
    assert errors == [] and spec.scheduler.warmup_steps == 0
    assert "scheduler.warmup_steps=4 (set by recipe=cpu_smoke)" in capsys.readouterr().err
    spec, errors = compose.validate(compose.compose(["train.max_steps=50"]))
    assert errors == [] and spec.scheduler.warmup_steps == 20  # it fits: unchanged
    typed = precheck(["train.max_steps=5", "scheduler.warmup_steps=20"])
    assert [e.keys for e in typed] == [("scheduler.warmup_steps", "train.max_steps")]
