"""The built-in GPT with MoE blocks trains as one process under DDP, FSDP2 and expert parallelism.

Real gloo ranks, fp32, model=gpt_moe_tiny made small, 3 steps of a global batch of 8 sequences, the
auxiliary and z losses and loss-free balancing on. Default tier: parallel.ep_size=2 on 2 DDP ranks (each
holding 4 of the 8 experts, tokens dispatched by all-to-all) gives one process's per-step losses
(cross-entropy plus the auxiliary losses) to 1e-5, since the auxiliary losses are per sequence and the
bias update sums the step's expert counts over the ranks; its step-2 checkpoint resumes in one process
(ep 1) to 1e-5. Extended: plain DDP and FSDP2 match one process, DDP and ep 2 resume bitwise (the
checkpoints hold the routing biases), the ep 2 checkpoint resumes at ep 4, and `parallel=fsdp
parallel.ep_size=2` on 4 ranks (each expert slice sharded over its 2 replicas: every rank stores a quarter of
every parameter) matches one process, losses and clipping norms, and its checkpoint resumes bitwise, at ep 1
and at ep 4.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import TINY, assert_same_losses, losses, rank_losses, run_inline
from launcher.components.metrics import read_metrics

BASE = [
    *TINY, "model=gpt_moe_tiny", "model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.moe.d_ff=64",
    "model.moe.bias_update_rate=0.01", "train.max_steps=3", "train.eval_every=null", "checkpoint.every=2",
    "scheduler.warmup_steps=1",
]  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One process, the whole global batch of 8 sequences per step."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    assert run_inline([*BASE, "train.micro_batch_size=8"], run_dir) == 0
    return run_dir


@pytest.fixture(scope="module")
def ddp(reference, tmp_path_factory) -> tuple[list[str], Path]:
    """2 DDP ranks of 4 sequences each (checked against one process); its arguments and run directory."""
    args, run_dir = (
        [*BASE, "parallel=ddp", "train.micro_batch_size=4"],
        tmp_path_factory.mktemp("ddp") / "run",
    )
    assert_same_losses(rank_losses(args, run_dir), losses(reference))
    return args, run_dir


@pytest.mark.extended  # the expert-parallel test below runs the same job on 2 DDP ranks, experts split
def test_moe_ddp_matches_one_process(reference, ddp) -> None:
    """Per-step losses (cross-entropy + auxiliary losses) to 1e-5; the routing record sums over the ranks."""
    record = read_metrics(reference / "metrics.jsonl")[-1]
    assert read_metrics(ddp[1] / "metrics.jsonl")[-1]["moe_load/1"] == pytest.approx(record["moe_load/1"])


@pytest.mark.extended  # a further run of the DDP test's job; resume of the plain GPT is proved by test_local_ddp
def test_moe_ddp_resumes_bitwise_with_the_routing_biases(ddp, tmp_path) -> None:
    args, run_dir = ddp
    resumed = rank_losses([*args, f"resume={run_dir / 'checkpoints' / 'step_2'}"], tmp_path / "resumed")
    assert resumed == {3: losses(run_dir)[3]}


@pytest.mark.extended  # the DDP test above proves the property; FSDP2 shards the same blocks
def test_moe_fsdp_matches_one_process(reference, tmp_path) -> None:
    assert_same_losses(
        rank_losses([*BASE, "parallel=fsdp", "train.micro_batch_size=4"], tmp_path / "fsdp"),
        losses(reference),
    )


@pytest.fixture(scope="module")
def ep2(reference, tmp_path_factory) -> tuple[list[str], Path]:
    """Expert parallel 2 on 2 DDP ranks (each holding 4 of the 8 experts), checked against one process."""
    args = [*BASE, "parallel=ddp", "parallel.ep_size=2", "train.micro_batch_size=4"]
    run_dir = tmp_path_factory.mktemp("ep2") / "run"
    assert_same_losses(rank_losses(args, run_dir), losses(reference))
    return args, run_dir


def test_expert_parallel_matches_one_process_and_its_checkpoint_resumes_at_ep1(
    ep2, reference, tmp_path
) -> None:
    """Tokens to their experts' ranks by all-to-all: one process's losses; the checkpoint holds whole experts."""
    _, run_dir = ep2
    records = [read_metrics(d / "metrics.jsonl")[-1] for d in (run_dir, reference)]
    assert records[0]["param_bytes"] < records[1]["param_bytes"]  # each rank holds half the experts
    assert records[1]["moe_aux_loss"] > 0 and records[1]["moe_dropped_tokens"] == 0  # dropless
    assert records[0]["moe_load/1"] == pytest.approx(records[1]["moe_load/1"])  # summed over the ranks
    step_2 = run_dir / "checkpoints" / "step_2"
    assert run_inline([*BASE, "train.micro_batch_size=8", f"resume={step_2}"], tmp_path / "ep1") == 0
    assert losses(tmp_path / "ep1")[3] == pytest.approx(losses(run_dir)[3], rel=1e-5)


@pytest.mark.extended  # the ep 2 test above proves the checkpoint holds whole experts; ep 4 cuts them finer
def test_expert_parallel_resumes_bitwise_and_at_ep4(ep2, tmp_path) -> None:
    args, run_dir = ep2
    step_2 = run_dir / "checkpoints" / "step_2"
    assert rank_losses([*args, f"resume={step_2}"], tmp_path / "again") == {3: losses(run_dir)[3]}
    ep4 = [*BASE, "parallel=ddp", "parallel.ep_size=4", "train.micro_batch_size=2", f"resume={step_2}"]
    assert rank_losses(ep4, tmp_path / "ep4", nproc=4)[3] == pytest.approx(losses(run_dir)[3], rel=1e-5)


def _four(args: list[str], run_dir: Path) -> dict[int, float]:
    return rank_losses(args, run_dir, nproc=4)


FSDP_EP2 = [*BASE, "parallel=fsdp", "parallel.ep_size=2", "train.micro_batch_size=2"]


@pytest.fixture(scope="module")
def fsdp_ep2(reference, tmp_path_factory) -> Path:
    """parallel=fsdp parallel.ep_size=2 on 4 ranks (checked against one process); its run directory."""
    run_dir = tmp_path_factory.mktemp("fsdp_ep2") / "run"
    assert_same_losses(_four(FSDP_EP2, run_dir), losses(reference))
    norms = [
        [r["grad_norm"] for r in read_metrics(d / "metrics.jsonl") if "grad_norm" in r]
        for d in (run_dir, reference)
    ]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)  # the clipping norm counts every expert once
    return run_dir


@pytest.mark.extended  # the ep 2 DDP test above proves the dispatch; FSDP2 shards the experts over 4 ranks
def test_expert_parallel_under_fsdp2_shards_the_experts_and_resumes_at_ep1(
    fsdp_ep2, reference, tmp_path
) -> None:
    """Two groups of 2 split the experts; FSDP2 shards each slice over its 2 replicas: every rank stores a
    quarter of every parameter, experts included (their rows written by all 4 ranks, a quarter each)."""
    from launcher.components.files.dcp_reader import read_metadata

    ranked = read_metadata(fsdp_ep2 / "checkpoints" / "step_2" / "dcp" / ".metadata")
    assert (
        read_metrics(fsdp_ep2 / "metrics.jsonl")[-1]["param_bytes"] * 4
        == read_metrics(reference / "metrics.jsonl")[-1]["param_bytes"]
    )
    for key in ("model.blocks.0.mlp.w_up", "model.blocks.1.mlp.w_down"):
        chunks = ranked.state_dict_metadata[key].chunks
        assert ranked.state_dict_metadata[key].size[0] == 8  # whole experts
        assert sorted(c.offsets[0] for c in chunks) == [0, 2, 4, 6]  # 8 experts: 2 rows on each of 4 ranks
        assert all(c.sizes[0] == 2 for c in chunks)
    step_2 = fsdp_ep2 / "checkpoints" / "step_2"
    assert run_inline([*BASE, "train.micro_batch_size=8", f"resume={step_2}"], tmp_path / "ep1") == 0
    assert losses(tmp_path / "ep1")[3] == pytest.approx(losses(fsdp_ep2)[3], rel=1e-5)


@pytest.mark.extended  # a further run of the FSDP2 test's job; the ep 2 DDP tests prove resume and ep 4
def test_expert_parallel_under_fsdp2_resumes_bitwise_and_at_ep4(fsdp_ep2, tmp_path) -> None:
    step_2 = fsdp_ep2 / "checkpoints" / "step_2"
    assert _four([*FSDP_EP2, f"resume={step_2}"], tmp_path / "again") == {3: losses(fsdp_ep2)[3]}
    ep4 = [*BASE, "parallel=fsdp", "parallel.ep_size=4", "train.micro_batch_size=2", f"resume={step_2}"]
    assert _four(ep4, tmp_path / "ep4")[3] == pytest.approx(losses(fsdp_ep2)[3], rel=1e-5)
    norms = [read_metrics(d / "metrics.jsonl")[-1]["grad_norm"] for d in (tmp_path / "ep4", fsdp_ep2)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)  # one rank per expert: divided by the world once
