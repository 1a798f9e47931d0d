"""`train-export` and `train-merge` never replace an existing OUT file unless told to (`--force`), never make a path
of missing folders, and refuse a merge where there is nothing to merge."""

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


@pytest.mark.parametrize(
    ("command", "extra", "name"),
    [(export.main, ["--merge"], "w.pt"), (merge.main, [], "w.pt"), (export.main, ["--merge", "--format", "hf"], "hf"),
     (export.main, ["--adapter"], "adapter")],
)  # fmt: skip
def test_out_under_missing_folders_is_refused_and_one_missing_folder_is_made(
    lora_run, tmp_path, capsys, command, extra: list[str], name: str
) -> None:
    out = tmp_path / "missing" / "sub" / name
    assert command([str(lora_run), str(out), *extra]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"its folder {out.parent} does not exist, nor does {tmp_path / 'missing'}" in err, err
    assert f"mkdir -p {out.parent}" in err and list(tmp_path.iterdir()) == []
    assert command([str(lora_run), str(tmp_path / "made" / name), *extra]) == 0  # OUT's own folder is made
    assert (tmp_path / "made" / name).exists()


def test_merge_refuses_a_run_without_adapters_as_export_does(tmp_path, capsys) -> None:
    run_dir = tmp_path / "plain"
    steps = ["train.max_steps=2", "scheduler.warmup_steps=1", "train.eval_every=null"]
    assert run_inline([*TINY, *steps], run_dir) == 0
    out = tmp_path / "merged.pt"
    assert merge.main([str(run_dir), str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "has nothing to merge" in err and "train-export RUN OUT.pt" in err and not out.exists()
    assert export.main([str(run_dir), str(out), "--merge"]) == 2 and not out.exists()
