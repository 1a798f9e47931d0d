"""GRPO end to end on the real loop: rollouts sampled by the policy, scored by a TRL-style reward function in a user
file (the reward group reads it unchanged), trained; the same run on 2 DDP ranks (and, extended, 2 FSDP2 ranks)
equals one process step by step, and a resumed run continues bitwise.

The toy task (docs/rl.md): a prompt `=7` asks for its last digit again; the reward is 1 for that digit, falling
by 0.2 per byte away from it, so a random byte-level model starts near 0.02.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from conftest import run_inline, run_ranks
from launcher.components.metrics import read_metrics

REWARD = '''
def digit_distance(prompts, completions, answer, **kwargs):
    """1 when the completion starts with the record's digit, falling by 0.2 per byte away from it."""
    return [max(0.0, 1 - abs(ord(c[0]) - ord(a)) / 5) if c else 0.0 for c, a in zip(completions, answer)]
'''


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> list[str]:
    """The toy task's prompts and reward file, as overrides."""
    folder = tmp_path_factory.mktemp("digits")
    lines = [json.dumps({"prompt": f"={d % 10}", "answer": str(d % 10)}) for d in range(7, 207, 3)]
    (folder / "digits.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "rewards.py").write_text(REWARD)
    return [
        "objective=grpo", "data=jsonl", f"data.path={folder / 'digits.jsonl'}", "data.format=prompt",
        f"reward.functions=[{folder / 'rewards.py'}:digit_distance]", "data.seq_len=16",
        "model.n_layer=2", "model.d_model=64", "model.n_head=2", "scheduler=constant", "log.progress=false",
        "log.summary_table=false", "train.log_every=1",
    ]  # fmt: skip


SMALL = [
    "objective.max_completion_length=4", "objective.num_generations=4", "objective.log_rollouts=2",
    "objective.beta=0.04", "optimizer.lr=1e-2", "train.max_steps=4", "checkpoint.every=2",
]  # fmt: skip
"""A short run: 2 prompts x 4 completions of up to 4 tokens per step, a KL to a frozen copy of the initial policy."""
KEYS = ("loss", "reward", "reward/digit_distance", "equal_groups", "completion_length", "entropy", "kl")


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def one_process(task, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("grpo") / "one"
    assert run_inline([*task, *SMALL, "train.micro_batch_size=8", f"run_dir={run_dir}"], run_dir) == 0
    return run_dir


def test_a_run_logs_its_rollouts_and_metrics(one_process: Path) -> None:
    records = _records(one_process)
    assert set(records) == {1, 2, 3, 4}
    for key in (*KEYS, "reward_std", "completion_length_max", "clipped_share", "clip_ratio/region_mean",
                "generation_share", "generated_tokens_per_s"):  # fmt: skip
        assert all(key in r for r in records.values()), key
    assert 0 < records[1]["generation_share"] < 1
    lines = [json.loads(line) for line in (one_process / "rollouts.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 1, 2, 2, 3, 3, 4, 4]  # objective.log_rollouts=2 per step
    assert lines[0]["prompt"].startswith("=") and {"completion", "reward", "advantage", "truncated"} <= set(
        lines[0]
    )


def test_grpo_resumes_bitwise(task, one_process: Path, tmp_path: Path) -> None:
    """A new run from the one-process run's step-2 checkpoint continues its steps 3 and 4 bitwise."""
    resumed = tmp_path / "resumed"
    step_2 = one_process / "checkpoints" / "step_2"
    assert (
        run_inline(
            [*task, *SMALL, "train.micro_batch_size=8", f"resume={step_2}", f"run_dir={resumed}"], resumed
        )
        == 0
    )
    ours, theirs = _records(resumed), _records(one_process)
    assert set(ours) == {3, 4}
    assert [ours[s]["loss"] for s in (3, 4)] == [theirs[s]["loss"] for s in (3, 4)]
    assert [ours[s]["reward"] for s in (3, 4)] == [theirs[s]["reward"] for s in (3, 4)]


STRATEGIES = {"ddp": "parallel=ddp", "fsdp": "parallel=fsdp"}


# FSDP2 in the extended tier: DDP holds the rollouts' world-size invariance; FSDP2 adds generation over gathered shards.
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.extended) if n == "fsdp" else n for n in STRATEGIES]
)
def test_grpo_on_two_ranks_matches_one_process(task, one_process: Path, tmp_path: Path, name: str) -> None:
    two = tmp_path / name
    args = [*task, *SMALL, STRATEGIES[name], "launcher=local", "launcher.nproc=2", "train.micro_batch_size=4"]
    proc = run_ranks([*args, f"run_dir={two}"], two, nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, other = _records(one_process), _records(two)
    assert one.keys() == other.keys() == {1, 2, 3, 4}
    for step in one:
        for key in KEYS:
            assert other[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-6), (step, key)


def test_grpo_raises_the_reward_of_the_toy_task(task, tmp_path: Path) -> None:
    """A short run shows the reward rising; docs/rl.md's bench run (scripts/bench_grpo) takes it to the end."""
    run_dir = tmp_path / "learn"
    args = [*task, "objective.max_completion_length=1", "objective.num_generations=8", "train.micro_batch_size=32",
            "optimizer.lr=1e-2", "train.max_steps=24", "train.log_every=4", "checkpoint.every=null"]  # fmt: skip
    assert run_inline([*args, f"run_dir={run_dir}"], run_dir) == 0
    rewards = [r["reward"] for r in _records(run_dir).values()]
    assert rewards[0] < 0.1 and rewards[-1] > rewards[0] + 0.15, rewards


def _copying_llama(folder: Path) -> Path:
    """A tiny Llama folder that can copy a digit after `:` but answers `=7` with a random byte: model=hf_llama_tiny
    fully fine-tuned for 150 steps on such text and exported with train-export (docs/rl.md, scripts/bench_grpo)."""
    from launcher.tools import export

    rng = random.Random(1)
    lines = []
    for i in range(2000):
        digit, byte = rng.randint(0, 9), chr(rng.randint(33, 126))
        lines.append(json.dumps({"text": f":{digit}{digit}" if i % 2 else f"={digit}{byte}"}))
    (folder / "base.jsonl").write_text("\n".join(lines) + "\n")
    run_dir = folder / "base"
    args = [
        "model=hf_llama_tiny", "data=jsonl", f"data.path={folder / 'base.jsonl'}", "data.seq_len=16",
        "train.micro_batch_size=32", "train.max_steps=150", "optimizer.lr=3e-3", "checkpoint.every=null",
        "log.progress=false", "log.summary_table=false", f"run_dir={run_dir}",
    ]  # fmt: skip
    assert run_inline(args, run_dir) == 0
    assert export.main([str(run_dir), str(folder / "base-hf"), "--format", "hf"]) == 0
    return folder / "base-hf"


@pytest.mark.extended  # LoRA on a Hugging Face folder: the default tier's runs hold the loop on the built-in GPT
def test_grpo_with_lora_on_a_hugging_face_llama(task, tmp_path: Path) -> None:
    """LoRA GRPO learns the task on a tiny Llama folder: the mean reward rises from under 0.2 (its first 5 steps)
    to over 0.8 (its last 5 of 40). Rollouts are sampled and trained through the adapters, the KL taken to the
    base with the adapters off: 0 at the first step (LoRA's B starts at zero), above 0 once the adapters moved."""
    folder = _copying_llama(tmp_path)
    run_dir = tmp_path / "lora"
    args = [
        *[a for a in task if not a.startswith("model.")], "model=hf", f"model.path={folder}", "quantization=lora",
        "objective.beta=0.04", "objective.max_completion_length=1", "objective.num_generations=16",
        "train.micro_batch_size=64", "optimizer.lr=1e-3", "train.max_steps=40", "checkpoint.every=null",
    ]  # fmt: skip
    assert run_inline([*args, f"run_dir={run_dir}"], run_dir) == 0
    records = _records(run_dir)
    rewards = [records[step]["reward"] for step in sorted(records)]
    assert sum(rewards[:5]) / 5 < 0.2 and sum(rewards[-5:]) / 5 > 0.8, rewards
    assert records[1]["kl"] == pytest.approx(0.0, abs=1e-6) and records[40]["kl"] > 1e-6
