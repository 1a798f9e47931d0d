"""The front end answers without the heavy stack: help, --cfg, compose + validate and dry runs import
none of torch, deepspeed, bitsandbytes, transformers, peft, torchao or datasets.

One fresh interpreter does every check in turn (a second one first fills the hardware-facts cache
on a machine with GPUs, where only a cache miss may import torch.cuda). docs/performance.md
("Startup") says what is imported when and how to keep it so.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launcher.components import hardware_facts
from launcher.components.hardware_facts import CudaFacts
from launcher.front import compose
from launcher.rules.hardware import detect_hardware
from launcher.spec import RunSpec, to_spec

HEAVY = ("torch", "deepspeed", "bitsandbytes", "transformers", "peft", "torchao", "datasets")
DRY_RUNS = (
    (),
    ("parallel=fsdp", "precision=bf16", "launcher.nproc=2"),
    ("parallel=pp", "launcher.nproc=2"),
    ("parallel=zero3",),
)

CHECKS = textwrap.dedent(
    """
    import contextlib, io, json, sys
    HEAVY, DRY_RUNS, RUN_DIR = sys.argv[1].split(","), json.loads(sys.argv[2]), sys.argv[3]

    def loaded():
        return sorted({name.split(".")[0] for name in sys.modules} & set(HEAVY))

    from launcher.front import cli, compose

    report = {}
    for flags in (["--help"], ["--cfg", "job"]):
        sys.argv = ["train", *flags]
        with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
            cli.main()
        report[" ".join(flags)] = {"heavy": loaded(), "printed": bool(out.getvalue())}
    cfg, problems = compose.compose_checked([], compose.ConfigSource())
    spec, errors = compose.validate(cfg)
    report["compose + validate"] = {"heavy": loaded(), "errors": [str(e) for e in problems + errors]}
    for i, line in enumerate(DRY_RUNS):
        argv = [*line, "dry_run=true", f"run_dir={RUN_DIR}/{i}"]
        with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()):
            status = cli.run(argv)
        report[" ".join(line) or "default"] = {"heavy": loaded(), "status": int(status), "printed": bool(out.getvalue())}
    print(json.dumps(report))
    """
)


def test_the_front_end_imports_none_of_the_heavy_stack(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    if not hardware_facts.cuda_impossible():  # GPUs here: the first probe may import torch.cuda, once
        warm = "from launcher.components.hardware_facts import cuda_facts; cuda_facts()"
        subprocess.run([sys.executable, "-c", warm], env=env, check=True, timeout=120)
    out = subprocess.run(
        [sys.executable, "-c", CHECKS, ",".join(HEAVY), json.dumps(DRY_RUNS), str(tmp_path / "runs")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.splitlines()[-1])
    assert {step: r["heavy"] for step, r in report.items() if r["heavy"]} == {}
    assert report["--help"]["printed"] and report["--cfg job"]["printed"]
    assert report["compose + validate"]["errors"] == []
    for line in DRY_RUNS:
        result = report[" ".join(line) or "default"]
        assert (result["status"], result["printed"]) == (0, True), (line, result)
    assert not (tmp_path / "runs").exists(), "a dry run writes nothing"


@functools.cache
def _default_spec() -> RunSpec:
    return to_spec(compose.strip_hydra(compose.compose([])))


def _spec(device: str) -> RunSpec:
    spec = _default_spec()
    return dataclasses.replace(spec, launcher=dataclasses.replace(spec.launcher, device=device))


def test_a_spec_on_the_cpu_asks_nothing_about_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec("cpu")

    def refuse() -> CudaFacts:
        raise AssertionError("launcher.device=cpu asked about CUDA")

    monkeypatch.setattr("launcher.rules.hardware.cuda_facts", refuse)
    hw = detect_hardware(spec)
    assert (hw.device_type, hw.bf16, hw.tf32, hw.num_gpus) == ("cpu", True, False, 0)


def test_cuda_facts_decide_auto_bf16_and_tf32(monkeypatch: pytest.MonkeyPatch) -> None:
    ampere = CudaFacts(available=True, num_gpus=2, bf16=True, capability=(8, 0), gpu_memory_bytes=80 << 30)
    monkeypatch.setattr("launcher.rules.hardware.cuda_facts", lambda: ampere)
    hw = detect_hardware(_spec("auto"))
    assert (hw.device_type, hw.bf16, hw.tf32, hw.num_gpus) == ("cuda", True, True, 2)
    monkeypatch.setattr("launcher.rules.hardware.cuda_facts", lambda: hardware_facts.NO_CUDA)
    assert detect_hardware(_spec("auto")).device_type == "cpu"
    hw = detect_hardware(_spec("cuda"))
    assert (hw.device_type, hw.bf16, hw.tf32, hw.num_gpus) == ("cuda", False, False, 0)


def test_the_facts_cache_is_keyed_by_what_changes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    key = hardware_facts.cache_key()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert hardware_facts.cache_key() != key
    facts = CudaFacts(available=True, num_gpus=1, bf16=True, capability=(9, 0), gpu_name="H100")
    path = hardware_facts.cache_path(key)
    hardware_facts._save(path, facts)
    assert path.is_relative_to(tmp_path) and hardware_facts._load(path) == facts
    path.write_text(json.dumps({**dataclasses.asdict(facts), "unknown": 1}))
    assert hardware_facts._load(path) is None  # a file of another format is probed again, not trusted
