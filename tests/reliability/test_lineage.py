"""Checkpoints as a line of descent: resume=auto follows `latest` and each checkpoint's recorded parent; a
branch a resume left, a damaged checkpoint and a path in the way are moved aside (never deleted, never
written over), each named on the main console.

One 20-step run (checkpoints at 5, 10, 15, 20) is built per module and copied per case; the damage
is done to real files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from payloads import replant

from conftest import DDP_LOCAL, TINY, losses, run_cli, run_inline
from launcher.components import checkpoint
from launcher.components.checkpoint_files import read_manifest
from launcher.components.metrics import read_metrics

RUN = [*TINY, "checkpoint.every=5", "checkpoint.keep=10", "train.eval_every=null"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("lineage") / "run"
    assert run_inline(RUN, run_dir) == 0
    return run_dir


def _copy(base: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(base, tmp_path / "run"))


def _names(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_resume_auto_follows_the_branch_a_resume_started_not_the_highest_step(base, tmp_path) -> None:
    run_dir = _copy(base, tmp_path)
    ckpts = run_dir / "checkpoints"
    with pytest.warns(UserWarning) as seen:  # inline: the console's warnings are on stderr
        assert run_inline([*RUN, f"resume={ckpts / 'step_10'}", "train.stop_after=12"], run_dir) == 0
    lines = [str(w.message) for w in seen]
    for gone in ("step_15", "step_20"):
        assert any(
            line.startswith(
                f"checkpoint {ckpts / gone} belongs to a branch this run left (it continues from step_10)"
            )
            and f"moved aside to {ckpts / 'abandoned' / gone}" in line
            for line in lines
        ), lines
    assert _names(checkpoint.good_checkpoints(run_dir)) == ["step_12", "step_10", "step_5"]
    assert (ckpts / "latest").read_text().strip() == "step_12"
    assert read_manifest(ckpts / "step_12")["parent"] == "step_10"
    assert read_manifest(ckpts / "step_10")["parent"] == "step_5"
    assert run_inline([*RUN, "resume=auto"], run_dir) == 0
    assert _summary(run_dir)["resumed_from"].endswith("step_12")  # not the abandoned step_20
    assert losses(run_dir) == losses(base)  # steps 11-20 of the branch replay the same data exactly
    assert _names(sorted((ckpts / "abandoned").iterdir())) == ["step_15", "step_20"]  # kept, not counted


def test_resume_auto_follows_latest_even_where_the_abandoned_branch_is_still_there(tmp_path) -> None:
    run_dir = tmp_path / "run"

    def write(files) -> None:
        files.save({"w": torch.zeros(2)}, "model.pt")

    for step in (10, 20):
        checkpoint.save(run_dir, step, write, keep=5)
    checkpoint.start_session(run_dir)
    checkpoint.resumed(run_dir, run_dir / "checkpoints" / "step_10", verified=True)
    checkpoint.save(run_dir, 12, write, keep=5)
    assert _names(checkpoint.resolve_resume("auto", run_dir)) == ["step_12", "step_10"]
    manifest = run_dir / "checkpoints" / "step_12" / "COMPLETE"  # written before parents were recorded
    manifest.write_text(
        json.dumps({k: v for k, v in json.loads(manifest.read_text()).items() if k != "parent"})
    )
    assert _names(checkpoint.resolve_resume("auto", run_dir)) == ["step_12", "step_10"]  # every lower step
    from launcher.tools.export import locate

    assert locate(run_dir)[0].name == "step_12"  # train-export takes the same head, not the abandoned step_20


def test_a_file_in_the_way_of_a_save_is_moved_aside_and_the_run_saves(base, tmp_path) -> None:
    run_dir = _copy(base, tmp_path)
    ckpts = run_dir / "checkpoints"
    shutil.rmtree(ckpts / "step_20")
    (ckpts / "step_20").write_text("not a checkpoint")
    with pytest.warns(
        UserWarning, match=r"step_20 is not a checkpoint directory .*moved aside to .*damaged/step_20"
    ):
        assert run_inline([*RUN, "resume=auto"], run_dir) == 0
    assert _summary(run_dir)["resumed_from"].endswith("step_15")
    assert checkpoint.problem(ckpts / "step_20") is None  # written this time
    assert (ckpts / "damaged" / "step_20").read_text() == "not a checkpoint"


def test_a_path_that_appears_in_the_way_during_a_run_is_moved_aside_by_the_save(tmp_path, caplog) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_7").write_text("in the way")
    with caplog.at_level("WARNING", logger=checkpoint.LOG.name):
        checkpoint.save(run_dir, 7, lambda f: f.save({"w": torch.zeros(2)}, "model.pt"), keep=2)
    assert checkpoint.problem(run_dir / "checkpoints" / "step_7") is None
    assert (run_dir / "checkpoints" / "damaged" / "step_7").read_text() == "in the way"
    assert any(
        "step_7 was in the way of the checkpoint of step 7: moved aside to" in r.getMessage()
        for r in caplog.records
    )


def _truncate(step: Path) -> str:
    data = (step / "model.pt").read_bytes()
    (step / "model.pt").write_bytes(data[: len(data) // 2])
    return "file model.pt has"


def _empty_trainer(step: Path) -> str:
    (step / "trainer.pt").write_bytes(b"")
    return "file trainer.pt has 0 bytes"


def _no_optimizer(step: Path) -> str:
    (step / "optimizer.pt").unlink()
    return "file optimizer.pt is missing"


def _garbage_marker(step: Path) -> str:
    (step / "COMPLETE").write_bytes(b"\x00garbage{")
    return "unreadable COMPLETE marker"


def _no_marker(step: Path) -> str:
    (step / "COMPLETE").unlink()
    return "no COMPLETE marker"


def _emptied(step: Path) -> str:
    for path in step.iterdir():
        path.unlink()
    return "no COMPLETE marker"


def _wrong_shape(step: Path) -> str:
    state = torch.load(step / "model.pt", weights_only=True)
    name = next(iter(state))
    state[name] = torch.zeros(3, 3)
    scratch = step.parent / "scratch.pt"
    torch.save(state, scratch)
    replant(step, "model.pt", scratch.read_bytes())  # sealed again: only the load can tell
    scratch.unlink()
    return "it does not load"


DAMAGE = {
    "truncated": _truncate,
    "empty_trainer": _empty_trainer,
    "no_optimizer": _no_optimizer,
    "garbage_marker": _garbage_marker,
    "no_marker": _no_marker,
    "emptied": _emptied,
    "wrong_shape": _wrong_shape,
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_every_damaged_checkpoint_goes_to_damaged_with_a_line_and_is_never_written_over(
    base, tmp_path, case
) -> None:
    run_dir = _copy(base, tmp_path)
    ckpts = run_dir / "checkpoints"
    said = DAMAGE[case](ckpts / "step_20")
    before = {p.name: p.read_bytes() for p in (ckpts / "step_20").iterdir()}
    with pytest.warns(UserWarning) as seen:
        assert run_inline([*RUN, "resume=auto"], run_dir) == 0
    lines = [str(w.message) for w in seen]
    assert any(
        f"{ckpts / 'step_20'}" in line
        and said in line
        and f"moved aside to {ckpts / 'damaged' / 'step_20'}" in line
        for line in lines
    ), lines
    assert _summary(run_dir)["resumed_from"].endswith("step_15")
    kept = ckpts / "damaged" / "step_20"
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == before  # the evidence, as it was found
    assert checkpoint.problem(ckpts / "step_20") is None  # the new session's own step_20


def test_a_checkpoint_only_another_rank_cannot_load_is_named_on_the_console(ddp_straight, tmp_path) -> None:
    """Rank 1 alone reads rng_rank1.pt: its refusal reaches the console that `train` shows (rank 0's). The
    resumed local run (its second session) does not replay the first session's output either."""
    run_dir = Path(shutil.copytree(ddp_straight, tmp_path / "run"))  # 2 local DDP ranks, 20 steps, every 5
    step = run_dir / "checkpoints" / "step_20"
    replant(step, "rng_rank1.pt", b"\x80\x02}q\x00garbage")  # sealed again: the sizes and digests agree
    again = run_cli([*DDP_LOCAL, "log.summary_table=true", "resume=auto", f"run_dir={run_dir}"], tmp_path)
    out = " ".join(again.stdout.split())
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert f"warning: skipping checkpoint {step}: it does not load" in out and "(on rank 1)" in out, out[
        -3000:
    ]
    assert f"moved aside to {run_dir / 'checkpoints' / 'damaged' / 'step_20'}" in out
    assert f"resumed from {run_dir / 'checkpoints' / 'step_15'}" in out
    # no replay: one summary (this session's), the first session's rank logs set aside, one record per step
    assert again.stdout.count("run summary") == 1, again.stdout[-3000:]
    assert "logs of the previous session moved to" in again.stderr
    assert (run_dir / "logs" / "session_0" / "rank_0.log").is_file() and (
        run_dir / "logs" / "rank_0.log"
    ).is_file()
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r] == list(range(1, 21))
