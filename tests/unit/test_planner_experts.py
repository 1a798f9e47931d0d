"""The planner's Mixture-of-Experts counts: total and active parameters, a rank's expert shard under
parallel.ep_size, and the all-to-all bytes of a step, against hand counts and the simulation."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from launcher.front import cli, compose
from launcher.front.command_line import of
from launcher.plan import planner
from launcher.plan import states as model_states
from launcher.plan.experts import expert_plan
from launcher.rank.simulate import simulate
from launcher.spec import RunSpec

# gpt_moe_tiny: 4 blocks of d_model 128, each with 8 experts (top-2) of width 256, tied byte vocabulary
D, E, TOP_K, WIDTH, LAYERS = 128, 8, 2, 256, 4
EXPERT_PARAMS = LAYERS * E * 2 * D * WIDTH  # stacked w_up [E, d, f] and w_down [E, f, d] per block


def _spec(overrides: list[str], model: str = "model=gpt_moe_tiny") -> RunSpec:
    line = of([model, "launcher=local", *overrides])
    cfg, errors = compose.compose_checked(list(line.overrides), line.source)
    assert cfg is not None, errors
    built = compose.build(cfg)
    assert not built.errors, built.errors
    return built.spec


def test_expert_parallel_ranks_hold_their_share_of_the_experts() -> None:
    one = _spec(["parallel=ddp", "launcher.nproc=2"])
    total = model_states.count_params(one).total
    assert model_states.count_params(one).experts == EXPERT_PARAMS == 2_097_152
    ddp = _spec(["parallel=ddp", "launcher.nproc=2", "parallel.ep_size=2"])
    memory = planner.plan(ddp)
    # float32: the dense part and half the experts
    assert memory.parameters == 4 * (total - EXPERT_PARAMS // 2)
    assert memory.gradients == memory.parameters and memory.optimizer_states == 2 * memory.parameters
    # FSDP2 shards the slices over their replicas: a rank stores 1 / world of everything, as without experts
    fsdp = _spec(["parallel=fsdp", "launcher.nproc=4", "parallel.ep_size=2"])
    assert planner.plan(fsdp).parameters == 4 * total / 4
    experts = expert_plan(fsdp, planner.activation_shape(fsdp))
    assert (experts.local_experts, experts.stored_expert_params) == (4, EXPERT_PARAMS / 2 / 2)
    assert experts.num_active_params == total - LAYERS * (E - TOP_K) * 2 * D * WIDTH


def test_fsdp_gathers_a_layer_with_this_ranks_experts_only() -> None:
    dense = _spec(["parallel=fsdp", "launcher.nproc=4"])
    split = _spec(["parallel=fsdp", "launcher.nproc=4", "parallel.ep_size=4"])
    counts = model_states.count_params(dense)
    root = (256 + 256) * D + D  # token and position embeddings (the head tied), the final norm
    layer = (counts.total - root) / LAYERS
    fp32 = 4  # no mixed precision: FSDP2 gathers float32
    # the root, 1 + prefetch_layers gathered blocks, one block's unsharded gradient
    gathered = root * fp32 + 2 * layer * fp32 + layer * fp32
    assert model_states.model_states(dense, 4).buffers == pytest.approx(gathered)
    local_layer = layer - EXPERT_PARAMS * 3 / 4 / LAYERS  # a quarter of the experts under ep 4
    assert model_states.model_states(split, 4).buffers == pytest.approx(root * fp32 + 3 * local_layer * fp32)


@pytest.mark.parametrize("checkpointing", ["none", "blocks"])
def test_all_to_all_bytes_per_step(checkpointing: str) -> None:
    spec = _spec(["parallel=fsdp", "launcher.nproc=4", "parallel.ep_size=2", "train.micro_batch_size=2",
                  "data.seq_len=64", "train.grad_accum_steps=3", f"memory.activation_checkpointing={checkpointing}"])  # fmt: skip
    experts = expert_plan(spec, planner.activation_shape(spec))
    rows = 2 * 64 * TOP_K  # one micro batch's token copies
    passes = 2 if checkpointing == "blocks" else 1  # the recompute dispatches and combines again
    calls = LAYERS * 3 * (passes + 1)  # forward passes and one backward, per layer and micro batch
    dispatch, combine, counts = experts.all_to_alls
    assert (dispatch.num_bytes, dispatch.count) == (rows * D * 4, calls)
    assert (combine.num_bytes, combine.count) == (rows * D * 4, calls)
    assert (counts.num_bytes, counts.count) == (E * 8, LAYERS * 3 * passes)
    assert experts.sent_bytes_per_step == (2 * calls * rows * D * 4 + LAYERS * 3 * passes * E * 8) / 2
    notes = "\n".join(planner.plan(spec).notes)
    assert "4 per rank (ep 2)" in notes and "all-to-all per step" in notes


def test_the_simulation_moves_the_planned_all_to_alls() -> None:
    """gpt_moe_tiny at ep 2 under FSDP2 on 4 ranks: the simulated step's all-to-alls are the plan's, to the byte."""
    spec = _spec(["parallel=fsdp", "launcher.nproc=4", "parallel.ep_size=2", "model.n_layer=2",
                  "train.micro_batch_size=2", "data.seq_len=32"])  # fmt: skip
    (role,) = simulate(spec)
    simulated = Counter()
    for c in role.collectives:
        if c.op == "all_to_all":
            assert (c.group, c.group_size) == ("ep", 2)
            simulated[c.num_bytes] += c.count
    planned = Counter()
    for a in expert_plan(spec, planner.activation_shape(spec)).all_to_alls:
        planned[a.num_bytes] += a.count
    assert simulated == planned


QWEN3_30B_A3B = str(Path(__file__).parents[1] / "assets" / "qwen3_30b_a3b")  # config.json only, no weights


@pytest.mark.extended  # about a minute of CPU at idle: the all-to-all property above, at Qwen3-30B-A3B's shape
def test_qwen3_30b_a3b_on_64_gpus_at_ep_8_simulates_in_minutes(capsys: pytest.CaptureFixture) -> None:
    argv = [
        "model=hf", f"model.hf_config={QWEN3_30B_A3B}", "parallel=fsdp", "parallel.ep_size=8", "launcher.nnodes=8",
        "launcher.nproc=8", "launcher.rdzv_endpoint=node0:29400", "run_dir=/tmp/never", "precision=bf16",
        "data.seq_len=4096", "train.micro_batch_size=1", "launcher.device=cuda", "simulate_hardware=h200",
        "dry_run=simulate",
    ]  # fmt: skip
    started = time.perf_counter()
    assert cli.run(argv) == 0
    elapsed = time.perf_counter() - started
    out = " ".join(capsys.readouterr().out.split())
    for category in ("parameters", "gradients", "optimizer", "activations", "temporary", "total"):
        assert f" {category} " in out  # per-role memory, simulated beside planned
    # 48 MoE layers x (dispatch + combine) x (forward + backward), 4096 tokens x top 8 x 2048 x bf16 each
    assert "all_to_all ep 8 128.0 MiB 192" in out
    assert "planned all-to-all per step: 21.00 GiB sent per rank" in out
    assert "predicted on h200" in out and "tokens/s per GPU" in out
    assert elapsed < 300


@pytest.mark.parametrize(
    "overrides",
    [
        # ddp at ep 2: against a real run in the test below
        pytest.param(["parallel=fsdp", "launcher.nproc=4"], id="fsdp-ep2-4"),
    ],
)
def test_the_moe_plan_stays_within_10_percent_of_the_simulation(overrides: list[str]) -> None:
    """gpt_moe_tiny at ep 2: the plan's step (expert shards, routed copies) against the simulated step's peak."""
    spec = _spec([*overrides, "parallel.ep_size=2", "train.micro_batch_size=4", "data.seq_len=64"])
    (role,) = simulate(spec)
    memory = planner.plan(spec, device_type="cpu")
    ratio = (memory.step_peak or memory.total) / role.peak["total"]
    assert 0.90 <= ratio <= 1.10, f"planned / simulated = {ratio:.3f}"


@pytest.mark.extended  # 2 spawned ranks, 20-40 s here: the test above holds the plan to the simulation
def test_the_moe_plan_and_simulation_meet_a_real_expert_parallel_run(tmp_path: Path) -> None:
    """gpt_moe_tiny at ep 2 on 2 real gloo ranks (DDP), the same build and measured step as the simulation:
    the plan's step within the planner's bound of the real peak, the simulation within 5% of it."""
    import json

    import torch.multiprocessing as mp
    from test_simulate import _real_rank

    from conftest import free_port

    overrides = ["model=gpt_moe_tiny", "launcher=local", "parallel=ddp", "launcher.nproc=2", "parallel.ep_size=2",
                 "train.micro_batch_size=4", "data.seq_len=64"]  # fmt: skip
    mp.start_processes(
        _real_rank, args=(2, free_port(), overrides, str(tmp_path)), nprocs=2, start_method="spawn"
    )
    real = json.loads((tmp_path / "0.json").read_text())["peak"]["total"]
    spec = _spec(overrides[2:])
    memory = planner.plan(spec, device_type="cpu")
    assert 0.90 <= memory.step_peak / real <= 1.10, f"planned / real = {memory.step_peak / real:.3f}"
    (role,) = simulate(spec)
    assert role.peak["total"] == pytest.approx(real, rel=0.05)


@pytest.mark.parametrize("ep", [1, 2])
def test_a_hugging_face_moe_config_simulates_with_and_without_expert_parallelism(
    tmp_path: Path, ep: int
) -> None:
    """A tiny Qwen3-MoE config.json in float32 under FSDP2 on 2 ranks: transformers' own grouped-GEMM experts
    (ep 1) and the expert-parallel dispatch (ep 2) run on fake tensors; the all-to-alls are the plan's."""
    from moe_assets import moe_config

    moe_config("qwen3_moe").save_pretrained(tmp_path)
    spec = _spec([f"model.hf_config={tmp_path}", "parallel=fsdp", "launcher.nproc=2", f"parallel.ep_size={ep}",
                  "train.micro_batch_size=2", "data.seq_len=32"], model="model=hf")  # fmt: skip
    (role,) = simulate(spec)
    simulated = Counter()
    for c in role.collectives:
        if c.op == "all_to_all":
            simulated[c.num_bytes] += c.count
    planned = Counter()
    for a in expert_plan(spec, planner.activation_shape(spec)).all_to_alls:
        planned[a.num_bytes] += a.count
    assert simulated == planned and bool(planned) == (ep > 1)
