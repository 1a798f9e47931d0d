"""Before launch, on a GPU: a planned memory per rank above the device's is an error naming priced fixes."""

from __future__ import annotations

from launcher.front import compose
from launcher.plan.fit import QLORA, fixes, memory_error, too_large
from launcher.plan.planner import plan
from launcher.plan.render import format_bytes
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
    assert [f.overrides[0] for f in found[:5]] == [
        "memory.activation_checkpointing=blocks", "optimizer=adamw_8bit", "parallel=fsdp", "parallel=fsdp_offload",
        "parallel=zero3_offload",
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


def test_a_too_big_plan_lists_qlora_and_fsdp_offload_priced_by_the_planner() -> None:
    eight = [*BIG, "launcher=local", "launcher.nproc=8"]
    spec = _spec([*eight, "parallel=ddp"])
    memory = plan(spec, device_type="cuda")
    found = fixes(spec)
    priced = {f.overrides: f.total for f in found}
    qlora = _spec([*eight, "parallel=ddp", "quantization=nf4_lora"])  # what the override composes to
    assert qlora.quantization == QLORA
    assert priced[("quantization=nf4_lora",)] == plan(qlora, device_type="cuda").total
    offload = plan(_spec([*eight, "parallel=fsdp_offload"]), device_type="cuda")
    assert priced[("parallel=fsdp_offload",)] == offload.total and offload.host_bytes > 0
    assert priced[("parallel=fsdp_offload",)] < priced[("parallel=fsdp",)] < memory.total
    assert priced[("quantization=nf4_lora",)] < memory.total / 1.5  # nf4 weights, the adapters' states only
    assert not any("quantization=nf4_lora" in o and len(o) > 1 for o in priced)  # alone, never combined
    error = memory_error(memory, 40 * GiB, found)
    assert error is not None
    for override in ("quantization=nf4_lora", "parallel=fsdp_offload"):
        assert f"{override}: {format_bytes(priced[(override,)])}" in error.message
    one_rank = {f.overrides[0] for f in fixes(_spec(BIG))}
    assert "quantization=nf4_lora" in one_rank and "parallel=fsdp_offload" not in one_rank  # shards nothing
    adapters = {f.overrides[0] for f in fixes(_spec([*BIG, "quantization=lora"]))}
    assert "quantization=nf4_lora" not in adapters  # already training adapters: not offered
