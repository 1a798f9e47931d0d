"""`train -m hydra/sweeper=optuna` for real: trials in the study, an invalid point skipped, a re-run that
continues the study (a trial left running resumed, no extra trial asked), and `train-sweep-status`'s best
trial and plot. Refusals of settings `train` does not run are checked without running anything."""

from __future__ import annotations

import json
import sys

import optuna
import pytest

from conftest import TINY, run_cli
from launcher.front import cli, sweep_status, sweep_study

SWEEP = [
    "-m",
    "hydra/sweeper=optuna",
    "hydra.sweeper.n_jobs=1",
    "hydra.sweeper.sampler.seed=0",
    *[o for o in TINY if not o.startswith(("train.max_steps", "train.eval_every", "checkpoint.every"))],
    "train.max_steps=3",
    "train.eval_every=3",
    "checkpoint.every=null",
    "optimizer.lr=tag(log, interval(1e-4, 1e-2))",
    "model.n_layer=choice(2,-1)",  # -1 is refused by the rules: an invalid point
]


def _study(sweep_dir):
    return sweep_study.load(sweep_dir, sweep_study.read_record(sweep_dir))


def test_trials_an_invalid_point_a_continued_study_and_the_status(tmp_path, capsys) -> None:
    sweep_dir = tmp_path / "sweep"
    args = [*SWEEP, f"hydra.sweep.dir={sweep_dir}"]
    first = run_cli([*args, "hydra.sweeper.n_trials=3"], tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    trials = _study(sweep_dir).trials
    assert len(trials) == 3
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    invalid = [t for t in trials if t.params["model.n_layer"] == -1]
    assert complete and invalid and all(t.state == optuna.trial.TrialState.FAIL for t in invalid)
    assert "counts transformer blocks" in first.stderr and "the sweep goes on" in first.stdout
    for t in complete:  # the value told is the trial's own summary.json eval_loss
        summary = json.loads((sweep_dir / str(t.number) / "summary.json").read_text())
        assert t.value == summary["eval_loss"]

    # An interrupted sweep leaves a trial running: the same command (two more trials wanted) resumes that
    # trial and asks for one new trial, not a replay of the seeded sampler's first point.
    study = _study(sweep_dir)
    study.enqueue_trial({"optimizer.lr": 1e-3, "model.n_layer": 2})
    left = study.ask()
    assert study.trials[-1].state == optuna.trial.TrialState.RUNNING
    again = run_cli([*args, "hydra.sweeper.n_trials=5"], tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "3 of 5 trial(s) done, 1 to resume" in again.stdout
    trials = _study(sweep_dir).trials
    assert len(trials) == 5 and trials[3].number == left.number
    assert trials[3].state == optuna.trial.TrialState.COMPLETE and trials[3].params["optimizer.lr"] == 1e-3
    assert trials[4].params != trials[0].params and trials[4].state != optuna.trial.TrialState.RUNNING

    with pytest.raises(SystemExit) as status:  # train-sweep-status
        sweep_status.main([str(sweep_dir)])
    printed = " ".join(capsys.readouterr().out.split())
    best = min((t for t in trials if t.value is not None), key=lambda t: t.value)
    assert status.value.code == 0, printed
    assert f"best trial: {best.number}, eval_loss {best.value:.4f}" in printed, printed
    assert (sweep_dir / sweep_study.PLOT_FILE).stat().st_size > 0
    table = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert table["study"]["best"]["trial"] == best.number and table["winner"]["point"] == best.number


@pytest.mark.extended  # trials side by side; the default test holds the study, the invalid point and the re-run
def test_parallel_trials_each_their_own_process(tmp_path) -> None:
    sweep_dir = tmp_path / "sweep"
    args = [*SWEEP[:-1], "hydra.sweeper.n_jobs=2", "hydra.sweeper.n_trials=2", f"hydra.sweep.dir={sweep_dir}"]
    result = run_cli(args, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 trials side by side" in result.stdout
    trials = _study(sweep_dir).trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    assert all((sweep_dir / str(t.number) / "trial.log").is_file() for t in trials)


def test_settings_train_does_not_run_are_refused_before_anything(tmp_path) -> None:
    base = [o for o in SWEEP[:-1] if "seed" not in o] + [f"hydra.sweep.dir={tmp_path}"]  # grid has no seed
    cases = (
        [
            (
                ["hydra.sweeper.custom_search_space=my.module.fn"],
                "hydra.sweeper.custom_search_space",
                "Remove",
            ),
            (["optimizer.lrr=interval(0.1, 0.2)"], "optimizer.lrr", "unknown key"),
        ],
        [
            (["hydra/sweeper/sampler=grid"], "hydra/sweeper/sampler", "a grid is `train -m key=a,b`"),
            (["hydra.sweeper.n_trials=0"], "hydra.sweeper.n_trials", "must be 1 or more"),
            (["hydra.sweeper.direction=up"], "hydra.sweeper.direction", "minimize or maximize"),
            (["sweep.metric=eval_los"], "sweep.metric", "Did you mean eval_loss?"),
        ],
    )
    for together in cases:  # each group is found by one check, every problem of it at once
        errors = cli.precheck([*base, *(o for extra, _, _ in together for o in extra)])
        for _, key, says in together:
            assert any(key in e.keys and says in e.message for e in errors), (key, errors)
    assert not any(tmp_path.iterdir())


def test_without_multirun_or_search_space_it_says_what_to_add() -> None:
    [error] = cli.precheck(["hydra/sweeper=optuna", "optimizer.lr=interval(1e-4, 1e-2)"])
    assert "add --multirun (-m)" in error.message
    [error] = cli.precheck(["-m", "hydra/sweeper=optuna", "optimizer.lr=1e-3"])
    assert "has no search space" in error.message
    [error] = cli.precheck(
        ["-m", "hydra/sweeper=optuna", "optimizer.lr=interval(1e-4, 1e-2)", "train.max_steps=10"]
    )
    assert (
        error.keys == ("sweep.metric", "train.eval_at_end") and "Set train.eval_at_end=true" in error.message
    )


def test_a_rerun_with_another_objective_is_refused(tmp_path) -> None:
    sweep_study.write_record(
        tmp_path, {"storage": None, "study_name": "sweep", "metric": "final_loss", "direction": "minimize"}
    )
    errors = cli.precheck([*SWEEP, f"hydra.sweep.dir={tmp_path}"])
    assert [e.keys for e in errors] == [("sweep.metric", "hydra.sweeper.direction")]
    assert "was run to minimize final_loss" in errors[0].message


def test_without_the_extra_it_names_the_install_command(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "optuna", None)  # Python's own way to make a module unimportable
    [error] = cli.precheck(SWEEP)
    assert error.keys == ("hydra/sweeper=optuna",) and "pip install 'torch-launcher[sweep]'" in error.message
