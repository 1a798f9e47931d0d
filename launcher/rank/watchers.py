"""Rank 0's observers of a session, from the spec: log lines off a terminal, then each watching group's."""

from __future__ import annotations

from launcher.groups.observers import LogLines, Observer, Observers, RunContext
from launcher.spec import RunSpec


def build_observers(spec: RunSpec, context: RunContext) -> Observers:
    """The observers of this session on rank 0, in the order they see each record."""
    items: list[Observer] = []
    if not context.console.is_terminal and spec.log.progress:
        items.append(LogLines(context))
    return Observers(items)
