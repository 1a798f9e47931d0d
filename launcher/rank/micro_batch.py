"""Automatic micro-batch search: the largest micro batch that fits, the global batch kept by accumulation.

Before training, each rank runs a forward and backward pass of the model at doubling micro batch
sizes (1, 2, 4, ... up to a cap) and measures its peak memory. A size fits when it neither raises
torch.OutOfMemoryError (CUDA) nor peaks above the budget `memory.max_memory_gb` (peak allocated
bytes on CUDA; peak resident set size of the process on CPU, read from /proc after resetting the
high-water mark). A CPU never runs out of memory the way a GPU does (it swaps or the OOM killer
ends the process), so there the budget defaults to 80% of the memory available when the search
starts, shared by the ranks of the node. Freed memory that malloc keeps for reuse counts as
resident, which can only make the choice smaller, never too large. The micro batch must divide the per-rank batch
(micro x accum of the spec), so after doubling the search backs off through the divisors between
the last size that fit and the first that did not. Ranks take the smallest choice of any rank.
Optimizer state does not exist yet, so each try also holds a ballast of two fp32 values per
trainable parameter (AdamW's moments; an upper bound for 8-bit and SGD optimizers). Under
distillation the teacher is already on the device and each try runs its forward and the KD term too.
Under context parallel each rank tries its chunks of the sequences. On several ranks a size fits
only where it fits on every rank (a collective min after each try), so every rank tries the same
sizes in step: the collectives inside a try (context-parallel key/value gathers, tensor-parallel
all-reduces, FSDP2's all-gathers and reduce-scatters, ZeRO-3's) then match across ranks.

Sharded state is searched sharded: under FSDP2 the search runs on the wrapped model after
`fully_shard` (launcher.parallel.parallelize), under ZeRO-3 on DeepSpeed's engine after it has
partitioned the model (`fit_engine_micro_batch`), under tensor parallelism on the split model; the
ballast counts this rank's shard of each trainable parameter, and the measured peak holds this
rank's shards, the gathered blocks and the gradients as they are reduce-scattered.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from launcher.components.batch_split import BatchSplit
from launcher.components.files.records import read_micro_batch
from launcher.components.files.safe_load import RefusedFile
from launcher.components.model.context_parallel import shard_batch
from launcher.components.model.loss import model_inputs
from launcher.components.objectives import Objective
from launcher.components.objectives.cross_entropy import CrossEntropy
from launcher.components.precision import autocast
from launcher.config.model import vocab_size
from launcher.rank import host_memory
from launcher.spec import RunSpec

RECORD = "auto_micro_batch.json"
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_MEMINFO = Path("/proc/meminfo")


@dataclass(kw_only=True)
class Search:
    """What the search tried, measured and chose."""

    per_rank_batch: int
    """Sequences per rank per optimizer step, kept constant (micro x accum of the spec)."""
    seq_len: int
    """Tokens per sequence of every try."""
    budget_bytes: int | None
    """The memory budget per rank, or None (CUDA: out-of-memory errors only)."""
    cap: int
    """Largest micro batch tried."""
    tries: list[dict[str, Any]] = field(default_factory=list)
    """One record per try: micro_batch_size, peak_bytes, fits."""
    micro_batch_size: int = 0
    """The chosen micro batch."""
    grad_accum_steps: int = 0
    """Accumulation steps that keep the per-rank batch."""
    reason: str = ""
    """Why the search stopped where it did."""
    measured: str = ""
    """What the tries ran on: the whole model, this rank's FSDP2 shards or ZeRO-3 partitions, a TP split."""
    ballast_bytes: int = 0
    """The stand-in for the optimizer state each try held: 8 bytes per trainable element this rank holds."""

    def key(self) -> dict[str, Any]:
        """The inputs a recorded result depends on (a resumed run reuses a record only if they match)."""
        return {
            "per_rank_batch": self.per_rank_batch,
            "seq_len": self.seq_len,
            "budget_bytes": self.budget_bytes,
            "cap": self.cap,
        }


def local_numel(param: torch.Tensor) -> int:
    """Elements this rank holds of a parameter: its shard of an FSDP2/TP DTensor or a ZeRO-3 partition."""
    if hasattr(param, "ds_tensor"):  # DeepSpeed ZeRO-3: this rank's partition
        return int(param.ds_tensor.numel())
    to_local = getattr(param, "to_local", None)  # a DTensor: this rank's shard
    return int(to_local().numel()) if to_local is not None else param.numel()


def measured_state(model: nn.Module) -> str:
    """What a try runs on, in words: the state a training step holds on this rank."""
    params = list(model.parameters())
    if any(hasattr(p, "ds_tensor") for p in params):
        return "this rank's ZeRO-3 partitions"
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return "this rank's FSDP2 shards"
    if any(hasattr(p, "to_local") for p in params):
        return "this rank's tensor-parallel split"
    return "the whole model"


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        _CLEAR_REFS.write_text("5")  # resets VmHWM, the peak resident set size (Linux 4.0+)


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    match = re.search(r"VmHWM:\s+(\d+)\s+kB", _STATUS.read_text())
    return int(match.group(1)) * 1024 if match else 0


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        # freed heap pages back to the OS, so a CPU try's resident peak (VmHWM) is live memory plus
        # what the try allocates: glibc keeps freed chunks resident once its mmap threshold has risen,
        # which overstates the peak and hides what the try itself adds (elsewhere the peak stays that cautious)
        host_memory.release_free_heap()


def _try_size(
    model: nn.Module,
    spec: RunSpec,
    size: int,
    device: torch.device,
    dtype: torch.dtype,
    budget: int | None,
    objective: Objective | None = None,
    backward: Callable[[torch.Tensor], None] | None = None,
) -> tuple[bool, int]:
    """(fits, peak bytes) of one forward and backward pass at micro batch `size` (with the teacher's, if any;
    `backward`: the strategy's, where it owns it, as DeepSpeed's engine does)."""
    objective = objective or CrossEntropy()
    ids = torch.randint(0, vocab_size(spec.model), (size, spec.data.seq_len + 1), device=device)
    ballast_numel = 2 * sum(local_numel(p) for p in model.parameters() if p.requires_grad)
    _free(device)
    _reset_peak(device)
    out_of_memory = False
    try:
        ballast = torch.zeros(ballast_numel, dtype=torch.float32, device=device)  # zeros: pages touched
        with autocast(dtype, device.type):
            batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
            group = getattr(model, "context_parallel", None)
            if group is not None:  # this rank's chunks; the other ranks of its group run the same try
                batch = shard_batch(batch, group.rank, group.size)
            logits = model(**model_inputs(batch))
            # the objective's own state counts too (a teacher's logits and KL chunks, a training step's)
            loss_sum, count = objective.loss_sum(logits, batch)
            del logits
        (backward or torch.Tensor.backward)(loss_sum / count)
        del ballast, loss_sum, count
    except torch.OutOfMemoryError:
        out_of_memory = True  # handled below, outside the except block that holds the frames
    peak = _peak_bytes(device)
    nn.Module.zero_grad(model, set_to_none=True)  # DeepSpeed's engine overrides zero_grad without the flag
    _free(device)
    if out_of_memory:
        return False, peak
    return budget is None or peak <= budget, peak


def _budget_bytes(spec: RunSpec, device: torch.device) -> int | None:
    """memory.max_memory_gb in bytes; on CPU without one, 80% of the memory available now, shared by this node's ranks."""
    gb = spec.memory.max_memory_gb
    if gb is not None:
        return int(gb * 2**30)
    if device.type == "cuda":
        return None
    match = re.search(r"MemAvailable:\s+(\d+)\s+kB", _MEMINFO.read_text())
    available = int(match.group(1)) * 1024 if match else 0
    return int(0.8 * available / int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _candidates_between(per_rank: int, low: int, high: int) -> list[int]:
    """Divisors of the per-rank batch strictly between low and high, largest first."""
    return [d for d in range(min(high - 1, per_rank), low, -1) if per_rank % d == 0]


def _search(
    model: nn.Module,
    spec: RunSpec,
    device: torch.device,
    dtype: torch.dtype,
    search: Search,
    objective: Objective,
    backward: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """Fill `search` with tries and the choice."""

    def fits(size: int) -> bool:
        ok, peak = _try_size(model, spec, size, device, dtype, search.budget_bytes, objective, backward)
        ok = _agree(int(ok), device) == 1  # every rank takes the same next try (a collective min)
        search.tries.append({"micro_batch_size": size, "peak_bytes": peak, "fits": ok})
        return ok

    largest_fit, first_fail, size = 0, None, 1
    while size <= search.cap:
        if not fits(size):
            first_fail = size
            break
        largest_fit, size = size, size * 2
    if largest_fit == 0:
        raise RuntimeError(
            f"auto micro batch: even one sequence of {spec.data.seq_len} tokens does not fit "
            f"({_limit_text(search)}, peak {search.tries[0]['peak_bytes'] / 2**30:.2f} GiB). Turn on "
            "memory.activation_checkpointing, lower data.seq_len, or raise memory.max_memory_gb."
        )
    high = first_fail if first_fail is not None else search.cap + 1
    chosen = max(d for d in range(1, largest_fit + 1) if search.per_rank_batch % d == 0)
    for candidate in _candidates_between(search.per_rank_batch, largest_fit, high):
        if candidate > chosen and fits(candidate):
            chosen = candidate
            break
    search.micro_batch_size = chosen
    search.grad_accum_steps = search.per_rank_batch // chosen
    stop = (
        f"{first_fail} did not fit ({_limit_text(search)})"
        if first_fail
        else f"the cap {search.cap} was reached"
    )
    search.reason = (
        f"{stop}; {chosen} is the largest micro batch that fits and divides the per-rank batch "
        f"{search.per_rank_batch} (train.micro_batch_size x train.grad_accum_steps of the spec)"
    )


def _limit_text(search: Search) -> str:
    if search.budget_bytes is None:
        return "out of memory"
    return f"budget {search.budget_bytes / 2**30:.3g} GiB"


def _agree(size: int, device: torch.device) -> int:
    """The smallest choice of any rank, so every rank runs the same micro batch."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return size
    tensor = torch.tensor([size], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def _recorded(run_dir: Path | None, search: Search, *, is_main: bool = True) -> dict[str, Any] | None:
    """A previous session's result for the same inputs (resume keeps the same split); a record that does not
    read back as written is named on the console (rank 0) and searched again."""
    path = run_dir / RECORD if run_dir else None
    if path is None or not path.is_file():
        return None
    try:
        record = read_micro_batch(path)
    except RefusedFile as err:
        if is_main:
            print(f"warning: {err}", flush=True)
        return None
    return record if record["key"] == search.key() else None


def fit_micro_batch(
    model: nn.Module,
    spec: RunSpec,
    device: torch.device,
    dtype: torch.dtype,
    *,
    run_dir: Path | None = None,
    is_main: bool = True,
    objective: Objective | None = None,
    backward: Callable[[torch.Tensor], None] | None = None,
) -> BatchSplit:
    """The micro batch and accumulation the search chose for the spec's per-rank batch (the objective's state
    counts; tries run under autocast to `dtype`, the training dtype); `model` whole, split (TP) or sharded
    (FSDP2, a ZeRO-3 engine with its `backward`)."""
    objective = objective or CrossEntropy()
    t = spec.train
    search = Search(
        per_rank_batch=t.micro_batch_size * t.grad_accum_steps,
        seq_len=spec.data.seq_len,
        budget_bytes=_budget_bytes(spec, device),
        cap=min(spec.memory.max_micro_batch_size, t.micro_batch_size * t.grad_accum_steps),
    )
    previous = _recorded(run_dir, search, is_main=is_main)
    if previous is not None:
        search.micro_batch_size, search.reason = (
            previous["micro_batch_size"],
            "reused the choice recorded in " + RECORD,
        )
    else:
        search.measured = measured_state(model)
        search.ballast_bytes = 8 * sum(local_numel(p) for p in model.parameters() if p.requires_grad)
        if search.measured == "the whole model":
            model.to(device)  # sharded or split parameters were placed by their wrap
        rng = torch.get_rng_state(), torch.cuda.get_rng_state_all() if device.type == "cuda" else None
        _search(model, spec, device, dtype, search, objective, backward)
        objective.metrics(
            lambda sums: sums
        )  # the tries' sums (a distiller's CE and KD) are no training step's
        torch.set_rng_state(rng[0])  # dropout in the tries must not shift the training run's randomness
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])
    agreed = _agree(search.micro_batch_size, device)
    if agreed != search.micro_batch_size:
        search.reason += f"; another rank could fit only {agreed}, and all ranks use the smallest"
    search.micro_batch_size, search.grad_accum_steps = agreed, search.per_rank_batch // agreed
    if is_main:
        _report(search, run_dir, reused=previous is not None)
    return BatchSplit(micro_batch_size=search.micro_batch_size, grad_accum_steps=search.grad_accum_steps)


def _report(search: Search, run_dir: Path | None, *, reused: bool) -> None:
    """Print the choice and why; record it in the run directory."""
    tried = ", ".join(
        f"{t['micro_batch_size']} ({t['peak_bytes'] / 2**30:.2f} GiB {'fits' if t['fits'] else 'does not fit'})"
        for t in search.tries
    )
    print(
        f"auto micro batch: micro batch {search.micro_batch_size} x {search.grad_accum_steps} accumulation steps "
        f"= {search.per_rank_batch} sequences per rank per step, as the spec asks. "
        + (f"Tried {tried}, on {search.measured}. " if tried else "")
        + f"Why: {search.reason}.",
        flush=True,
    )
    if run_dir is not None and not reused:
        record = {**dataclasses.asdict(search), "key": search.key()}
        (run_dir / RECORD).write_text(json.dumps(record, indent=2) + "\n")
