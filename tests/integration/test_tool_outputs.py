"""`train-export` and `train-merge` never replace an existing OUT file unless told to (`--force`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import TINY, run_inline
from launcher.tools import export, merge


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """A 2-step LoRA run (what both commands read)."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    steps = [
        "train.max_steps=2",
        "scheduler.warmup_steps=1",
        "train.eval_every=null",
        "checkpoint.every=null",
    ]
    assert run_inline([*TINY, *steps, "quantization=lora", "quantization.lora.rank=4"], run_dir) == 0
    return run_dir


@pytest.mark.parametrize(("command", "extra"), [(export.main, ["--merge"]), (merge.main, [])])
def test_an_existing_file_is_kept_unless_force(lora_run, tmp_path, capsys, command, extra: list[str]) -> None:
    out = tmp_path / "weights.pt"
    out.write_text("mine")
    assert command([str(lora_run), str(out), *extra]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{out} already exists; the command would overwrite it" in err and "add --force" in err, err
    assert out.read_text() == "mine"
    assert command([str(lora_run), str(out), *extra, "--force"]) == 0
    assert isinstance(torch.load(out, weights_only=True), dict)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.pt"]  # no partial file left


def test_a_folder_as_the_out_file_is_refused(lora_run, tmp_path, capsys) -> None:
    assert export.main([str(lora_run), str(tmp_path), "--merge", "--force"]) == 2
    assert "is a folder; this command writes one file" in capsys.readouterr().err
