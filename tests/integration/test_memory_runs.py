"""Whole runs with the memory, batching and profiling options: same losses, budgeted batch search, exact resume."""

from __future__ import annotations

import json
import random

import pytest

from conftest import TINY, losses, run_cli, run_inline
from launcher.plan.states import count_params
from launcher.rank.micro_batch import RECORD
from launcher.spec import load_spec

SHORT = [*TINY, "train.max_steps=6", "checkpoint.every=null", "train.eval_every=null"]


def test_checkpointing_and_offload_train_to_the_same_losses(tmp_path) -> None:
    assert run_inline(SHORT, tmp_path / "plain") == 0
    memory = ["memory=checkpoint_all", "memory.offload_activations=true"]
    assert run_inline([*SHORT, *memory], tmp_path / "saving") == 0
    plain, saving = losses(tmp_path / "plain"), losses(tmp_path / "saving")
    assert plain.keys() == saving.keys()
    for step in plain:
        assert saving[step] == pytest.approx(plain[step], rel=1e-6, abs=1e-7)


def _search(run_dir, budget_gb: float) -> dict:
    args = [
        *TINY,
        "data.seq_len=128",
        "model.d_model=128",
        "train.micro_batch_size=16",
        "train.max_steps=2",
        "scheduler.warmup_steps=1",
        "checkpoint.every=null",
        "train.eval_every=null",
        "memory=auto_batch",
        f"memory.max_memory_gb={budget_gb}",
        f"run_dir={run_dir}",
    ]
    done = run_cli(args, cwd=run_dir.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "auto micro batch: micro batch" in done.stdout
    return json.loads((run_dir / RECORD).read_text())


def test_auto_micro_batch_fits_the_budget_and_keeps_the_global_batch(tmp_path) -> None:
    """A roomy budget takes the whole batch of 16; a budget between the measured peaks of 4 and 8 picks 4 x 4."""
    roomy = _search(tmp_path / "roomy", 64.0)
    assert (roomy["micro_batch_size"], roomy["grad_accum_steps"]) == (16, 1)
    peaks = {t["micro_batch_size"]: t["peak_bytes"] for t in roomy["tries"]}
    assert list(peaks) == [1, 2, 4, 8, 16]
    assert peaks[8] - peaks[4] > 8 * 2**20  # activations of 4 more sequences: a clear step up
    budget_gb = (peaks[4] + peaks[8]) / 2 / 2**30
    tight = _search(tmp_path / "tight", budget_gb)
    assert (tight["micro_batch_size"], tight["grad_accum_steps"]) == (4, 4)
    for attempt in tight["tries"]:
        assert attempt["fits"] == (attempt["peak_bytes"] <= tight["budget_bytes"])
    assert "8 did not fit" in tight["reason"]
    big, split = losses(tmp_path / "roomy"), losses(tmp_path / "tight")
    for step in big:  # the same 16 sequences per step, accumulated in 4 parts: the same update
        assert split[step] == pytest.approx(big[step], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(
    ("strategy", "measured", "shard"),
    [
        ("fsdp", "this rank's FSDP2 shards", 0.55),
        # further variants of the fsdp case's property (the search on the sharded state, the ranks in step)
        pytest.param("zero3", "this rank's ZeRO-3 partitions", 0.55, marks=pytest.mark.extended),
        # the blocks' projections split, embeddings whole
        pytest.param("tp", "this rank's tensor-parallel split", 0.95, marks=pytest.mark.extended),
    ],
)
def test_auto_micro_batch_searches_the_sharded_state_on_two_ranks(
    tmp_path, strategy: str, measured: str, shard: float
) -> None:
    """Searched after sharding, every rank in step: the cap of 2 splits the per-rank batch 8 as 2 x 4."""
    run_dir = tmp_path / strategy
    args = [
        *TINY, "train.max_steps=2", "scheduler.warmup_steps=1", "train.micro_batch_size=4", "train.grad_accum_steps=2",
        "checkpoint.every=null", "train.eval_every=null", "launcher=local", "launcher.nproc=2", f"parallel={strategy}", "memory=auto_batch",
        "memory.max_memory_gb=64", "memory.max_micro_batch_size=2", f"run_dir={run_dir}",
    ]  # fmt: skip
    done = run_cli(args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((run_dir / RECORD).read_text())
    assert (record["micro_batch_size"], record["grad_accum_steps"]) == (2, 4)
    assert [t["micro_batch_size"] for t in record["tries"]] == [1, 2] and record["measured"] == measured
    whole = 8 * count_params(load_spec(run_dir / "spec.yaml")).trainable  # two fp32 moments per parameter
    assert 0 < record["ballast_bytes"] <= shard * whole  # this rank's share, not the whole model's
    assert f"on {measured}" in done.stdout
    if strategy == "zero3":  # the engine runs the chosen split
        config = json.loads((run_dir / "deepspeed_config.json").read_text())
        assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (2, 4)
    assert sorted(losses(run_dir)) == [1, 2]


def _write_jsonl(path) -> None:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    with path.open("w") as f:
        for _ in range(600):
            f.write(
                json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(1, 20)))}) + "\n"
            )


@pytest.mark.parametrize(
    "batching",
    [["data.batching=token_budget", "data.max_tokens_per_batch=160"], ["data.batching=group_by_length"]],
    ids=["token_budget", "group_by_length"],
)
def test_unpacked_batches_train_and_resume_exactly(tmp_path, batching: list[str]) -> None:
    _write_jsonl(tmp_path / "docs.jsonl")
    args = [*TINY, "data=jsonl", f"data.path={tmp_path / 'docs.jsonl'}", "data.packing=false", *batching]
    args += ["train.grad_accum_steps=2", "train.eval_every=null"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run_inline(args, straight) == 0
    assert run_inline([*args, "train.stop_after=10"], split) == 0
    assert run_inline([*args, "resume=auto"], split) == 0
    assert losses(split) == losses(straight)  # bitwise, across the resume
    curve = losses(straight)
    assert curve[20] < curve[1]


def test_profile_leaves_traces_and_prints_top_operators(tmp_path, capsys) -> None:
    run_dir = tmp_path / "run"
    assert run_inline([*SHORT, "profile=true", "profiler.top_ops=5"], run_dir) == 0
    traces = list((run_dir / "profile").glob("rank0*.pt.trace.json"))
    assert len(traces) == 1
    trace = json.loads(traces[0].read_text())
    assert any(
        event.get("name") == "ProfilerStep#4" for event in trace["traceEvents"]
    )  # wait 1, warmup 1, active 2-4
    table = (run_dir / "profile" / "top_ops_rank0.txt").read_text()
    assert "aten::" in table and "Self CPU" in table
    out = capsys.readouterr().out
    assert "top operators by self cpu time total" in out and "aten::" in out
