"""A model built on the meta device whose initial values are regenerated, one tensor at a time, into its shards.

Under FSDP2, tensor parallelism and pipelines no rank needs the whole model, yet an eager build
holds it on every rank before the strategy splits it. `build_on_meta` builds the model with its
parameters on the meta device while it records every operation that sets a parameter's values
(`normal_`, `uniform_`, `fill_`, `zero_`) together with torch's CPU random state just before it;
each random operation is also run once on a temporary tensor of the parameter's size, so the
global random state afterwards is the one an eager build leaves (whatever runs next draws the same
numbers). After the strategy has split the meta model, `MetaInit.fill` gives the parameters real
storage (`to_empty`) and, for each parameter, reruns the last operation that set it from the
recorded random state on one full-size temporary and copies this rank's shard out of it. The
values are bitwise those of the eager build; the peak is the rank's shards plus one whole
parameter. A constructor that does anything else to a parameter (an operation that reads its
values, such as `trunc_normal_`'s in-place arithmetic, or a copy) cannot be replayed this way:
`build_on_meta` then returns None and the caller builds eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

SILENT_ON_META = ("_no_grad_trunc_normal_", "dirac_", "orthogonal_", "sparse_")
"""torch.nn.init functions that return at once on a meta tensor: their values could not be replayed."""
SETTERS = {
    torch.ops.aten.normal_.default: True,
    torch.ops.aten.uniform_.default: True,
    torch.ops.aten.fill_.Scalar: False,
    torch.ops.aten.zero_.default: False,
}
"""In-place operations whose result depends only on the shape and the random state: whether each draws random numbers."""
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
"""Module-name parts activation checkpointing and compile insert (a parameter's name without them is the model's)."""


class _Scratch:
    """One reused buffer per dtype for the full-size temporaries: no allocator churn, so the heap does not grow."""

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def tensor(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of `shape` (uninitialised) in the reused buffer, grown when too small."""
        numel = shape.numel()
        buffer = self.buffers.get(dtype)
        if buffer is None or buffer.numel() < numel:
            buffer = self.buffers.pop(dtype, None)  # freed before the larger one is made
            del buffer
            buffer = self.buffers[dtype] = torch.empty(numel, dtype=dtype, device="cpu")
        return buffer[:numel].view(shape)


class NotReplayable(Exception):
    """The constructor touched a parameter in a way `fill` cannot regenerate."""


@dataclass
class _Op:
    """One recorded operation on a meta tensor."""

    target: torch.Tensor
    func: Any
    args: tuple
    kwargs: dict
    rng_state: torch.Tensor | None


class _Recorder(TorchDispatchMode):
    """Record each value-setting operation on a meta tensor, and advance the random state as an eager build would."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.scratch = _Scratch()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if target is None or target.device.type != "meta" or not func._schema.is_mutable:
            return func(*args, **kwargs)
        if func not in SETTERS or kwargs.get("generator") is not None:
            raise NotReplayable(f"{func} on a tensor of shape {tuple(target.shape)}")
        draws = SETTERS[func]
        state = torch.get_rng_state() if draws else None
        if (
            draws
        ):  # the same draws on a temporary of the same size: the global state moves on as in an eager build
            func(self.scratch.tensor(target.shape, target.dtype), *args[1:], **kwargs)
        self.ops.append(_Op(target=target, func=func, args=args[1:], kwargs=kwargs, rng_state=state))
        return target


def _clean(name: str) -> str:
    """A parameter's name with the wrappers' module-name parts removed."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@dataclass
class MetaInit:
    """How to regenerate the initial values of a model built on the meta device (see the module)."""

    last_op: dict[str, _Op] = field(default_factory=dict)
    """Per parameter name: the last operation that set its values."""

    def fill(self, part: nn.Module, device: torch.device) -> None:
        """Give `part` (a whole model or a stage, split or not) real storage on `device` and its initial values."""
        materialize(part, device)
        params = {_clean(name): p for name, p in part.named_parameters(remove_duplicate=False)}
        missing = [name for name in params if name not in self.last_op]
        if missing:
            raise NotReplayable(f"no recorded initialisation for {', '.join(missing[:3])}")
        done: set[int] = set()
        scratch = _Scratch()
        with torch.no_grad():
            for name, param in params.items():
                if id(param) in done:  # a tied weight, filled once
                    continue
                done.add(id(param))
                full = _regenerate(self.last_op[name], scratch)
                local, slices = _local_slices(param)
                local.copy_(full[slices].to(local.device))
                del full, local  # the scratch may grow for the next parameter: no view of it is kept


def _regenerate(op: _Op, scratch: _Scratch) -> torch.Tensor:
    """The full tensor `op` produced in the eager build, from its recorded random state (in `scratch`)."""
    full = scratch.tensor(op.target.shape, op.target.dtype)
    with torch.random.fork_rng(devices=[]):
        if op.rng_state is not None:
            torch.set_rng_state(op.rng_state)
        op.func(full, *op.args, **op.kwargs)
    return full


def _local_slices(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's storage of `param` and where it sits in the whole tensor (a DTensor's shard, or all of it)."""
    if not hasattr(param, "device_mesh"):
        return param.data, tuple(slice(None) for _ in param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))


def materialize(model: nn.Module, device: torch.device) -> None:
    """Real, uninitialised storage for the meta parameters on `device`, tied parameters kept one object."""
    shared: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                shared.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)
    for (first, first_name), *others in (group for group in shared.values() if len(group) > 1):
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]


def build_on_meta(construct: Callable[[], nn.Module]) -> tuple[nn.Module, MetaInit] | None:
    """`construct()` on the meta device with its initialisation recorded, or None where it cannot be replayed
    (torch's random state then put back as it was, so the eager build the caller makes draws what it would have)."""
    rng = torch.random.get_rng_state()
    recorder = _Recorder()
    saved = {name: getattr(nn.init, name) for name in SILENT_ON_META}

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise NotReplayable("an initialisation that does nothing on the meta device")

    try:
        for name in SILENT_ON_META:
            setattr(nn.init, name, refuse)
        with torch.device("meta"), recorder:
            model = construct()
    except NotReplayable:
        torch.random.set_rng_state(rng)
        return None
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)
    if any(True for _ in model.buffers()):  # buffers keep values computed at build: built eagerly
        torch.random.set_rng_state(rng)
        return None
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    init = MetaInit()
    for op in recorder.ops:  # a later operation on the same tensor overwrites an earlier one
        for name in names.get(id(op.target), ()):
            init.last_op[name] = op
    return model, init
