"""A TRL-style reward file in a real GRPO run: scored and logged by name, recorded in spec.yaml and the checkpoint,
and a resume after the file changed refused naming it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from conftest import run_inline
from launcher.components.metrics import read_metrics
from launcher.front.cli import precheck

# The example of TRL's GRPOTrainer docs for the standard (string) format, as a user would copy it.
TRL_DOCS_REWARD = """
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def answer_seen(completions, answer, **kwargs):
    return [1.0 if str(a) in c else 0.0 for c, a in zip(completions, answer)]
"""


@pytest.mark.extended  # the unit tests call these functions through RewardSet and refuse the resume from a manifest
def test_a_trl_reward_file_trains_and_its_change_stops_a_resume(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the reward file is named relative to where train runs
    (tmp_path / "rewards.py").write_text(TRL_DOCS_REWARD)
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"{i % 10}+1=", "answer": i % 10 + 1}) + "\n")
    run_dir = tmp_path / "run"
    overrides = [
        "objective=grpo", "data=jsonl", "data.format=prompt", f"data.path={tmp_path / 'prompts.jsonl'}",
        "objective.num_generations=2", "objective.max_completion_length=8", "train.micro_batch_size=4",
        "reward.functions=[rewards.py:reward_len,rewards.py:answer_seen]", "reward.function_weights=[0.1,1]",
        "train.max_steps=2", "train.log_every=1", "checkpoint.every=2", "log.progress=false",
        "log.summary_table=false",
    ]  # fmt: skip
    assert run_inline(overrides, run_dir) == 0
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward" in r]
    assert len(records) == 2 and all(r["reward/reward_len"] <= 0 for r in records)
    assert all("reward/answer_seen" in r for r in records)
    digest = hashlib.sha256((tmp_path / "rewards.py").read_bytes()).hexdigest()
    assert digest in (run_dir / "spec.yaml").read_text()
    manifest = json.loads((run_dir / "checkpoints" / "step_2" / "COMPLETE").read_text())
    assert manifest["reward_files"] == {"rewards.py": digest}

    (tmp_path / "rewards.py").write_text(TRL_DOCS_REWARD.replace("20", "30"))
    errors = precheck([*overrides, f"run_dir={run_dir}", "resume=auto", "train.max_steps=4"])
    assert [e.keys for e in errors] == [("resume", "reward.functions")]
    assert "rewards.py" in errors[0].message and "changed since the run recorded it" in errors[0].message
