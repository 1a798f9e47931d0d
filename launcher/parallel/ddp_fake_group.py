"""DDP on torch's fake process group (dry_run=simulate): the real reducer and buckets, where the group delivers nothing.

Three places of DDP read what a real group delivers, and each is met here without changing what a
rank holds or sends:

- the start's parameter shape check and broadcast from rank 0 read tensor data: they are skipped
  (`init_sync=False`; every rank builds the same weights from the same seed);
- the reducer takes each bucket's all-reduced value from the work's future, which the fake group
  completes with nothing: a hook does what the built-in one does (divide the bucket by the group's
  size, all-reduce it in place) and completes with the bucket;
- the one rebuild of the buckets in gradient-ready order (at the forward after the first synced
  backward) has rank 0 broadcast the new bucket indices, which the reducer writes and reads through
  host pointers: those small integer tensors are made real while the bucket buffers stay fake.
"""

from __future__ import annotations

import contextlib
import functools
import typing
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["prepare", "rebuild_buckets", "simulated"]

_INTEGER_DTYPES = (torch.int32, torch.int64)


def simulated(group: dist.ProcessGroup | None) -> bool:
    """Whether `group` (None: the default group) is torch's fake process group."""
    return dist.get_backend(group) == "fake"


def _allreduce(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The reducer's built-in hook (divide the bucket by the group's size, all-reduce it in place), completed at once."""
    buffer = bucket.buffer()
    buffer.div_(group.size())
    dist.all_reduce(buffer, group=group)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


# DDP checks a hook's annotations as objects, not as the strings this module's annotations are
_allreduce.__annotations__ = typing.get_type_hints(_allreduce)


class _RealIntegerFactories(TorchDispatchMode):
    """Create empty integer tensors as real tensors while fake tensors are on (the reducer's bucket indices)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        kwargs = kwargs or {}
        if func is torch.ops.aten.empty.memory_format and kwargs.get("dtype") in _INTEGER_DTYPES:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _real_integer_factories() -> Iterator[None]:
    """`_RealIntegerFactories` while fake tensors are on; nothing otherwise."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    faking = any(isinstance(mode, FakeTensorMode) for mode in _get_current_dispatch_mode_stack())
    with _RealIntegerFactories() if faking else contextlib.nullcontext():
        yield


def prepare(model: DistributedDataParallel) -> None:
    """Install the completing all-reduce hook and run each forward's bucket bookkeeping with real indices."""
    model.register_comm_hook(model.process_group, _allreduce)
    pre_forward = model._pre_forward

    @functools.wraps(pre_forward)
    def with_real_indices(*args: Any, **kwargs: Any) -> Any:
        with _real_integer_factories():
            return pre_forward(*args, **kwargs)

    model._pre_forward = with_real_indices


def rebuild_buckets(model: DistributedDataParallel) -> None:
    """Rebuild the buckets in gradient-ready order now (real or fake group), as the next forward would."""
    with _real_integer_factories():
        if model.reducer._rebuild_buckets():
            model._has_rebuilt_buckets = True
