"""What the console says when something goes wrong reads as plain sentences: no raw markup, one line
per warning (once, without Python's `UserWarning` prefix and source line), no "since None", no "..".
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from processes import mount_tmpfs, stale_lock

from conftest import run_cli, run_clis
from launcher.components import quiet
from launcher.launch.local import failure_message

SMALL = [
    "model.n_layer=1", "model.d_model=32", "model.n_head=2", "data.seq_len=16", "data.max_bytes=100000",
    "scheduler.warmup_steps=1", "train.eval_every=null", "log.progress=false", "log.summary_table=false",
]  # fmt: skip


def test_a_full_disk_error_is_printed_as_text_not_as_markup(tmp_path) -> None:
    disk = tmp_path / "disk"
    mount_tmpfs(disk, 160 * 1024)
    try:  # the run's files fit in 160 KiB, its first checkpoint (about 144 KB) does not
        result = run_cli(
            [*SMALL, "train.max_steps=2", "checkpoint.every=2", f"run_dir={disk / 'run'}"], tmp_path
        )
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 1 and "error: could not write the checkpoint of step 2" in out, out[-3000:]
    assert "[red]" not in out and "[/]" not in out
    assert "[enforce fail" in out  # square brackets of the error itself are kept, not read as markup


def test_warnings_print_once_as_one_line_and_a_lock_without_a_start_time_is_described(tmp_path) -> None:
    run_dir = tmp_path / "run"
    first = run_cli([*SMALL, "train.max_steps=4", "checkpoint.every=2", f"run_dir={run_dir}"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir / "checkpoints" / "step_4" / "COMPLETE").unlink()
    gone_pid = stale_lock(run_dir)  # no "started"
    again = run_cli(
        [*SMALL, "train.max_steps=6", "checkpoint.every=2", "resume=auto", f"run_dir={run_dir}"], tmp_path
    )
    assert again.returncode == 0, again.stderr[-3000:]
    lines = again.stderr.splitlines()
    skipped = [line for line in lines if "skipping checkpoint" in line]
    assert skipped == [f"warning: skipping checkpoint {run_dir}/checkpoints/step_4: no COMPLETE marker (the save did not finish)"]  # fmt: skip
    taken = [line for line in lines if "taking over the lock" in line]
    assert taken == [f"warning: taking over the lock of {run_dir}: its holder (pid {gone_pid} on host {socket.gethostname()}) is gone"]  # fmt: skip
    assert "UserWarning" not in again.stderr and "None" not in again.stderr


def test_a_rank_error_that_ends_in_a_period_gets_no_second_one(tmp_path, monkeypatch) -> None:
    """The error file is torch elastic's own, written by its ErrorHandler as a failing rank writes it."""
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ErrorHandler,
        ProcessFailure,
    )

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise ValueError("the batch does not fit.")
    except ValueError as err:
        ErrorHandler().record_exception(err)
    failure = ProcessFailure(local_rank=1, pid=4321, exitcode=1, error_file=str(error_file))
    first_line = failure_message(ChildFailedError("worker", {1: failure}), tmp_path).splitlines()[0]
    assert first_line == "error: rank 1 (pid 4321) failed: ValueError: the batch does not fit."


CHATTER = {
    "Loading weights": "transformers' weight-loading bar",
    "Writing model shards": "transformers' shard-writing bar",
    "Setting accelerator to CPU": "DeepSpeed's accelerator notice",
    "Failed to load CPU gemm_4bit_forward from kernels-community": "bitsandbytes' optional-kernel notice",
}
"""Other libraries' chatter (launcher.components.quiet), which a run's console holds only with --verbose."""
AVX512_BF16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text()
"""bitsandbytes tries the optional kernel (and says it failed) only on such CPUs."""


def _consoles(*commands: list[str], cwd: Path) -> list[str]:
    """stdout and stderr of `python -m ARGS` for each command, started together (independent processes whose
    imports overlap), with the user's environment minus a progress-bar setting."""
    env = {k: v for k, v in os.environ.items() if k != quiet.PROGRESS_ENV}
    started = [
        subprocess.Popen(
            [sys.executable, "-m", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in commands
    ]
    with ThreadPoolExecutor(len(started)) as pool:  # read every pipe at once: no child waits on a full one
        outputs = list(pool.map(lambda proc: proc.communicate(timeout=300), started))
    for proc, (out, err) in zip(started, outputs, strict=True):
        assert proc.returncode == 0, (out + err)[-3000:]
    return [out + err for out, err in outputs]


def _chatter(console: str) -> set[str]:
    return {line for line in CHATTER if line in console}


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory) -> Path:
    """A QLoRA run of a tiny Llama folder on the CPU, its console quiet: no bar, no notice."""
    from hf_assets import make_hf_model

    root = tmp_path_factory.mktemp("quiet")
    folder = make_hf_model("llama", root / "llama")
    args = [
        *SMALL,
        "model=hf",
        f"model.path={folder}",
        "tokenizer=bytes",
        "quantization=nf4_lora",
        "train.max_steps=2",
    ]
    console, loud = _consoles(
        ["launcher", *args, f"run_dir={root / 'run'}"],
        ["launcher", *args, "--verbose", f"run_dir={root / 'loud'}"],
        cwd=root,
    )
    assert _chatter(console) == set() and "(exit status 0)" in console, console[-3000:]
    expected = {"Loading weights"} | (
        {"Failed to load CPU gemm_4bit_forward from kernels-community"} if AVX512_BF16 else set()
    )
    assert _chatter(loud) == expected, loud[-3000:]
    return root / "run"


def test_other_libraries_chatter_is_shown_only_with_verbose(qlora_run, tmp_path) -> None:
    """The run (in the fixture) and its export to a Hugging Face folder: quiet, and all of it with --verbose."""
    export = ["launcher.tools.export", str(qlora_run), "--format", "hf", "--merge"]
    quiet_console, loud = _consoles(
        [*export, str(tmp_path / "quiet")], [*export, str(tmp_path / "loud"), "--verbose"], cwd=tmp_path
    )
    assert _chatter(quiet_console) == set() and "exported" in quiet_console, quiet_console[-3000:]
    expected = set(CHATTER) - (
        set() if AVX512_BF16 else {"Failed to load CPU gemm_4bit_forward from kernels-community"}
    )
    assert _chatter(loud) == expected, loud[-3000:]


def test_a_piped_run_prints_a_progress_line_when_it_was_silent_for_progress_every_s(tmp_path) -> None:
    """No terminal, no bar: a run that logs only at its end still says where it is, and log lines reset the clock."""
    shown = [arg for arg in SMALL if arg != "log.progress=false"]
    args = [*shown, "train.max_steps=6", "train.log_every=100", "checkpoint.every=null"]
    result, logged, default = run_clis(
        [
            [*args, "log.progress_every_s=0.001", f"run_dir={tmp_path / 'run'}"],
            [*args, "train.log_every=1", "log.progress_every_s=0.001", f"run_dir={tmp_path / 'logged'}"],
            [*args, f"run_dir={tmp_path / 'default'}"],  # 30 s: more than this run takes
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("progress: ")]
    assert [line.split(",")[0] for line in lines] == [
        f"progress: step {n}/6 ({100 * n // 6}%)" for n in range(1, 6)
    ]
    assert all(re.search(r", eta \d+:\d\d:\d\d$", line) for line in lines), lines
    assert "step 6/6: loss" in result.stdout  # the last step's record: its log line, no progress line
    assert logged.returncode == 0 and "progress: " not in logged.stdout, logged.stdout[-3000:]
    assert default.returncode == 0 and "progress: " not in default.stdout, default.stdout[-3000:]
