"""The `train` command as a user runs it: exit statuses, dry run, help, secrets, reproduction, packaging."""

from __future__ import annotations

import json
import site
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY, losses, run_cli, run_clis


def test_invalid_spec_exits_2_reports_everything_and_starts_nothing(tmp_path) -> None:
    result = run_cli(
        ["precision=bf61", "+optimizer.lrr=1", "precision.fp16=true", "precision.bf16=true"], tmp_path
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr + result.stdout
    assert "nothing was started" in result.stderr
    assert "Did you mean bf16?" in result.stderr and "Did you mean lr?" in result.stderr
    assert list(tmp_path.iterdir()) == []  # no run directory, no Hydra output


def test_cross_field_violations_are_all_reported(tmp_path) -> None:
    result = run_cli(
        ["precision.fp16=true", "precision.bf16=true", "train.max_steps=0", "data.seq_len=999"], tmp_path
    )
    assert result.returncode == 2
    assert "(3 problems)" in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv", [["_target_=os.system"], ["+_target_=os.system"], ["+optimizer._target_=os.system"]]
)
def test_target_from_the_command_line_is_refused(tmp_path, argv: list[str]) -> None:
    result = run_cli(argv, tmp_path)
    assert result.returncode == 2 and "`_target_` is refused" in result.stderr


def test_dry_run_shows_sources_and_starts_nothing(tmp_path) -> None:
    result = run_cli(["dry_run=true", "+precision=bf16", "optimizer.lr=3e-4", "recipe=cpu_smoke"], tmp_path)
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert "precision.bf16 True precision=bf16" in out
    assert "optimizer.lr 0.0003 command line" in out
    assert "train.max_steps 20 recipe=cpu_smoke" in out
    assert (
        "profiler.wait" not in out
        and "more keys at their schema defaults; `dry_run=all` lists every key" in out
    )
    assert "verdict: valid" in out and "would launch: inline" in out
    assert list(tmp_path.iterdir()) == []


def test_cfg_job_and_help_keep_working(tmp_path) -> None:
    cfg = run_cli(["--cfg", "job", "precision=bf16"], tmp_path)
    assert cfg.returncode == 0 and "bf16: true" in cfg.stdout
    helptext = run_cli(["--help"], tmp_path)
    assert helptext.returncode == 0 and "precision: bf16, fp16, fp32, fp8, pure_bf16, tf32" in helptext.stdout


def test_secrets_from_env_never_reach_spec_or_console(tmp_path) -> None:
    run_dir = tmp_path / "run"
    args = [
        *TINY,
        "train.max_steps=3",
        "checkpoint.every=null",
        "name=${oc.env:LAUNCHER_TEST_TOKEN}",
        f"run_dir={run_dir}",
    ]
    result, dry = run_clis(  # independent: started together
        [args, ["dry_run=all", "name=${oc.env:LAUNCHER_TEST_TOKEN}"]],
        tmp_path,
        env={"LAUNCHER_TEST_TOKEN": "s3cr3t-value"},
    )
    assert result.returncode == 0, result.stderr
    assert "s3cr3t-value" not in result.stdout + result.stderr
    spec = (run_dir / "spec.yaml").read_text()
    assert "${oc.env:LAUNCHER_TEST_TOKEN}" in spec and "s3cr3t-value" not in spec
    assert dry.returncode == 0 and "s3cr3t-value" not in dry.stdout
    assert "profiler.wait" in dry.stdout and "schema defaults;" not in dry.stdout  # every key


def test_spec_yaml_alone_reproduces_the_run(tmp_path) -> None:
    first, again = tmp_path / "first", tmp_path / "again"
    assert run_cli([*TINY, "train.max_steps=4", f"run_dir={first}"], tmp_path).returncode == 0
    result = run_cli(["--config-path", str(first), "--config-name", "spec", f"run_dir={again}"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert losses(first) == losses(again)
    closing = result.stdout[result.stdout.rindex(f"run directory: {again} (exit status 0)") :]
    assert f"resume: train --config-path {again} --config-name spec resume=auto" in closing
    assert (
        f"metrics: {again / 'metrics.jsonl'}" in closing and f"summary: {again / 'summary.json'}" in closing
    )
    assert f"checkpoints: {again / 'checkpoints'} (latest: step_4)" in closing
    summary = json.loads((again / "summary.json").read_text())
    assert summary["exit_reason"] == "completed"


def _venv_over_this_environment(venv: Path) -> None:
    """A venv that sees this interpreter's packages (torch, hydra, ...) under its own site-packages.

    `--system-site-packages` reaches the base interpreter's packages only; run from inside a venv,
    this one's packages are added by a .pth file (processed as site directories, their .pth too).
    """
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    if sys.prefix == sys.base_prefix:
        return
    python = str(venv / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    dirs = [d for d in site.getsitepackages() if Path(d).is_dir()]
    Path(purelib, "outer_environment.pth").write_text(f"import site; list(map(site.addsitedir, {dirs!r}))\n")


@pytest.mark.slow
def test_plain_install_ships_configs_and_runs_from_anywhere(tmp_path) -> None:
    """`pip install .` (not editable): conf/ and recipes/ come inside the package."""
    root = Path(__file__).parents[2]
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(root)],
        check=True, capture_output=True,
    )  # fmt: skip
    venv = tmp_path / "venv"
    _venv_over_this_environment(venv)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps"]
    subprocess.run([*pip, str(next(wheels.glob("*.whl")))], check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run(
        [str(venv / "bin" / "train"), "dry_run=true", "recipe=cpu_smoke"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import launcher; print(launcher.__file__)"],
        cwd=elsewhere, capture_output=True, text=True,
    )  # fmt: skip
    assert str(venv) in where.stdout  # the installed copy ran, not the checkout
    assert "verdict: valid" in result.stdout
