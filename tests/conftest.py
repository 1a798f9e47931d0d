"""Shared helpers: run `train` for real (a subprocess, or in-process for speed) on tiny settings."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from launcher.components.metrics import read_metrics
from launcher.front import compose, rundir

# A run small enough for tests: ~1-2 s of training on 2 CPU cores.
TINY = [
    "model.n_layer=2",
    "model.d_model=64",
    "model.n_head=2",
    "data.seq_len=32",
    "data.max_bytes=400000",
    "train.micro_batch_size=4",
    "train.max_steps=20",
    "train.log_every=1",
    "train.eval_every=10",
    "train.eval_batches=2",
    "scheduler.warmup_steps=2",
    "checkpoint.every=10",
    "log.progress=false",
    "log.summary_table=false",
]


@pytest.fixture(autouse=True, scope="session")
def _schemas() -> None:
    compose.register_schemas()


@pytest.fixture(scope="session")
def hf_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer (400 ids, chat template) trained here and saved in Hugging Face format."""
    from data_assets import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(autouse=True, scope="session")
def _token_cache(tmp_path_factory) -> None:
    """Keep tokenized corpora of the tests out of the user's cache directory."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))


DDP_LOCAL = [
    *TINY,
    "launcher=local",
    "parallel=ddp",
    "launcher.nproc=2",
    "checkpoint.every=5",
    "launcher.timeout_s=60",
]
"""Two local DDP ranks through `train` (20 steps, a checkpoint every 5): the run of the ddp_straight fixture."""


@pytest.fixture(scope="session")
def ddp_straight(tmp_path_factory) -> Path:
    """One uninterrupted `train` run of DDP_LOCAL: test_local_ddp.py's reference, and the run other files copy and
    damage or resume (one 2-rank launch for all; copy it before changing anything in it)."""
    base = tmp_path_factory.mktemp("ddp")
    result = run_cli([*DDP_LOCAL, f"run_dir={base / 'straight'}"], cwd=base)
    assert result.returncode == 0, result.stderr[-3000:]
    return base / "straight"


def run_cli(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    """`train ARGS` in a subprocess, as a user would run it."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_clis(
    argvs: list[list[str]], cwd: Path, env: dict[str, str] | None = None, timeout: int = 300
) -> list[subprocess.CompletedProcess]:
    """`train ARGS` for several independent ARGS, started together: on 2 cores their imports overlap."""
    with ThreadPoolExecutor(len(argvs)) as pool:
        return list(pool.map(lambda args: run_cli(args, cwd, env=env, timeout=timeout), argvs))


def write_spec(overrides: list[str], run_dir: Path) -> Path:
    """Compose, validate and write the run directory through `train`'s own launch sequence; its spec.yaml."""
    return rundir.prepare(overrides, run_dir)


def run_inline(overrides: list[str], run_dir: Path) -> int:
    """Run one rank in this process, as `train`'s inline backend does (launcher/launch/inline.py)."""
    return run_rank_here(write_spec(overrides, run_dir))


def run_rank_here(spec_path: Path) -> int:
    """worker.run in this process with the collector as `train`'s inline backend has it: paused for the build,
    and the objects alive before (this test session's) frozen, so no pass walks them (components/collector.py)."""
    from launcher.components import collector
    from launcher.rank import worker

    with collector.paused(), collector.frozen():
        return worker.run(spec_path)


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(
    overrides: list[str], run_dir: Path, nproc: int = 2, timeout: int = 300
) -> subprocess.CompletedProcess:
    """Run `nproc` real ranks of the worker under torch's elastic launcher (gloo on CPU), each started by
    `python -m launcher.rank` (the worker with its imports made while the collector is paused)."""
    spec = write_spec(overrides, run_dir)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "launcher.rank", str(spec),
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def assert_same_logits(state: dict, run_dir: Path, reference_dir: Path, step: int = 20) -> None:
    """A consolidated state dict loads strictly at world size 1 and matches a one-process run's model."""
    import torch

    from launcher.components.model.build import build_model
    from launcher.spec import load_spec

    spec = load_spec(run_dir / "spec.yaml")
    model = build_model(spec.model)
    model.load_state_dict(state, strict=True)
    single = build_model(spec.model)
    reference = reference_dir / "checkpoints" / f"step_{step}" / "model.pt"
    single.load_state_dict(torch.load(reference, weights_only=True))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), single(tokens), rtol=1e-4, atol=1e-4)


def losses(run_dir: Path) -> dict[int, float]:
    """step -> training loss from metrics.jsonl."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def rank_losses(args: list[str], run_dir: Path, nproc: int = 2, timeout: int = 900) -> dict[int, float]:
    """step -> training loss of `nproc` real ranks through the local backend (the run must succeed)."""
    proc = run_ranks(
        [*args, "launcher=local", f"launcher.nproc={nproc}"], run_dir, nproc=nproc, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return losses(run_dir)


def assert_same_losses(run: dict[int, float], reference: dict[int, float], steps: int = 3) -> None:
    """Both runs logged steps 1..steps, each loss equal to the reference's to 1e-5 (relative)."""
    assert run.keys() == reference.keys() == set(range(1, steps + 1))
    for step, loss in reference.items():
        assert run[step] == pytest.approx(loss, rel=1e-5), (step, run[step], loss)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` where no CUDA device is visible (CI has none)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def hf_teacher(tmp_path_factory) -> Path:
    """A folder that looks like a Hugging Face model of 300 token ids (distillation rules read config.json only)."""
    folder = tmp_path_factory.mktemp("hf_teacher")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 300}))
    (folder / "model.safetensors").write_bytes(b"")
    return folder
