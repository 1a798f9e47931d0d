"""The config groups' schemas: one module per group, each defining its config dataclass."""
