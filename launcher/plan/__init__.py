"""The memory planner: per-device bytes of a run from its spec alone."""
