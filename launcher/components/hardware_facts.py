"""What CUDA offers the launching process, learned without importing torch where that is possible.

The launching process judges a spec against a handful of facts (is CUDA there, how many GPUs, the
first one's compute capability, bf16 and name, the smallest one's memory), and `import torch` to
learn them costs over a second: more than composing, validating and planning together. So:

1. no CUDA can exist (macOS; Linux without any GPU device file: /dev/nvidia*, /dev/dxg under WSL,
   /dev/kfd for ROCm; torch not installed): the facts say so and nothing is imported;
2. torch is already imported (a rank, a test): torch is asked, every time (never a stale answer);
3. otherwise the facts are read from $XDG_CACHE_HOME/launcher/hardware/<key>.json, where the key
   hashes everything that can change them: torch's build (its version.py), the NVIDIA driver
   version, the visible-device variables and the list of device files (MIG instances included).
   On a miss torch.cuda is asked once and the answer written for the next command.

A spec with `launcher.device=cpu` asks for none of this. A rank has torch loaded and so always asks
torch itself: a stale cached fact could only mislead the launching process (a rule's verdict, the
dry run, recipe=auto), never decide what a rank runs on. Delete the cache folder to probe again.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

FORMAT_VERSION = 1
"""Bumped when the cached file's fields change, so old files are not read."""
DEVICE_FILE_PATTERNS = ("/dev/nvidia*", "/dev/nvidia-caps/*", "/dev/dxg", "/dev/kfd")
"""Device files without which no CUDA (or ROCm) device can be opened on Linux."""
ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
"""Environment variables that change which devices torch sees."""


@dataclass(frozen=True, kw_only=True)
class CudaFacts:
    """What torch.cuda reports in this process."""

    available: bool = False
    """torch.cuda.is_available()."""
    num_gpus: int = 0
    """Visible CUDA devices (0 without CUDA)."""
    bf16: bool = False
    """The first device computes in bf16 natively (compute capability 8.0+)."""
    capability: tuple[int, int] = (0, 0)
    """Compute capability (major, minor) of the first device."""
    gpu_memory_bytes: int = 0
    """Total memory of the smallest visible device."""
    gpu_name: str = ""
    """Name of the first device."""


NO_CUDA = CudaFacts()


def _torch_dir() -> Path | None:
    """torch's package folder, found without importing it; None where torch is not installed."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def device_files() -> list[str]:
    """The GPU device files present, sorted (empty on a machine without GPUs)."""
    return sorted(path for pattern in DEVICE_FILE_PATTERNS for path in glob.glob(pattern))


def cuda_impossible() -> bool:
    """Whether this machine certainly has no CUDA device, decided without importing torch."""
    if sys.platform == "darwin" or _torch_dir() is None:
        return True
    return sys.platform.startswith("linux") and not device_files()


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def cache_key() -> str:
    """A hash of everything that can change the facts: torch's build, driver, visible devices, device files."""
    torch_dir = _torch_dir()
    parts = {
        "format": FORMAT_VERSION,
        "python": sys.executable,
        "torch": _read(torch_dir / "version.py") if torch_dir else "",
        "driver": _read("/proc/driver/nvidia/version"),
        "env": {key: os.environ.get(key) for key in ENV_KEYS},
        "devices": device_files(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def cache_path(key: str) -> Path:
    """Where the facts under `key` are kept: $XDG_CACHE_HOME/launcher/hardware/<key>.json."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "launcher" / "hardware" / f"{key}.json"


def probe() -> CudaFacts:
    """Ask torch.cuda (importing torch if need be)."""
    import torch

    if not torch.cuda.is_available():
        return NO_CUDA
    count = torch.cuda.device_count()
    return CudaFacts(
        available=True,
        num_gpus=count,
        bf16=torch.cuda.is_bf16_supported(including_emulation=False),
        capability=tuple(torch.cuda.get_device_capability(0)),
        gpu_memory_bytes=min(torch.cuda.get_device_properties(i).total_memory for i in range(count)),
        gpu_name=torch.cuda.get_device_name(0),
    )


def _load(path: Path) -> CudaFacts | None:
    try:
        data = json.loads(path.read_text())
        return CudaFacts(**{**data, "capability": tuple(data["capability"])})
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _save(path: Path, facts: CudaFacts) -> None:
    """Write atomically; a read-only or full cache directory only costs the next command a probe."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(facts)))
        os.replace(tmp, path)
    except OSError:
        pass


@functools.cache
def _cached_facts() -> CudaFacts:
    if cuda_impossible():
        return NO_CUDA
    path = cache_path(cache_key())
    facts = _load(path)
    if facts is None:
        facts = probe()
        _save(path, facts)
    return facts


def cuda_facts() -> CudaFacts:
    """What torch.cuda reports here: asked of torch once it is imported, else known or cached (see above)."""
    if "torch" in sys.modules:
        return probe()
    return _cached_facts()
