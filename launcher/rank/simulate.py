"""`dry_run=simulate` in a rank's terms: build the real job for one rank of each role on a fake process group, step it, measure it.

One process plays one representative rank of each distinct role (each pipeline rank; ranks that
differ only by their data shard or their place in a tensor-parallel group hold the same shapes and
are one role). Each is built through the same path as a real rank (launcher.rank.build's steps 1-6:
model, TP plan, checkpointing, FSDP2/DDP wrap, optimizer) on torch's fake process group (every
collective returns at once) under `FakeTensorMode` (tensors have shapes, dtypes and sizes but no
storage), so an 8B model at 64 ranks is built on a laptop. Two full steps run (forward, backward,
optimizer): the first creates the optimizer state, the second runs under torch's `MemTracker`,
which reports the peak by category, and under a dispatch mode that logs every collective with its
group and size. `measure` also runs on a real process group with real tensors (the tests compare
the two).

Three details make fake tensors and a fake group go through code written for real ones: the device
mesh's own index arithmetic runs on real tensors (torch computes a rank's coordinates with
`nonzero`, which a fake tensor cannot answer); a host read of a fake value (`bool(finite)` in
the guarded step) reads 1, that is true: the step is taken, and a Mixture-of-Experts model routes
as if balanced (launcher.rank.fake_values); and DTensor's sharding propagation,
which runs each op on fake tensors of the global shapes, gets a fake mode of its own. It takes
the active fake mode when there is one: a real rank has none and makes its own, which MemTracker
skips, but under the simulation's it counted those global tensors as this rank's (the whole float32
logits twice in the vocabulary-parallel loss's backward, where a real rank holds its slices).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from launcher.components.metrics import PhaseTimer
from launcher.parallel.dims import DistContext, ParallelDims
from launcher.rank.build import build_trainable, seed_everything
from launcher.rank.fake_values import FakeScalars
from launcher.rank.op_count import OpCounter, OpTally
from launcher.spec import RunSpec

CATEGORIES = {
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "temporary",
    "Other": "other",
}
"""torch's MemTracker reference types -> the names the report uses."""


COLLECTIVE_KINDS = (
    "allgather",
    "all_gather",
    "reduce_scatter",
    "allreduce",
    "all_reduce",
    "broadcast",
    "all_to_all",
    "alltoall",
    "send",
    "recv",
)
"""Names of the c10d ops that move data between ranks (waits, barriers and autograd wrappers are not counted)."""


class SimulationRefused(Exception):
    """The real job cannot be built at this world size (a shape, split or head count that does not fit)."""


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One kind of collective of a step: which op, over which group, how large, how often."""

    op: str
    """The collective (all_gather, reduce_scatter, all_reduce, ...)."""
    group: str
    """The mesh axis (or axes) of its group, or 'world'."""
    group_size: int
    """Ranks in the group."""
    num_bytes: int
    """The largest tensor it touches: the gathered output, the scattered input, the reduced buffer."""
    count: int
    """How many times one step issues it."""


@dataclass(frozen=True, kw_only=True)
class RoleResult:
    """What one role's representative rank measured over one step."""

    rank: int
    """The rank simulated."""
    role: str
    """Which ranks it stands for, in words."""
    num_ranks: int
    """How many ranks share its role."""
    peak: dict[str, int]
    """Bytes by category at the peak of the step, and 'total'."""
    collectives: tuple[Collective, ...]
    """Every collective of the step, grouped."""
    num_params: int
    """Parameters this rank holds (its shards)."""
    ops: tuple[OpTally, ...] = ()
    """Every kernel-launching operator of the measured step with its FLOPs and bytes (launcher.rank.op_count)."""


def roles(dims: ParallelDims) -> list[tuple[int, str, int]]:
    """(representative rank, description, number of ranks) of each distinct role: one per pipeline rank."""
    per_stage = dims.dp_size * dims.tp
    if dims.pp == 1:
        return [(0, "every rank", dims.world_size)]
    return [(p * per_stage, f"pipeline rank {p}", per_stage) for p in range(dims.pp)]


def _real(fn: Any) -> Any:
    """`fn` run with fake tensor creation switched off (the mesh's own tensors stay real)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return inner


@contextlib.contextmanager
def _real_meshes() -> Iterator[None]:
    """Run init_device_mesh and every DeviceMesh and mesh-layout method on real tensors while simulating; restored after."""
    from torch.distributed._mesh_layout import _MeshLayout
    from torch.distributed.device_mesh import DeviceMesh

    saved = []
    for cls in (DeviceMesh, _MeshLayout):
        for name, attr in list(vars(cls).items()):
            if isinstance(attr, staticmethod | classmethod):
                wrapped = type(attr)(_real(attr.__func__))
            elif isinstance(attr, property):
                wrapped = property(_real(attr.fget), attr.fset)
            elif callable(attr) and not isinstance(attr, type):
                wrapped = _real(attr)
            else:
                continue
            saved.append((cls, name, attr))
            setattr(cls, name, wrapped)
    from torch.distributed import device_mesh

    saved.append((device_mesh, "init_device_mesh", device_mesh.init_device_mesh))
    device_mesh.init_device_mesh = _real(device_mesh.init_device_mesh)
    try:
        yield
    finally:
        for cls, name, attr in saved:
            setattr(cls, name, attr)


@contextlib.contextmanager
def _propagation_in_its_own_fake_mode() -> Iterator[None]:
    """DTensor's global-shape propagation in a fake mode of its own, as on a real rank (MemTracker skips it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import _sharding_prop

    own_mode = FakeTensorMode(allow_non_fake_inputs=True)
    saved = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda inputs=None: own_mode
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = saved


@contextlib.contextmanager
def fake_job(world_size: int, rank: int) -> Iterator[None]:
    """This process as `rank` of `world_size` on torch's fake process group, with fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with (
            _real_meshes(),
            _propagation_in_its_own_fake_mode(),
            FakeTensorMode(allow_non_fake_inputs=True),
            FakeScalars(),
        ):
            yield
    finally:
        dist.destroy_process_group()


class CollectiveLog(TorchDispatchMode):
    """Count the collectives dispatched while active, by op, group and size."""

    def __init__(self, dims: ParallelDims, ep_size: int = 1) -> None:
        super().__init__()
        self.dims, self.ep_size, self.counts = dims, ep_size, Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional") and any(
            kind in func.__name__ for kind in COLLECTIVE_KINDS
        ):
            self._record(func, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, func: Any, args: tuple, kwargs: dict) -> None:
        leaves = tree_leaves((args, kwargs))
        num_bytes = max(
            (t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)), default=0
        )
        group = _group_of(leaves)
        ranks = (
            dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        )
        name, size = axis_name(ranks, self.dims, self.ep_size), len(ranks)
        op = func.__name__.split(".")[0].strip("_").replace("allgather_base", "all_gather")
        op = op.replace("reduce_scatter_base", "reduce_scatter").replace("allreduce", "all_reduce")
        op = "all_to_all" if op in ("alltoall_base", "all_to_all_single", "alltoall") else op
        self.counts[(op, name, size, num_bytes)] += 1

    def collectives(self) -> tuple[Collective, ...]:
        """The logged collectives, largest traffic first."""
        rows = [
            Collective(op=op, group=group, group_size=size, num_bytes=num_bytes, count=count)
            for (op, group, size, num_bytes), count in self.counts.items()
        ]
        return tuple(sorted(rows, key=lambda c: (-c.num_bytes * c.count, c.op, c.group)))


def _group_of(leaves: list[Any]) -> Any:
    """The process group a collective's arguments name (a ProcessGroup object or a group name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for leaf in leaves:
        if isinstance(leaf, dist.ProcessGroup):
            return leaf
        if isinstance(leaf, torch.ScriptObject):
            with contextlib.suppress(Exception):
                return dist.ProcessGroup.unbox(leaf)
        if isinstance(leaf, str):
            with contextlib.suppress(Exception):
                return _resolve_process_group(leaf)
    return None


def axis_name(ranks: list[int], dims: ParallelDims, ep_size: int = 1) -> str:
    """The mesh axis (or axes, joined by +) a group of `ranks` spans, read from its size and rank stride.

    Expert parallelism's groups (launcher.parallel.expert_parallel: cut from the data x context ranks) are
    `ep` (ep_size consecutive data ranks) and `ep_replica` (the data ranks holding the same experts).
    """
    if len(ranks) == dims.world_size:
        return "world"
    strides = {
        "tp": 1,
        "dp_shard": dims.tp,
        "dp_replicate": dims.tp * dims.dp_shard,
        "pp": dims.dp_size * dims.tp,
    }
    sizes = {"tp": dims.tp, "dp_shard": dims.dp_shard, "dp_replicate": dims.dp_replicate, "pp": dims.pp}
    step = ranks[1] - ranks[0] if len(ranks) > 1 else 1
    axes, size = [], 1
    for axis in ("tp", "dp_shard", "dp_replicate", "pp"):
        if sizes[axis] > 1 and (axes or strides[axis] == step) and size < len(ranks):
            axes.append(axis)
            size *= sizes[axis]
    if size == len(ranks):
        return "+".join(reversed(axes))
    data_ranks = dims.dp_shard * dims.cp  # the axis the expert mesh is cut from, dims.tp apart
    if ep_size > 1 and (len(ranks), step) == (ep_size, dims.tp):
        return "ep"
    if ep_size > 1 and (len(ranks), step) == (data_ranks // ep_size, dims.tp * ep_size):
        return "ep_replica"
    return f"{len(ranks)} ranks"


def _step_tracker() -> Any:
    """torch's MemTracker, told that a forward it sees again inside a step is an activation-checkpoint recompute.

    Its module tracker does not always see a recompute as part of backward (the first checkpointed
    block's recompute starts before any module's backward hook has run), and MemTracker then takes
    the second forward for a second iteration and refuses it. One step is tracked here, so a
    repeated forward can only be a recompute.
    """
    import weakref
    from copy import deepcopy

    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _ModState

    class StepTracker(MemTracker):
        def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:
                if self._ac_mod is None:
                    self._ac_mod, self._in_ac = weakref.ref(module), True
                snapshot = deepcopy(self.get_tracker_snapshot())
                self.memory_tracking[module].snapshots.setdefault(_ModState.PRE_FW_AC, []).append(snapshot)

        def _post_fw_hook(self, module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
            super()._post_fw_hook(module, inputs, outputs)
            if self._ac_mod is not None and self._ac_mod() is module:
                self._ac_mod, self._in_ac = None, False

        def _update_peak_stats(self, peak_state: Any) -> None:
            """The step's peak per device only (what `measure` reads). MemTracker also updates the peak of
            every module it has seen, a pass over all of them per operator: for a 48-layer MoE model about
            600 modules x 60,000 operators, 70% of the whole simulation's time."""
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = deepcopy(snap)

    return StepTracker()


def _step(spec: RunSpec, trainable: Any, vocab: int, device: torch.device) -> None:
    """One optimizer step over grad_accum_steps micro batches of random token ids, as the loop runs it."""
    batch, strategy = trainable.batch, trainable.strategy
    shape = (batch.micro_batch_size, spec.data.seq_len)
    normalizer = float(shape[0] * shape[1] * batch.grad_accum_steps)
    timer = PhaseTimer(device.type)
    for i in range(batch.grad_accum_steps):
        ids = torch.randint(0, vocab, shape, device=device)
        last = i == batch.grad_accum_steps - 1
        with contextlib.nullcontext() if last else strategy.no_sync():
            trainable.runner.forward_backward(
                {"input_ids": ids, "labels": ids.clone()}, normalizer, trainable.dtype, timer
            )
    strategy.step(loss_ok=torch.ones((), dtype=torch.bool, device=device))


def measure(spec: RunSpec, ctx: DistContext, role: str = "every rank", num_ranks: int = 1) -> RoleResult:
    """Build this rank's job, take one step, then measure a second: peak bytes by category and collectives."""
    from launcher.config.model import vocab_size

    seed_everything(spec.train.seed)
    try:
        trainable = build_trainable(spec, ctx)
    except (ValueError, RuntimeError, AssertionError, IndexError) as error:
        raise SimulationRefused(
            f"the job does not build at rank {ctx.rank} of {ctx.world_size} ({role}): "
            f"{type(error).__name__}: {error}. A real rank would fail the same way after the job started; "
            "change the degrees or the model."
        ) from error
    vocab = min(vocab_size(spec.model) or 256, 256)
    _step(spec, trainable, vocab, ctx.device)  # creates the optimizer state
    _rebuild_ddp_buckets(trainable.strategy.parts)  # DDP's one bucket rebuild, before the measured step
    tracker = _step_tracker()
    tracker.track_external(*trainable.strategy.parts, trainable.strategy.optimizer)
    log, op_counter = CollectiveLog(ctx.dims, spec.parallel.ep_size), OpCounter()
    with tracker, log, op_counter:
        _step(spec, trainable, vocab, ctx.device)
    snapshot = tracker.get_tracker_snapshot("peak")
    peak = Counter()
    for per_device in snapshot.values():
        for kind, num_bytes in per_device.items():
            key = "total" if kind == "Total" else CATEGORIES.get(getattr(kind, "value", str(kind)), "other")
            peak[key] += int(num_bytes)
    num_params = sum(_local_numel(p) for part in trainable.strategy.parts for p in part.parameters())
    return RoleResult(
        rank=ctx.rank,
        role=role,
        num_ranks=num_ranks,
        peak=dict(peak),
        collectives=log.collectives(),
        num_params=num_params,
        ops=op_counter.tallies(),
    )


def _rebuild_ddp_buckets(parts: list[torch.nn.Module]) -> None:
    """Rebuild DDP's buckets in gradient-ready order now, as the next forward would (a steady step has them)."""
    from torch.nn.parallel import DistributedDataParallel

    from launcher.parallel.ddp_fake_group import rebuild_buckets

    for part in parts:
        if isinstance(part, DistributedDataParallel):
            rebuild_buckets(part)


def _local_numel(param: torch.Tensor) -> int:
    """Elements this rank stores of `param` (a DTensor's local shard)."""
    local = getattr(param, "to_local", None)
    return local().numel() if callable(local) else param.numel()


def simulate(spec: RunSpec) -> list[RoleResult]:
    """Every role's measurement on a fake process group of the spec's world size (SimulationRefused: not buildable)."""
    world = max(spec.launcher.world_size, 1)
    dims = ParallelDims.of(spec.parallel, world)
    results = []
    for rank, role, num_ranks in roles(dims):
        ctx = DistContext(rank=rank, world_size=world, local_rank=0, device=torch.device("cpu"), dims=dims)
        with fake_job(world, rank):
            results.append(measure(spec, ctx, role, num_ranks))
    return results
