"""Profiling: torch.profiler traces of a few training steps into RUN_DIR/profile/, and the top operators.

`profile=true` (or `+profile=true`) wraps the loop in torch.profiler with the schedule of the
`profiler` section: skip `wait` steps, warm up for `warmup`, record `active` steps, `repeat` times.
Each rank writes a Chrome/TensorBoard trace (`profile/rank<R>.<time>.pt.trace.json`) and its table
of top operators by self time (`profile/top_ops_rank<R>.txt`); rank 0 prints its table at the end.
The loop calls `step()` once per optimizer step; without profiling that call does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rich.console import Console

from launcher.config.profiler import ProfilerConfig

if TYPE_CHECKING:  # torch only where a rank profiles: the launching process never needs it
    import torch


class Stepper(Protocol):
    """What the loop sees: one `step()` per optimizer step."""

    def step(self) -> None: ...


class _Off:
    """Profiling off: `step()` does nothing."""

    def step(self) -> None:
        """Nothing to record."""


def sort_key(device_type: str) -> str:
    """The column the top-operator table is sorted by: self time on the device that computes."""
    return "self_cuda_time_total" if device_type == "cuda" else "self_cpu_time_total"


def top_ops_table(prof: torch.profiler.profile, device_type: str, row_limit: int) -> str:
    """The profiler's operator table, by self time, `row_limit` rows."""
    return prof.key_averages().table(sort_by=sort_key(device_type), row_limit=row_limit)


@contextlib.contextmanager
def profile(
    enabled: bool, cfg: ProfilerConfig, run_dir: Path, *, rank: int, device_type: str, console: Console
) -> Iterator[Stepper]:
    """Profile the loop inside this context when `enabled`; print and save the top operators at the end."""
    if not enabled:
        yield _Off()
        return
    import torch

    out = Path(run_dir) / "profile"
    out.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(
            wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=cfg.repeat
        ),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(out), worker_name=f"rank{rank}"),
        profile_memory=cfg.profile_memory,
        record_shapes=cfg.record_shapes,
        with_stack=cfg.with_stack,
    )
    with prof:
        yield prof
    if not list(out.glob(f"rank{rank}*.json")):
        if rank == 0:
            console.print(
                f"[yellow]profile: no trace written: the run ended before a full cycle of {cfg.steps_needed()} steps"
            )
        return
    table = top_ops_table(prof, device_type, cfg.top_ops)
    (out / f"top_ops_rank{rank}.txt").write_text(table + "\n")
    if rank == 0:
        console.print(f"profile: traces in {out} (open in https://ui.perfetto.dev or TensorBoard)")
        console.print(f"top operators by {sort_key(device_type).replace('_', ' ')}:", markup=False)
        console.print(table, markup=False, highlight=False, soft_wrap=True)
