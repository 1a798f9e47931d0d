"""The parallel group: the schema and the registry of strategies that adapt the loop's verbs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the model and its training state are spread over ranks."""

    strategy: str = "single"
    """single: one rank holds everything."""
