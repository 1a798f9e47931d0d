"""The per-operator roofline: each aten op of a step counted with its FLOPs and bytes (on fake tensors,
as the simulation runs them) and timed at the calibrated rate of its kind and shape; a step is the sum
of its ops, with the strategy's overlap of communication; `dry_run=simulate` prints it."""

from __future__ import annotations

import pytest
import torch
from test_simulate import SMALL, _spec
from torch._subclasses.fake_tensor import FakeTensorMode

from launcher.front import cli
from launcher.plan import calibration_h200
from launcher.plan.op_roofline import ACHIEVABLE, op_seconds, step_compute
from launcher.plan.roofline import HARDWARE, Traffic, collective_s, predict
from launcher.rank.op_count import OpCounter
from launcher.rank.simulate import simulate

H200, HOPPER = HARDWARE["h200"], ACHIEVABLE["h200"]


def _count(fn) -> list:
    """The ops `fn` dispatches on fake tensors it builds (no memory is allocated)."""
    with FakeTensorMode():
        counter = OpCounter()
        fn_inputs = fn()
        with counter:
            fn_inputs()
    return list(counter.tallies())


def test_a_large_matmul_is_compute_bound_at_its_measured_rate() -> None:
    def build():
        x = torch.empty(8192, 8192, dtype=torch.bfloat16)
        w = torch.empty(8192, 8192, dtype=torch.bfloat16)
        return lambda: torch.mm(x, w.t())  # a linear layer's forward: x @ W^T

    (op,) = _count(build)
    assert (op.kind, op.shape, op.layout) == ("matmul", (8192, 8192, 8192), "nt")
    assert op.flops == 2 * 8192**3 and op.num_bytes == 3 * 8192**2 * 2
    measured = next(r[4] for r in calibration_h200.GEMM_FLOPS if r[:4] == (8192, 8192, 8192, "nt"))
    assert op_seconds(op, H200, HOPPER) == pytest.approx(op.flops / measured + HOPPER.kernel_gap_s)
    assert op.num_bytes / H200.hbm_bytes_per_s < op.flops / measured / 10  # far from bandwidth-bound


def test_an_add_is_bandwidth_bound() -> None:
    def build():
        a, b = torch.empty(2**28, dtype=torch.bfloat16), torch.empty(2**28, dtype=torch.bfloat16)
        return lambda: (a + b, a.add_(b))

    ops = {op.name: op for op in _count(build)}
    for name in ("add", "add_"):  # read a and b, write the sum (in place: into a)
        assert ops[name].kind == "memory" and ops[name].num_bytes == 3 * 2**29 and ops[name].flops == 0
        bandwidth = HOPPER.elementwise_fraction * H200.hbm_bytes_per_s
        assert bandwidth == pytest.approx(calibration_h200.ELEMENTWISE_BYTES_PER_S)
        assert op_seconds(ops[name], H200, HOPPER) == pytest.approx(
            3 * 2**29 / bandwidth + HOPPER.kernel_gap_s
        )


def test_a_simulated_step_is_the_sum_of_its_ops_with_fsdp_traffic_overlapped() -> None:
    spec = _spec([*SMALL, "parallel=fsdp", "launcher.nproc=2", "precision=bf16"])
    (result,) = simulate(spec)
    kinds = {op.kind for op in result.ops}
    assert {"matmul", "attention_forward", "attention_backward", "norm", "memory"} <= kinds
    mm = next(op for op in result.ops if op.name == "mm")
    m, n, k = mm.shape
    assert mm.num_bytes == 2 * (m * k + k * n + m * n)  # bf16 operands, as autocast makes them on a GPU
    adam_bytes = sum(op.num_bytes * op.count for op in result.ops if op.name == "_fused_adamw_")
    # this rank's shards only (FSDP2's parameters are DTensors): read params, grads, m, v; write params, m, v
    assert adam_bytes == pytest.approx(7 * 4 * result.num_params, rel=0.01)
    compute = step_compute(result.ops, H200, HOPPER)
    assert compute.gpu_s == pytest.approx(sum(op_seconds(op, H200, HOPPER) * op.count for op in result.ops))
    assert compute.num_kernels == sum(op.count for op in result.ops)
    assert compute.step_s == max(compute.gpu_s, compute.num_kernels * HOPPER.cpu_issue_s)
    traffic = [
        Traffic(
            op=c.op,
            group=c.group,
            group_size=c.group_size,
            group_stride=1,
            num_bytes=c.num_bytes,
            count=c.count,
        )
        for c in result.collectives
    ]
    comm = sum(collective_s(t, H200) for t in traffic)
    assert comm > 0
    step = predict(hw=H200, model_flops_per_token=1.0, tokens_per_gpu=128, hbm_bytes=0.0, traffic=traffic,
                   wrap="fsdp", compute_s=compute.step_s)  # fmt: skip
    assert step.compute_s == compute.step_s
    assert step.step_s == pytest.approx(compute.step_s + max(comm - compute.step_s, 0.0))


def test_dry_run_simulate_prints_the_per_operator_step(capsys: pytest.CaptureFixture) -> None:
    assert cli.run([*SMALL, "launcher=inline", "dry_run=simulate", "simulate_hardware=h200"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "per operator: matmul" in text and "At datasheet peaks (an upper bound)" in text
    assert f"measured on one {calibration_h200.DEVICE}" in text
