"""Asynchronous checkpoint saves (checkpoint.async_save): the same bytes and the same exact resume as
a synchronous save, a commit only once every rank has written, and a SIGKILL during the background
write that leaves the previous checkpoint the newest complete one. Real runs, real ranks (gloo),
real files, a real SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import TINY, free_port, losses, read_metrics, run_cli, run_inline, run_ranks
from launcher.components import checkpoint
from launcher.components.checkpoint_files import content_problem, read_manifest

SHORT = [*TINY, "train.max_steps=12", "checkpoint.every=4", "train.eval_every=null"]


def _hashes(step_dir: Path) -> dict[str, str]:
    return {name: entry["xxh3_128"] for name, entry in read_manifest(step_dir)["files"].items()}


def _resume_from(run_dir: Path, copy: Path, step: int) -> Path:
    """A copy of `run_dir` whose newer checkpoints are gone: resume=auto continues from `step`."""
    shutil.copytree(run_dir, copy)
    for newer in checkpoint.step_dirs(copy):
        if checkpoint.step_of(newer) > step:
            shutil.rmtree(newer)
    return copy


def test_an_async_save_writes_what_a_synchronous_one_does_and_resumes_exactly(tmp_path) -> None:
    background, blocking = tmp_path / "async", tmp_path / "sync"
    assert run_inline([*SHORT, "checkpoint.async_save=true"], background) == 0
    assert run_inline([*SHORT, "checkpoint.async_save=false"], blocking) == 0
    for step in (8, 12):  # staged copies hold the step's state: every file's bytes are the same
        name = f"checkpoints/step_{step}"
        assert _hashes(background / name) == _hashes(blocking / name)
        assert content_problem(background / name) is None
    held = {r["step"]: r["time_checkpoint_s"] for r in read_metrics(background / "metrics.jsonl") if "loss" in r
            and "time_checkpoint_s" in r}  # fmt: skip
    assert sorted(held) == [4, 8, 12] and all(seconds > 0 for seconds in held.values())
    resumed = _resume_from(background, tmp_path / "resumed", 8)  # written while steps 9.. trained
    assert run_inline([*SHORT, "resume=auto"], resumed) == 0
    assert json.loads((resumed / "summary.json").read_text())["resumed_from"].endswith("step_8")
    assert losses(resumed) == losses(background) == losses(blocking)  # bitwise, step by step


# In the extended tier: test_fsdp_tp.py::test_resume_is_exact[fsdp] resumes a 2-rank FSDP2 run bitwise from a DCP
# checkpoint its run wrote in the background (checkpoint.async_save is on by default).
@pytest.mark.extended
def test_a_two_rank_fsdp_run_saved_in_the_background_resumes_exactly(tmp_path) -> None:
    args = [*SHORT, "launcher=local", "launcher.nproc=2", "parallel=fsdp", "checkpoint.async_save=true"]
    straight = tmp_path / "straight"
    result = run_ranks(args, straight, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (straight / "checkpoints" / "step_8" / "dcp" / ".metadata").is_file()
    resumed = _resume_from(straight, tmp_path / "resumed", 8)
    result = run_ranks([*args, "resume=auto"], resumed, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert losses(resumed) == losses(straight)


# Two ranks of AsyncSaver on gloo: rank 0 commits step 1 in the background, before the loop waits;
# at step 2 rank 1's write fails (a directory stands where its file goes), so no rank commits.
_RANKS_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from launcher.components import checkpoint
    from launcher.components.checkpoint_async import AsyncSaver

    dist.init_process_group("gloo")
    rank, run_dir = dist.get_rank(), Path(sys.argv[1])

    def agree(ok):
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    saver = AsyncSaver(run_dir, rank=rank, world_size=2, keep=2, agree=agree, timeout_s=60)
    weights = torch.full((4,), float(rank))
    saver.start(1, lambda files: files.save({"w": weights}, f"w{rank}.pt"))
    weights += 10  # the loop goes on: the staged copy is written
    deadline = time.monotonic() + 60
    while rank == 0 and not (run_dir / "checkpoints" / "step_1").is_dir() and time.monotonic() < deadline:
        time.sleep(0.01)
    committed_before_wait = (run_dir / "checkpoints" / "step_1").is_dir()
    saver.wait()

    def failing(files):
        if rank == 1:
            (files.directory / "w1.pt").mkdir()
        files.save({"w": weights}, f"w{rank}.pt")

    saver.start(2, failing)
    try:
        saver.wait()
        outcome = "committed"
    except checkpoint.CheckpointSaveError as err:
        outcome = str(err)
    saver.close()
    print(json.dumps({"committed_before_wait": committed_before_wait, "outcome": outcome}))
    dist.barrier()  # neither rank tears its groups down while the other still uses them
    dist.destroy_process_group()
    """
)


def test_the_commit_waits_for_every_ranks_background_write(tmp_path) -> None:
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [
        subprocess.Popen([sys.executable, "-c", _RANKS_SCRIPT, str(tmp_path)], env={**env, "RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]  # fmt: skip
    outputs = [proc.communicate(timeout=180) for proc in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outputs]
    rank0, rank1 = (json.loads(out.strip().splitlines()[-1]) for out, _ in outputs)
    assert rank0["committed_before_wait"]  # rank 0 committed as soon as both markers were there
    assert "could not write the checkpoint of step 2" in rank0["outcome"]
    assert "step_1 is intact" in rank0["outcome"]
    assert "the checkpoint of step 2 was not written ([Errno 21] Is a directory" in rank1["outcome"]
    assert [p.name for p in checkpoint.good_checkpoints(tmp_path)] == ["step_1"]
    assert not checkpoint.unfinished(tmp_path)
    step_1 = tmp_path / "checkpoints" / "step_1"
    assert content_problem(step_1) is None
    assert [float(checkpoint.load_tensor_file(step_1 / f"w{r}.pt")["w"][0]) for r in (0, 1)] == [0.0, 1.0]


# A model whose checkpoint (about 150 MB) takes a while to write.
BIG = [*TINY, "model.n_layer=4", "model.d_model=512", "model.n_head=8", "train.micro_batch_size=1",
       "train.max_steps=400", "train.eval_every=null", "checkpoint.every=2", "launcher=inline"]  # fmt: skip


def test_a_sigkill_during_the_background_write_leaves_the_previous_checkpoint(tmp_path) -> None:
    run_dir, err = tmp_path / "run", tmp_path / "train.err"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "launcher", *BIG, f"run_dir={run_dir}"], cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=stderr)  # fmt: skip
    partial = run_dir / "checkpoints" / ".partial_step_4"
    deadline = time.monotonic() + 300
    while not partial.is_dir():  # step 4's save has begun; step 2's is committed
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no save of step 4 seen: {err.read_text()[-3000:]}")
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert partial.is_dir() and [p.name for p in checkpoint.good_checkpoints(run_dir)] == ["step_2"]
    resume = [*BIG, f"run_dir={run_dir}", "resume=auto", "train.stop_after=3", "checkpoint.save_final=false"]
    result = run_cli(resume, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "removed" in result.stdout and ".partial_step_4" in result.stdout
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from"].endswith("step_2")
    assert not partial.exists()
