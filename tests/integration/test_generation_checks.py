"""The `generation` evaluator on the default GPT: its accuracy and pass@k equal a hand count on the checkpoint of
the step it evaluated (the same generator, the same seeds and batches; answers checked by plain Python), and
its records drive keep_best like any other metric.

The prompts' references are regular expressions a tiny model's sampled bytes meet now and then (`.*e.*`: an
`e` somewhere), so the count is neither all nor nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import TINY, run_inline, run_ranks
from launcher.components.metrics import read_metrics
from launcher.components.model.build import build_model
from launcher.components.model.generation import Sampling, generate
from launcher.spec import load_spec
from launcher.tools import export

CHECKS = [  # prompt, the reference pattern, the same test in plain Python (on the stripped completion)
    ("import os\nimport ", ".*e.*", lambda t: "e" in t),
    ("def __init__(self", "[^0-9]*", lambda t: not any(ch in "0123456789" for ch in t)),
    ("class ", ".*\\(.*", lambda t: "(" in t),
    ("    return ", ".*\\n.*", lambda t: "\n" in t),
    ("for i in range(", ".*s.*", lambda t: "s" in t),
    ("if x is None:\n", ".*", lambda t: True),
]
SAMPLES, BATCH, NEW_TOKENS = 4, 8, 8


def _prompts(base: Path) -> Path:
    prompts = base / "prompts.jsonl"
    lines = [json.dumps({"prompt": p, "answer": a}) for p, a, _ in CHECKS]
    prompts.write_text("\n".join([*lines[:3], "", *lines[3:]]) + "\n")  # a blank line is skipped
    return prompts


def _run(prompts: Path) -> list[str]:
    """Two steps of training, then the generation checks (4 samples per prompt at temperature 1) and a checkpoint."""
    return [
        "train.max_steps=2", "scheduler.warmup_steps=1", "train.eval_every=2", "checkpoint.every=2", "train.log_every=2",
        f"eval.generation.prompts={prompts}", "eval.generation.match=regex", f"eval.generation.samples={SAMPLES}",
        "eval.generation.temperature=1.0", "eval.generation.seed=7", "eval.generation.pass_at=[1,2,4]",
        f"eval.generation.max_new_tokens={NEW_TOKENS}", f"eval.generation.batch_size={BATCH}",
        "checkpoint.keep_best=eval/generation/pass@2",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> Path:
    """One process's run with the generation checks."""
    base = tmp_path_factory.mktemp("generation")
    assert run_inline([*TINY, *_run(_prompts(base))], base / "run") == 0
    return base / "run"


def _hand_count(run_dir: Path) -> list[int]:
    """Each prompt's correct samples, generated from the step's checkpoint as the evaluator batches them."""
    spec = load_spec(run_dir / "spec.yaml")
    model = build_model(spec.model)
    model.load_state_dict(export.consolidate(run_dir / "checkpoints" / "step_2", spec))
    items = list(range(len(CHECKS) * SAMPLES))  # item i: prompt i // SAMPLES, seeded by i
    correct = [0] * len(CHECKS)
    for start in range(0, len(items), BATCH):
        batch = items[start : start + BATCH]
        prompts = [list(CHECKS[i // SAMPLES][0].encode()) for i in batch]
        done = generate(model, prompts, max_new_tokens=NEW_TOKENS, sampling=Sampling(temperature=1.0, seed=7),
                        stop_ids=(0,), context=spec.model.max_seq_len, indices=batch, vocab_limit=256)  # fmt: skip
        for index, completion in zip(batch, done, strict=True):
            text = bytes(completion.ids).decode("utf-8", "replace").strip()
            correct[index // SAMPLES] += CHECKS[index // SAMPLES][2](text)
    return correct


def _assert_hand_count(run_dir: Path) -> None:
    correct = _hand_count(run_dir)
    assert 0 < sum(correct) < len(CHECKS) * SAMPLES, correct  # neither all nor nothing
    record = next(r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/generation/accuracy" in r)
    assert record["step"] == 2
    assert record["eval/generation/accuracy"] == pytest.approx(
        sum(correct) / (len(CHECKS) * SAMPLES), abs=1e-12
    )
    for k in (1, 2, 4):  # Chen et al. (2021): 1 - C(n - c, k) / C(n, k), averaged over the prompts
        want = sum(1 - math.comb(SAMPLES - c, k) / math.comb(SAMPLES, k) for c in correct) / len(CHECKS)
        assert record[f"eval/generation/pass@{k}"] == pytest.approx(want, abs=1e-12), k
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval/generation/pass@4"] == record["eval/generation/pass@4"]
    assert summary["best_checkpoint"]["value"] == record["eval/generation/pass@2"]
    assert (run_dir / "checkpoints" / "best").read_text().strip() == "step_2"


def test_accuracy_and_pass_at_k_equal_a_hand_count(checked: Path) -> None:
    _assert_hand_count(checked)


@pytest.mark.extended  # the default tier: the one-process hand count above; the sampling split: test_generation.py
def test_two_fsdp_ranks_split_the_samples_and_agree_on_the_hand_count(tmp_path: Path) -> None:
    """The 24 samples dealt over 2 FSDP2 ranks (12 each, the sharded model decoding in step), counted on both."""
    run_dir = tmp_path / "run"
    done = run_ranks([*TINY, *_run(_prompts(tmp_path)), "parallel=fsdp", "launcher.nproc=2"], run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_hand_count(run_dir)
