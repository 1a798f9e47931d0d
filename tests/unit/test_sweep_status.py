"""`train-sweep-status` on a folder that is not a sweep says so (exit 2) instead of an empty table."""

from __future__ import annotations

import pytest

from launcher.front import sweep_status


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ({}, "Give the folder `train --multirun` printed as the sweep's directory."),
        ({"sweep_point.json": '{"num": 0, "overrides": []}'}, "It is one point of a sweep: give its parent"),
        ({"spec.yaml": "seed: 0\n"}, "It is a single run's directory"),
    ],
)
def test_a_folder_that_is_not_a_sweep_is_named_with_exit_2(tmp_path, capsys, content, expected) -> None:
    for name, text in content.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit) as stopped:
        sweep_status.main([str(tmp_path)])
    err = " ".join(capsys.readouterr().err.split())
    assert (
        stopped.value.code == 2 and f"{tmp_path} is not a sweep: a sweep folder" in err and expected in err
    ), err
    assert "sweep_point.json" in err and not (tmp_path / sweep_status.SUMMARY_FILE).exists()


def test_a_sweep_folder_is_not_refused(tmp_path) -> None:
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / sweep_status.POINT_FILE).write_text('{"num": 0, "overrides": ["a=1"]}')
    assert sweep_status.not_a_sweep(tmp_path) is None


def test_a_point_that_stopped_early_is_finished_and_may_win(tmp_path) -> None:
    """train.early_stop ends a run with exit status 0 and exit_reason early_stopped: a finished point, not a failure."""
    import json

    for num, (reason, loss) in enumerate(
        [("completed", 2.5), ("early_stopped", 2.1), ("stopped_after", 1.0)]
    ):
        point = tmp_path / str(num)
        point.mkdir()
        (point / sweep_status.POINT_FILE).write_text(json.dumps({"num": num, "overrides": [f"a={num}"]}))
        summary = {"exit_reason": reason, "steps": 8, "final_loss": loss, "eval_loss": loss}
        (point / "summary.json").write_text(json.dumps(summary))
    result = sweep_status.collect(tmp_path)
    assert result["winner"]["point"] == 1, result
    assert [r["point"] for r in sweep_status.failed(result)] == [2]
