"""`dry_run=simulate` against the real thing: the same build on a fake process group with fake tensors
measures the tensor memory and the collectives of a real CPU run (gloo, real tensors) of the same
spec; a job that does not build at its world size exits 2; the roofline's arithmetic."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from conftest import free_port
from launcher.components import collector
from launcher.front import cli, compose
from launcher.front.command_line import of
from launcher.front.dryrun import pipeline_layout
from launcher.parallel.dims import ParallelDims
from launcher.plan.pipeline import pipeline_plan
from launcher.plan.planner import plan
from launcher.plan.roofline import HARDWARE, Traffic, collective_s, predict
from launcher.rank.simulate import simulate
from launcher.spec import RunSpec

SMALL = ["model=gpt_tiny", "model.n_layer=2", "data.seq_len=64", "train.micro_batch_size=2", "launcher=local"]
LLAMA_8B = str(Path(__file__).parents[1] / "assets" / "llama3_8b")


def _spec(overrides: list[str]):
    line = of(overrides)
    cfg, errors = compose.compose_checked(list(line.overrides), line.source)
    assert cfg is not None, errors
    built = compose.build(cfg)
    assert not built.errors, built.errors
    return built.spec


CASES: list[tuple[str, list[str], int]] = [
    ("fsdp-2", ["parallel=fsdp"], 2),
    # a 65,536-id vocabulary: the vocabulary-parallel loss's float32 slices are most of the peak
    ("tp-2", ["parallel=tp", "parallel.tp_size=2", "model.vocab_size=65536"], 2),
    ("ddp-2", ["parallel=ddp", "parallel.bucket_mb=1"], 2),  # two buckets: the rebuilt ones' sizes
    ("pp-2", ["parallel=pp", "parallel.pp_microbatches=2"], 2),
    ("llama-tp-2", ["model=hf_llama_tiny", "parallel=tp", "parallel.tp_size=2"], 2),
]
"""(name, overrides on top of SMALL, ranks) of each configuration whose simulation is checked against a real run."""
EXTENDED_CASES: list[tuple[str, list[str], int]] = [
    # one process, in the extended tier: ddp-2 holds the same unsharded model, optimizer state and activations,
    # with DDP's buckets and all-reduces on top
    ("single-1", ["parallel=single"], 1),
    # a Hugging Face Llama under FSDP2, in the extended tier: fsdp-2 holds FSDP2's simulation and llama-tp-2 a
    # folder model's path through the simulated build
    ("llama-fsdp-2", ["model=hf_llama_tiny", "parallel=fsdp"], 2),
]
FOUR_RANK_CASES: list[tuple[str, list[str], int]] = [
    ("pp_fsdp-4", ["parallel=pp_fsdp", "parallel.pp_microbatches=2"], 4),
    (  # the integration test's TINY shape, 4 layers
        "pp_ddp-4",
        ["parallel=ddp", "parallel.pp_size=2", "train.micro_batch_size=4", "model.n_layer=4", "model.d_model=64",
         "model.n_head=2", "data.seq_len=32", "parallel.bucket_mb=0.05"],
        4,
    ),
]  # fmt: skip
"""Pipelines with FSDP2 or DDP inside the stages: 4 real ranks, about a minute each here (marked extended)."""


def case_overrides(args: list[str], world: int) -> list[str]:
    """The full override list of a CASES row."""
    return [*SMALL, *args, f"launcher.nproc={world}"]


def _real_rank(rank: int, world: int, port: int, overrides: list[str], out: str) -> None:
    """One real gloo rank: the same build and measured step as the simulation, with real tensors."""
    import torch
    import torch.distributed as dist

    from launcher.parallel.dims import DistContext, ParallelDims
    from launcher.rank.simulate import measure

    compose.register_schemas()
    spec = _spec(overrides)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dims = ParallelDims.of(spec.parallel, world)
    ctx = DistContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), dims=dims)
    result = measure(spec, ctx)
    rows = [[c.op, c.group, c.group_size, c.num_bytes, c.count] for c in result.collectives]
    (Path(out) / f"{rank}.json").write_text(json.dumps({"peak": result.peak, "collectives": rows}))
    dist.barrier()
    dist.destroy_process_group()
    collector.freeze_for_exit()  # the spawned process ends: no last collections over torch and pytest's objects


@pytest.mark.parametrize(
    ("args", "world"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES]
    # a further variant of the pp-2 and fsdp-2/ddp-2 rows: the data-parallel wrap inside the stages
    + [
        pytest.param(*case[1:], id=case[0], marks=pytest.mark.extended)
        for case in EXTENDED_CASES + FOUR_RANK_CASES
    ],
)
def test_simulated_memory_and_collectives_match_a_real_run(
    tmp_path: Path, args: list[str], world: int
) -> None:
    overrides = case_overrides(args, world)
    mp.start_processes(
        _real_rank, args=(world, free_port(), overrides, str(tmp_path)), nprocs=world, start_method="spawn"
    )
    spec = _spec(overrides)
    roles = simulate(spec)
    assert len(roles) == spec.parallel.pp_size  # one role per pipeline rank
    for simulated in roles:  # each role against the real rank it stands for
        real = json.loads((tmp_path / f"{simulated.rank}.json").read_text())
        assert simulated.peak["total"] == pytest.approx(real["peak"]["total"], rel=0.05)
        rows = [[c.op, c.group, c.group_size, c.num_bytes, c.count] for c in simulated.collectives]
        assert rows == real["collectives"]
        assert (world == 1) == (not rows)  # a single rank talks to nobody; two ranks do


GPT_125M = ["model=gpt_125m", "data.seq_len=64", "train.micro_batch_size=2", "launcher=local"]
GPT_TINY_64K = [
    "model=gpt_tiny", "model.n_layer=2", "model.vocab_size=65536", "data.seq_len=256", "train.micro_batch_size=4",
    "launcher=local",
]  # fmt: skip
LLAMA_8B_64 = [
    "model=hf", f"model.hf_config={LLAMA_8B}", "parallel=tp_fsdp", "parallel.tp_size=8", "launcher.nnodes=8",
    "launcher.nproc=8", "launcher.rdzv_endpoint=node0:29400", "run_dir=/tmp/never", "precision=bf16",
    "data.seq_len=8192", "train.micro_batch_size=1",
]  # fmt: skip
PLANNER_DRIFT = [
    pytest.param([*SMALL, "parallel=single", "launcher.nproc=1"], id="gpt_tiny-single-1"),
    pytest.param([*SMALL, "parallel=fsdp", "launcher.nproc=2"], id="gpt_tiny-fsdp-2"),
    pytest.param([*SMALL, "parallel=tp", "parallel.tp_size=2", "launcher.nproc=2"], id="gpt_tiny-tp-2"),
    pytest.param(  # the vocabulary-parallel loss's float32 slices are most of the peak (0.64x without their term)
        [*GPT_TINY_64K, "parallel=tp", "parallel.tp_size=2", "launcher.nproc=2"], id="gpt_tiny-64k-tp-2"
    ),
    pytest.param([*GPT_125M, "parallel=single", "launcher.nproc=1"], id="gpt_125m-single-1"),
    pytest.param([*GPT_125M, "parallel=fsdp", "launcher.nproc=2"], id="gpt_125m-fsdp-2"),
    pytest.param([*SMALL, "model=hf_llama_tiny", "parallel=single", "launcher.nproc=1"], id="llama-single-1"),
    pytest.param([*SMALL, "model=hf_llama_tiny", "parallel=fsdp", "launcher.nproc=2"], id="llama-fsdp-2"),
    pytest.param(
        [*SMALL, "model=hf_llama_tiny", "parallel=tp", "parallel.tp_size=2", "launcher.nproc=2"],
        id="llama-tp-2",
    ),
    # about a minute at idle (four on a loaded machine): the property the rows above prove, at 64 ranks
    # the planner's total is its eager build (the whole float32 model, 30.38 GiB), which the simulation does not
    # measure; its step alone is 0.86x the simulated 26.71 GiB (docs/planner.md)
    pytest.param(
        LLAMA_8B_64,
        id="llama3_8b-fsdp8xtp8-64",
        marks=[
            pytest.mark.extended,
            # docs/planner.md: the step planned at 0.86x, 3.84 GiB short in the activations (the dense
            # causal mask transformers builds under fake tensors is the likely part, not measured)
            pytest.mark.xfail(strict=True, reason="8B step: planner 0.86x of the simulation"),
        ],
    ),
]
"""Specs on which the planner must agree with the simulation: one row per configuration (a pipeline
row is checked per pipeline rank against that rank's plan)."""


def _planned_total(spec: RunSpec, rank: int) -> int:
    """The planner's CPU tensor bytes of a step for `rank` (the spec's plan, or its pipeline rank's): the
    simulation measures a step, so the plan's build moment is left out."""
    dims = ParallelDims.of(spec.parallel, max(spec.launcher.world_size, 1))
    if dims.pp == 1:
        memory = plan(spec, device_type="cpu")
    else:
        memory = (
            pipeline_plan(spec, pipeline_layout(spec), device_type="cpu").ranks[dims.pp_rank(rank)].memory
        )
    return memory.step_peak or memory.total


@pytest.mark.parametrize("overrides", PLANNER_DRIFT)
def test_the_planner_stays_within_10_percent_of_the_simulation(overrides: list[str]) -> None:
    spec = _spec(overrides)
    for role in simulate(spec):
        ratio = _planned_total(spec, role.rank) / role.peak["total"]
        assert 0.90 <= ratio <= 1.10, f"rank {role.rank} ({role.role}): planned / simulated = {ratio:.3f}"


def test_a_job_that_does_not_build_at_64_ranks_exits_2(capsys: pytest.CaptureFixture) -> None:
    # Llama-3.1-8B has 8 key-value heads: 16 tensor-parallel ranks cannot split them
    argv = [
        "model=hf", f"model.hf_config={LLAMA_8B}", "parallel=tp_fsdp", "parallel.tp_size=16",
        "launcher.nnodes=8", "launcher.nproc=8", "launcher.rdzv_endpoint=node0:29400", "run_dir=/tmp/never",
        "data.seq_len=128", "train.micro_batch_size=1", "dry_run=simulate",
    ]  # fmt: skip
    assert cli.run(argv) == 2
    text = " ".join(capsys.readouterr().err.split())
    assert "16" in text and "head" in text


def test_what_the_fake_group_cannot_run_is_refused_before_building(capsys: pytest.CaptureFixture) -> None:
    refusals = [
        (["parallel=zero2"], "DeepSpeed (parallel.strategy=deepspeed) cannot run there"),
        (
            ["parallel=pp", "parallel.pp_schedule=interleaved_1f1b"],
            "steps the pipeline schedules gpipe, 1f1b",
        ),
        (["parallel=ddp", "parallel.comm_hook=fp16"], "the fp16 hook takes its result"),
        (["parallel=fsdp", "parallel.cp_size=2"], "does not split them over a context-parallel group"),
    ]
    for args, message in refusals:
        assert cli.run([*SMALL, *args, "launcher.nproc=2", "dry_run=simulate"]) == 2
        assert message in " ".join(capsys.readouterr().err.split())


def test_the_roofline_hides_fsdp_traffic_behind_compute_but_not_tensor_parallel_all_reduces() -> None:
    hw = HARDWARE["h100_sxm"]
    gather = Traffic(
        op="all_gather", group="dp_shard", group_size=8, group_stride=1, num_bytes=2**30, count=1
    )
    across = Traffic(
        op="all_gather", group="dp_shard", group_size=8, group_stride=8, num_bytes=2**30, count=1
    )
    assert collective_s(gather, hw) == pytest.approx(7 / 8 * 2**30 / 450e9)
    assert collective_s(across, hw) == pytest.approx(7 / 8 * 2**30 / 50e9)  # spans nodes: the network
    reduce = Traffic(op="all_reduce", group="tp", group_size=8, group_stride=1, num_bytes=2**30, count=1)
    common = {"hw": hw, "model_flops_per_token": 6e10, "tokens_per_gpu": 8192, "hbm_bytes": 0.0}
    fsdp = predict(**common, traffic=[gather], wrap="fsdp")
    assert fsdp.exposed_comm_s == 0 and fsdp.step_s == pytest.approx(6e10 * 8192 / 989e12)
    assert fsdp.mfu == pytest.approx(1.0)  # a roofline at peak with nothing exposed
    tp = predict(**common, traffic=[reduce], wrap="none")
    assert tp.exposed_comm_s == pytest.approx(collective_s(reduce, hw))


def test_a_simulation_says_what_it_builds_before_it_starts(capsys: pytest.CaptureFixture) -> None:
    """A large layout takes a while on the fake group: a line says so before anything is built."""
    assert cli.run([*SMALL, "parallel=ddp", "launcher.nproc=2", "dry_run=simulate"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("simulating 2 rank(s) on a fake process group"), err
