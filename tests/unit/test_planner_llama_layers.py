"""The planner's Llama-style layer terms against the simulation: what one more decoder layer of a Hugging
Face Llama adds to a rank's peak, simulated (the real build and step on fake tensors) and planned."""

from __future__ import annotations

import pytest

from launcher.front import compose
from launcher.front.command_line import of
from launcher.plan.planner import plan
from launcher.rank.simulate import simulate

LLAMA = ["model=hf_llama_tiny", "data.seq_len=64", "train.micro_batch_size=2", "launcher=local"]


def _totals(overrides: list[str], num_layers: int) -> tuple[int, int]:
    """(simulated, planned) tensor peak of one rank with `num_layers` decoder layers."""
    line = of([*overrides, f"model.n_layer={num_layers}"])
    cfg, errors = compose.compose_checked(list(line.overrides), line.source)
    assert cfg is not None, errors
    spec = compose.build(cfg).spec
    return simulate(spec)[0].peak["total"], plan(spec, device_type="cpu").total


@pytest.mark.parametrize(
    "overrides",
    [
        # RMSNorm's normalized output, the gated MLP's four tensors, SDPA's mask copy, each split by TP
        pytest.param(["parallel=tp", "parallel.tp_size=2", "launcher.nproc=2"], id="tp-2"),
        # the norms on sequence shards, the projections' input gathered whole
        pytest.param(
            ["parallel=tp", "parallel.tp_size=2", "parallel.sequence_parallel=true", "launcher.nproc=2"],
            id="tp-2-sequence-parallel",
        ),
        # autocast: a 16-bit copy of the float32 norm output per projection
        pytest.param(["parallel=single", "launcher.nproc=1", "precision=bf16"], id="single-bf16"),
    ],
)
def test_a_llama_layer_adds_what_the_simulation_adds(overrides: list[str]) -> None:
    (simulated_2, planned_2), (simulated_3, planned_3) = (_totals([*LLAMA, *overrides], n) for n in (2, 3))
    simulated, planned = simulated_3 - simulated_2, planned_3 - planned_2
    assert planned == pytest.approx(simulated, rel=0.01), (
        f"per layer: planned {planned}, simulated {simulated}"
    )
