"""Every rejected combination of the memory, batching, compile and profiling options, with its message."""

from __future__ import annotations

import pytest

from launcher.front import command_line
from launcher.front.cli import precheck

CASES = [
    (["memory.checkpoint_every=0"], ("memory.checkpoint_every",), "must be 1 or more"),
    (
        ["memory.checkpoint_every=2"],
        ("memory.checkpoint_every", "memory.activation_checkpointing"),
        "is none",
    ),
    (["memory.activation_checkpointing=everything"], ("memory.activation_checkpointing",), "Choose one of"),
    (
        ["model=hf_llama_tiny", "memory=checkpoint_attention"],
        ("memory.activation_checkpointing", "model.kind"),
        "attention-only checkpointing exists for the built-in GPT only",
    ),
    (["memory.empty_cache_steps=0"], ("memory.empty_cache_steps",), "use null to never"),
    (
        ["memory.cuda_alloc_conf=expandible_segments:True"],
        ("memory.cuda_alloc_conf",),
        "unknown allocator key 'expandible_segments'",
    ),
    (
        ['memory.cuda_alloc_conf="expandable_segments:True,max_split_size_mb:lots"'],
        ("memory.cuda_alloc_conf",),
        "max_split_size_mb must be a whole number",
    ),
    (["memory=auto_batch", "memory.max_micro_batch_size=0"], ("memory.max_micro_batch_size",), "1 or more"),
    (["memory.max_memory_gb=4"], ("memory.max_memory_gb", "memory.auto_micro_batch"), "search, which is off"),
    (["memory=auto_batch", "memory.max_memory_gb=-1"], ("memory.max_memory_gb",), "must be positive"),
    (["data.batching=group_by_length"], ("data.batching", "data.packing"), "data.packing=false"),
    (["data.batching=by_size"], ("data.batching",), "Choose one of"),
    (
        ["data.packing=false", "data.batching=token_budget"],
        ("data.max_tokens_per_batch", "data.seq_len"),
        "at least one sequence",
    ),
    (["data.max_tokens_per_batch=4096"], ("data.max_tokens_per_batch", "data.batching"), "token_budget"),
    (
        [
            "memory=auto_batch",
            "memory.max_memory_gb=4",
            "data.packing=false",
            "data.batching=token_budget",
            "data.max_tokens_per_batch=4096",
        ],
        ("memory.auto_micro_batch", "data.batching"),
        "no micro batch",
    ),  # fmt: skip
    (["compile.mode=fast"], ("compile.mode",), "Choose one of"),
    (["compile.fullgraph=true"], ("compile.mode", "compile.fullgraph", "compile.dynamic"), "which is off"),
    (["compile=reduce_overhead"], ("compile.mode",), "CUDA graphs"),
    (["profiler.active=0"], ("profiler.active",), "must be 1 or more"),
    (
        ["profile=true", "train.max_steps=4"],
        ("profile", "profiler.wait", "profiler.warmup", "profiler.active", "train.max_steps"),
        "wait + warmup + active = 5",
    ),
]


@pytest.mark.parametrize(("argv", "keys", "text"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_rejected_combination_names_keys_and_fix(argv: list[str], keys: tuple[str, ...], text: str) -> None:
    errors = [e for e in precheck(["scheduler.warmup_steps=1", *argv]) if e.keys == keys]
    assert errors, [str(e) for e in precheck(argv)]
    assert text in errors[0].message


def test_plus_profile_is_the_schema_key() -> None:
    assert command_line.normalize(["+profile=true", "+compile=default"]) == [
        "profile=true",
        "compile=default",
    ]
    assert precheck(["profile=true", "memory=checkpoint_attention", "compile=default"]) == []


@pytest.mark.parametrize("strategy", ["fsdp", "zero3", "tp"])
def test_the_micro_batch_search_is_accepted_under_sharding(strategy: str) -> None:
    """It runs on the sharded state (tests/integration/test_memory_runs.py runs each on two ranks)."""
    argv = ["launcher=local", "launcher.nproc=2", f"parallel={strategy}", "memory=auto_batch"]
    assert precheck(["scheduler.warmup_steps=1", *argv, "memory.max_memory_gb=4"]) == []
