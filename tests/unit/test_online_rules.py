"""Online RL (objective=grpo, rloo) specs the rules refuse before launch, each with its keys and fix; the prompt data
checks (too long, too few, a bad record); the advisor's RL rules and the planner's rollout cache."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from launcher.components.advice_rl import COLLAPSE_RECORDS, FLAT_RECORDS, CollapsingLength, FlatRewards
from launcher.front import command_line, compose
from launcher.front.cli import precheck
from launcher.front.prompt_data import prompt_errors


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "digits.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{d}=", "answer": str(d)}) + "\n" for d in range(10)))
    return path


def _base(prompts: Path) -> list[str]:
    return [
        "objective=grpo", "data=jsonl", f"data.path={prompts}", "data.format=prompt", "reward=math",
        "data.seq_len=32", "objective.max_completion_length=8", "objective.num_generations=4",
        "train.micro_batch_size=8",
    ]  # fmt: skip


def _errors(*argv: str) -> dict[tuple[str, ...], str]:
    return {e.keys: e.message for e in precheck(list(argv))}


@pytest.fixture(scope="module")
def spec(prompts: Path):
    """The spec of a complete grpo command line (composed once; the tests vary it with dataclasses.replace)."""
    line = command_line.of(_base(prompts))
    cfg, problems = compose.compose_checked(list(line.overrides), line.source)
    assert cfg is not None, problems
    built = compose.build(cfg)
    assert not built.errors, built.errors  # a complete spec is valid
    return built.spec


def _with(spec, **changes):
    """`spec` with some objective, train or data keys changed (group=dict of key=value)."""
    return replace(spec, **{group: replace(getattr(spec, group), **keys) for group, keys in changes.items()})


def test_what_does_not_compose_is_refused_with_the_fix(prompts: Path) -> None:
    errors = _errors(
        *_base(prompts),
        "data.packing=true",
        "objective.num_generations=3",
        "objective.max_completion_length=32",
    )
    assert "data.packing=false" in errors[("objective.name", "data.packing")]
    groups = ("train.micro_batch_size", "train.grad_accum_steps", "objective.num_generations")
    assert "whole number of groups" in errors[groups]
    assert "no room" in errors[("objective.max_completion_length", "data.seq_len")]
    errors = _errors(
        *_base(prompts), "objective.num_generations=1", "reward=none", "parallel=zero2", "launcher.nproc=2"
    )
    assert "at least 2" in errors[("objective.num_generations",)]
    assert "reward=math" in errors[("objective.name", "reward")]
    assert "parallel=fsdp" in errors[("objective.name", "parallel.strategy")]
    assert (
        "set data.format=prompt"
        in _errors(*_base(prompts), "data.format=text")[("objective.name", "data.format")]
    )
    alone = _errors("data=jsonl", f"data.path={prompts}", "data.format=prompt")
    assert "objective=grpo" in alone[("data.format", "objective.name")]


def test_prompt_data_is_counted_and_measured_before_launch(spec, tmp_path: Path) -> None:
    assert prompt_errors(spec) == []
    too_long = prompt_errors(_with(spec, objective={"max_completion_length": 31}))
    assert too_long[0].keys == ("data.seq_len", "objective.max_completion_length", "data.path")
    assert (
        "longer than data.seq_len 32 - objective.max_completion_length 31 = 1 tokens" in too_long[0].message
    )
    few = prompt_errors(_with(spec, train={"micro_batch_size": 48}))
    assert "holds 10 prompt(s), fewer than one optimizer step samples" in few[0].message
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "2+2?"}) + "\n")
    message = prompt_errors(_with(spec, data={"path": str(bad)}))[0].message
    assert f"{bad}:1: no field 'prompt' or 'messages'" in message


def test_the_advisor_speaks_on_flat_rewards_and_collapsing_length() -> None:
    flat = FlatRewards()
    said = [flat.check({"equal_groups": 1.0, "reward": 0.0}) for _ in range(FLAT_RECORDS + 1)]
    assert said[:-1] == [None] * FLAT_RECORDS and "all-equal rewards" in said[-1]
    assert all(FlatRewards().check({"equal_groups": 0.5}) is None for _ in range(20))
    collapse = CollapsingLength()
    said = [collapse.check({"completion_length": n}) for n in [40, 30, *[4] * COLLAPSE_RECORDS]]
    assert said[-1] is not None and "fell to 4" in said[-1]
    assert all(CollapsingLength().check({"completion_length": 1.0}) is None for _ in range(10))


def test_the_planner_counts_the_rollout_cache_and_the_reference(spec) -> None:
    from launcher.plan.preference import preference_reference
    from launcher.plan.rollouts import rollout_cache

    size, note = rollout_cache(spec)
    assert size == 8 * 32 * 4 * 256 * 4  # rows x tokens x layers x (keys + values of d_model 128) x fp32
    assert "key-value cache" in note
    assert "none needed" in preference_reference(spec)[1]  # grpo's beta 0: no reference
    assert "reference copy" in preference_reference(_with(spec, objective={"beta": 0.04}))[1]
