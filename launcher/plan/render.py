"""The memory plan as people read it: byte counts in MiB/GiB and the dry run's per-part table."""

from __future__ import annotations

from typing import TYPE_CHECKING

from launcher.plan.planner import GiB, MemoryPlan, MiB

if TYPE_CHECKING:
    from rich.table import Table


def format_bytes(num: float) -> str:
    """Bytes as GiB (from 1 GiB up) or MiB."""
    return f"{num / GiB:.2f} GiB" if num >= GiB else f"{num / MiB:.1f} MiB"


def plan_table(memory: MemoryPlan) -> Table:
    """The plan as a rich table: one row per part, its size per device and how it was counted."""
    from rich.table import Table

    table = Table(box=None, padding=(0, 2, 0, 0))
    table.add_column("part")
    table.add_column("per device", justify="right")
    rows = (
        ("parameters", memory.parameters),
        ("gradients", memory.gradients),
        ("optimizer states", memory.optimizer_states),
        ("activations", memory.activations),
        ("buffers", memory.buffers),
    )
    for name, num in rows:
        table.add_row(name, format_bytes(num))
    table.add_row("[bold]total", f"[bold]{format_bytes(memory.total)}")
    if memory.host_bytes:
        table.add_row("[dim]host (offloaded)", f"[dim]{format_bytes(memory.host_bytes)}")
    return table
