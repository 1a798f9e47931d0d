"""Before launch, on a GPU: a planned memory per rank above the device's is an error naming priced fixes."""

from __future__ import annotations

from launcher.front import compose
from launcher.plan.fit import fixes, memory_error, too_large
from launcher.plan.planner import plan
from launcher.rules import memory as memory_rules
from launcher.rules.hardware import Hardware
from launcher.spec import RunSpec, to_spec

GiB = 1024**3

BIG = [
    "model.n_layer=32",
    "model.d_model=4096",
    "model.n_head=32",
    "data.seq_len=2048",
    "train.micro_batch_size=4",
]


def _spec(overrides: list[str]) -> RunSpec:
    """The spec `train` would build from these overrides (not validated against this machine)."""
    return to_spec(compose.strip_hydra(compose.compose(overrides)))


def test_a_plan_too_large_for_the_gpu_is_an_error_listing_priced_fixes() -> None:
    spec = _spec([*BIG, "launcher.nproc=8"])  # ~6.5B parameters, whole fp32 Adam states per rank
    memory = plan(spec, device_type="cuda")
    assert not too_large(memory, memory.total) and too_large(memory, memory.total - 1)
    assert not too_large(memory, 0)  # unknown device memory: no judgement
    h100 = 80 * GiB
    found = fixes(spec)
    assert [f.overrides[0] for f in found[:4]] == [
        "memory.activation_checkpointing=blocks", "optimizer=adamw_8bit", "parallel=fsdp", "parallel=zero3_offload",
    ]  # fmt: skip
    assert all(f.total < memory.total for f in found)
    assert "parallel=fsdp" not in found[-1].overrides  # together: zero3_offload replaces fsdp
    error = memory_error(memory, h100, found)
    assert error is not None and "exceeds the 80.00 GiB" in error.message
    assert "parallel=fsdp: " in error.message and "(fits)" in error.message
    assert memory_error(memory, memory.total, found) is None


def test_the_memory_rule_judges_only_a_gpu() -> None:
    spec = _spec(BIG)
    gpu = Hardware(device_type="cuda", bf16=True, tf32=True, num_gpus=1, gpu_memory_bytes=80 * GiB)
    (error,) = memory_rules._fits_device(spec, gpu)
    assert error.keys == ("train.micro_batch_size", "launcher.device")
    assert "parallel=fsdp" not in error.message  # one rank: nothing to shard over, offload instead
    assert "parallel=zero3_offload" in error.message
    cpu = Hardware(device_type="cpu", bf16=True, tf32=False, num_gpus=0)
    assert list(memory_rules._fits_device(spec, cpu)) == []
    assert list(memory_rules._fits_device(_spec([]), gpu)) == []  # the default tiny model fits
