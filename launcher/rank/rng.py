"""The random-number state of a rank (Python, NumPy, torch, CUDA), as a checkpoint stores it.

A checkpoint holds one `rng_rank{R}.pt` per rank that wrote it. A run resumed on more ranks than
that gives each rank without a file the state `derived_seed(seed, step, rank)` seeds: a pure
function of train.seed, the checkpoint's step and the rank, so a resume on any world size is
deterministic (the same checkpoint resumed twice on the same layout draws the same numbers).
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from launcher.components.files.safe_load import load_tensor_file


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states of this process, in weights_only-loadable types."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    random.setstate(tuple(x if not isinstance(x, list) else tuple(x) for x in state["python"]))
    kind, key, *rest = state["numpy"]
    np.random.set_state((kind, key.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def derived_seed(seed: int, step: int, rank: int) -> int:
    """The seed of a rank that has no saved RNG state: 63 bits of SHA-256 over (seed, step, rank)."""
    digest = hashlib.sha256(f"rng:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def restore_rng(directory: Path, *, rank: int, seed: int, step: int) -> None:
    """This rank's saved RNG state, or (a rank the checkpoint's run did not have) the derived one."""
    path = Path(directory) / f"rng_rank{rank}.pt"
    if path.is_file():
        set_rng_state(load_tensor_file(path))
        return
    derived = derived_seed(seed, step, rank)
    random.seed(derived)
    np.random.seed(derived % 2**32)
    torch.manual_seed(derived)  # seeds every CUDA device too
