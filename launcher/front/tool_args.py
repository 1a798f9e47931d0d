"""The command line shared by the offline tools (train-export, train-merge, train-quantize, train-generate)."""

from __future__ import annotations

import argparse
from pathlib import Path


def tool_parser(
    prog: str, description: str, *, source: str, source_help: str, epilog: str | None = None
) -> argparse.ArgumentParser:
    """A tool's argument parser with its first positional: the run, checkpoint or folder it reads."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog)
    parser.add_argument(source, type=Path, help=source_help)
    return parser
