"""A declarative, config-driven launcher for correct, fast, resumable PyTorch training."""

__version__ = "0.1.0"
