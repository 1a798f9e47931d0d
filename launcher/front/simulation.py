"""`train dry_run=simulate`: build each role's rank on a fake process group and print what it measured.

Per role: peak memory by category beside the planner's figure, every collective of a step with its
group, size and count, and a predicted step time and MFU on `simulate_hardware`
(launcher.plan.roofline). A job that cannot be built at its world size (shapes, splits, heads) is
refused like every spec problem: one paragraph, exit status 2.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from launcher.components.model.build import flops_per_token
from launcher.components.model.shape import model_shape
from launcher.exits import ExitStatus
from launcher.front import rundir
from launcher.front.compose import Built
from launcher.parallel.dims import ParallelDims
from launcher.parallel.parallelize import data_parallel_wrap
from launcher.parallel.pipeline_split import bubble_fraction
from launcher.plan.experts import expert_notes, expert_plan
from launcher.plan.op_roofline import ACHIEVABLE, Compute, step_compute
from launcher.plan.planner import ALLOCATOR_SLACK, CUDA_CONTEXT_BYTES, MemoryPlan, activation_shape, plan
from launcher.plan.render import format_bytes
from launcher.plan.roofline import HARDWARE, Hardware, Prediction, Traffic, collective_s, predict
from launcher.spec import RunSpec, SpecError

if TYPE_CHECKING:
    from launcher.rank.simulate import RoleResult

PLANNER_ROWS = (
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("optimizer", "optimizer_states"),
    ("activations", "activations"),
    ("temporary", "buffers"),
)
"""(simulated category, planner field) in the order the table prints them."""


def run(built: Built) -> int:
    """Simulate a valid spec and print its tables; exit status 2 for a spec or build problem."""
    if built.errors:
        rundir.report(list(built.errors))
        return ExitStatus.INVALID_SPEC
    from launcher.rank import simulate

    spec = built.spec
    rundir.err_console.print(
        f"simulating {spec.launcher.world_size:,} rank(s) on a fake process group: one rank of each role is built "
        "and stepped ...",
        markup=False,
        soft_wrap=True,
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = simulate.simulate(spec)
    except simulate.SimulationRefused as refused:
        rundir.report([SpecError(("parallel", "model", "launcher.nproc", "launcher.nnodes"), str(refused))])
        return ExitStatus.INVALID_SPEC
    console = Console() if Console().is_terminal else Console(width=160)
    dims = ParallelDims.of(spec.parallel, max(spec.launcher.world_size, 1))
    hw = HARDWARE[spec.simulate_hardware]
    console.print(
        f"simulation: {dims.world_size} rank(s) (pp {dims.pp} x dp_replicate {dims.dp_replicate} x dp_shard "
        f"{dims.dp_shard} x tp {dims.tp}) on a fake process group with fake tensors; {len(results)} role(s)",
        highlight=False,
    )
    for result in results:
        planned = _planned(spec, dims, result.rank)
        console.print(
            f"rank {result.rank} ({result.role}, {result.num_ranks} rank(s)): "
            f"{result.num_params / 1e6:,.1f}M parameters held; peak memory by category",
            highlight=False,
        )
        console.print(_memory_table(result, planned), highlight=False)
        console.print(_device_line(result.peak.get("total", 0), hw, spec.simulate_hardware), highlight=False)
        compute = step_compute(result.ops, hw, ACHIEVABLE[spec.simulate_hardware]) if result.ops else None
        bound = _prediction(spec, dims, result, hw)
        prediction = _prediction(spec, dims, result, hw, compute) if compute else bound
        console.print(_collective_table(result, dims, hw, spec.parallel.ep_size), highlight=False)
        experts = expert_plan(spec, activation_shape(spec, device_type="cpu"))
        for note in expert_notes(experts, hw, spec.simulate_hardware) if experts else ():
            console.print(f"planned {note}", highlight=False, markup=False)
        line = _prediction_line(prediction, bound, compute, spec.simulate_hardware)
        console.print(line, highlight=False, markup=False)
    console.print(
        "simulated on CPU kernels: attention activations follow the CPU path (see docs/planner.md); "
        "the planner's figure is its CPU tensor bytes. Nothing was started and nothing was written.",
        style="dim",
    )
    return ExitStatus.OK


def _planned(spec: RunSpec, dims: ParallelDims, rank: int) -> MemoryPlan:
    """The planner's tensor bytes for `rank` (its pipeline rank's plan under a pipeline)."""
    if dims.pp == 1:
        return plan(spec, device_type="cpu")
    from launcher.front.dryrun import pipeline_layout
    from launcher.plan.pipeline import pipeline_plan

    return pipeline_plan(spec, pipeline_layout(spec)).ranks[dims.pp_rank(rank)].memory


def _memory_table(result: RoleResult, planned: MemoryPlan) -> Table:
    """Peak bytes by category, simulated beside planned."""
    table = Table(box=None, padding=(0, 2, 0, 0))
    for column in ("category", "simulated", "planner"):
        table.add_column(column, justify="left" if column == "category" else "right")
    peak = result.peak
    for name, field in PLANNER_ROWS:
        simulated = peak.get(name, 0) + (peak.get("buffers", 0) + peak.get("other", 0)) * (
            name == "temporary"
        )
        table.add_row(name, format_bytes(simulated), format_bytes(getattr(planned, field)))
    table.add_row("total", format_bytes(peak.get("total", 0)), format_bytes(planned.total))
    return table


def device_bytes(tensor_bytes: int) -> int:
    """A GPU's memory for `tensor_bytes` of live tensors: the planner's allowances (fragmentation, CUDA context)."""
    return round(tensor_bytes * (1 + ALLOCATOR_SLACK) + CUDA_CONTEXT_BYTES)


def _device_line(tensor_bytes: int, hw: Hardware, key: str) -> str:
    """The simulated peak as a GPU would hold it, against the named device's memory."""
    need = device_bytes(tensor_bytes)
    verdict = "fits" if need <= hw.memory_bytes else "does NOT fit"
    return (
        f"on a GPU: about {format_bytes(need)} (tensors + {ALLOCATOR_SLACK:.0%} allocator fragmentation + "
        f"{format_bytes(CUDA_CONTEXT_BYTES)} CUDA context); {verdict} in {key}'s {format_bytes(hw.memory_bytes)}"
    )


def _traffic(result: RoleResult, dims: ParallelDims, ep_size: int = 1) -> list[Traffic]:
    """The result's collectives with their groups' rank strides (for the roofline's NVLink/network choice)."""
    strides = {
        "tp": 1,
        "dp_shard": dims.tp,
        "dp_replicate": dims.tp * dims.dp_shard,
        "pp": dims.dp_size * dims.tp,
        "ep": dims.tp,
        "ep_replica": dims.tp * ep_size,
    }
    return [
        Traffic(
            op=c.op,
            group=c.group,
            group_size=c.group_size,
            group_stride=strides.get(c.group.split("+")[-1], 1),
            num_bytes=c.num_bytes,
            count=c.count,
        )
        for c in result.collectives
    ]


def _collective_table(result: RoleResult, dims: ParallelDims, hw: Hardware, ep_size: int = 1) -> Table:
    """Every collective of one step: op, group, ranks, size, count, time on the hardware."""
    table = Table(title="collectives per step", title_justify="left", box=None, padding=(0, 2, 0, 0))
    for column in ("op", "group", "ranks", "size", "count", "time"):
        table.add_column(column, justify="left" if column in ("op", "group") else "right")
    for collective, traffic in zip(result.collectives, _traffic(result, dims, ep_size), strict=True):
        table.add_row(
            collective.op,
            collective.group,
            str(collective.group_size),
            format_bytes(collective.num_bytes),
            str(collective.count),
            f"{collective_s(traffic, hw) * 1e3:,.2f} ms",
        )
    if not result.collectives:
        table.add_row("none", "", "", "", "", "")
    return table


def _prediction(
    spec: RunSpec, dims: ParallelDims, result: RoleResult, hw: Hardware, compute: Compute | None = None
) -> Prediction:
    """The roofline's step for this role's rank: per operator where `compute` is given, else at peak rates."""
    p = spec.parallel
    tokens = (
        spec.train.micro_batch_size * spec.data.seq_len * spec.train.grad_accum_steps / (dims.tp * dims.pp)
    )
    peak = result.peak
    bf16_params = 2.0 * model_shape(spec.model).num_params / (dims.tp * dims.pp)
    shard_states = peak.get("parameters", 0) + peak.get("optimizer", 0)
    hbm = 3.0 * peak.get("activations", 0) + 3.0 * bf16_params + 2.0 * shard_states
    bubble = (
        bubble_fraction(p.pp_size, p.pp_microbatches, p.pp_schedule, p.pp_stages_per_rank)
        if dims.pp > 1
        else 0
    )
    return predict(
        hw=hw,
        model_flops_per_token=flops_per_token(spec.model, spec.data.seq_len),
        tokens_per_gpu=tokens,
        hbm_bytes=hbm,
        traffic=_traffic(result, dims, p.ep_size),
        wrap=data_parallel_wrap(spec, dims),
        bubble=bubble,
        compute_s=compute.step_s if compute else None,
    )


def _prediction_line(prediction: Prediction, bound: Prediction, compute: Compute | None, key: str) -> str:
    """The predicted step on the named hardware: per operator at achievable rates, and the peak bound."""
    hw = HARDWARE[key]
    head = (
        f"predicted on {key} ({hw.name}): step {prediction.step_s * 1e3:,.0f} ms = compute "
        f"{prediction.compute_s * 1e3:,.0f} ms"
    )
    if compute is not None:
        kinds = ", ".join(f"{kind} {s * 1e3:,.0f} ms" for kind, s in compute.by_kind_s.items())
        head += (
            f" (per operator: {kinds}; {compute.num_kernels:,} kernels, eager issue {compute.cpu_s * 1e3:,.0f} ms "
            f"of CPU)"
        )
    return (
        f"{head} + exposed communication {prediction.exposed_comm_s * 1e3:,.0f} ms "
        f"(of {prediction.comm_s * 1e3:,.0f} ms); {prediction.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
        f"MFU {prediction.mfu:.0%}. At datasheet peaks (an upper bound): {bound.tokens_per_s_per_gpu:,.0f} tokens/s "
        f"per GPU, MFU {bound.mfu:.0%}. Achievable rates: {ACHIEVABLE[key].source}."
    )
