"""A user's own config directory (--config-dir, hydra.searchpath), Hydra's plugins and run dir, `--cfg job` checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import TINY, run_cli
from launcher.front import command_line, compose
from launcher.front.cli import precheck

USER_CONF = Path(__file__).parents[1] / "assets" / "user_conf"
"""A lightning-hydra-template style folder: optimizer/my_adamw.yaml, experiment/small_lr.yaml."""


def _compose(args: list[str]):
    """The composed config of a command line, as `train` checks it (asserting it is valid)."""
    line = command_line.parse(args)
    assert precheck(line) == []
    cfg, errors = compose.compose_checked(list(line.overrides), line.source)
    assert errors == []
    return cfg


def _messages(args: list[str]) -> list[tuple[tuple[str, ...], str]]:
    return [(e.keys, e.message) for e in precheck(command_line.normalize(args))]


@pytest.mark.parametrize(
    "where",
    [
        ["--config-dir", str(USER_CONF)],
        [f"--config-dir={USER_CONF}"],
        [f"hydra.searchpath=[file://{USER_CONF}]"],
        ["--config-dir", str(USER_CONF), "hydra.searchpath=[pkg://launcher.conf]"],
    ],
    ids=["config-dir", "config-dir=", "searchpath", "both"],
)
def test_a_new_option_of_an_existing_group(where: list[str]) -> None:
    cfg = _compose([*where, "optimizer=my_adamw"])
    assert (cfg.optimizer.name, cfg.optimizer.lr, cfg.optimizer.weight_decay) == ("adamw", 2e-4, 0.0)
    assert _compose([*where, "+optimizer=my_adamw"]).optimizer.lr == 2e-4
    assert (
        precheck(command_line.normalize(["-m", *where, "optimizer=my_adamw,adamw"])) == []
    )  # every sweep point


def test_an_experiment_of_overrides_with_a_defaults_list() -> None:
    cfg = _compose(["--config-dir", str(USER_CONF), "+experiment=small_lr", "optimizer.momentum=0.7"])
    assert (cfg.optimizer.name, cfg.optimizer.lr, cfg.optimizer.momentum) == ("sgd", 1e-4, 0.7)
    assert (cfg.scheduler.name, cfg.train.max_steps) == ("constant", 3)
    assert "experiment" not in compose.strip_hydra(cfg)


def test_user_groups_are_checked_like_shipped_ones() -> None:
    where = ["--config-dir", str(USER_CONF)]
    assert _messages([*where, "experiment=small_lr"]) == [
        (
            ("experiment",),
            "experiment is a group of your config directory that train.yaml's defaults list does not select: "
            "add it with +experiment=small_lr (Hydra's `+` appends a group that has no default).",
        )
    ]
    [(keys, message)] = _messages([*where, "+experiment=small"])
    assert (
        keys == ("experiment",)
        and "no option 'small' in group experiment" in message
        and "small_lr" in message
    )
    [(keys, message)] = _messages([*where, "optimizer=my_adamww"])
    assert "Did you mean my_adamw?" in message
    [(keys, message)] = _messages([*where, "+experiment=typo"])
    assert keys == ("optimizer.lrr",) and "Key 'lrr' not in 'OptimizerConfig'" in message
    [(keys, message)] = _messages(["--config-dir", str(USER_CONF / "missing"), "optimizer=my_adamw"])
    assert keys == ("hydra.searchpath",) and "does not exist" in message
    [(keys, _)] = _messages(["optimizer=my_adamw"])  # without the directory the option is unknown
    assert keys == ("optimizer",)


@pytest.mark.parametrize(
    ("override", "key", "says"),
    [
        ("hydra/launcher=submitit_local", "hydra/launcher", "launcher=inline|local|slurm"),
        ("hydra/sweeper=nevergrad", "hydra/sweeper", "`train -m key=a,b`"),
        (
            "hydra.sweeper.n_trials=20",
            "hydra.sweeper.n_trials",
            "Hydra's launcher and sweeper plugins are not used",
        ),
        ("hydra.run.dir=elsewhere", "hydra.run.dir", "Set run_dir=PATH instead"),
    ],
)
def test_hydra_plugins_and_run_dir_are_refused_with_what_to_use(override: str, key: str, says: str) -> None:
    for args in ([override], ["-m", override, "train.max_steps=1,2"]):
        [(keys, message)] = _messages(args)
        assert keys == (key,) and says in message


def test_deleting_a_key_gives_hydras_reason() -> None:
    [(keys, message)] = _messages(["~optimizer.momentum"])
    assert keys == ("optimizer.momentum",)
    assert (
        "Error merging override ~optimizer.momentum: OptimizerConfig (DictConfig) does not support deletion"
        in message
    )
    assert "set it to another value" in message


def test_cfg_job_refuses_what_a_run_refuses(tmp_path) -> None:
    printed = run_cli(["--cfg", "job", "+optimizer.foo=1"], tmp_path)
    dry = run_cli(["dry_run=true", "+optimizer.foo=1"], tmp_path)
    assert printed.returncode == dry.returncode == 2
    assert "optimizer.foo: unknown key" in printed.stderr and printed.stdout == ""
    shown = run_cli(["--cfg", "job", "--config-dir", str(USER_CONF), "+experiment=small_lr"], tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert yaml.safe_load(shown.stdout)["optimizer"]["lr"] == 1e-4


def test_a_real_run_of_an_experiment(tmp_path) -> None:
    run_dir = tmp_path / "run"
    tiny = [o for o in TINY if not o.startswith(("train.max_steps", "train.eval_every", "checkpoint.every"))]
    args = ["--config-dir", str(USER_CONF), "+experiment=small_lr", *tiny, "checkpoint.every=null"]
    result = run_cli([*args, f"run_dir={run_dir}"], tmp_path)
    assert result.returncode == 0, result.stderr
    spec = yaml.safe_load((run_dir / "spec.yaml").read_text())
    assert (spec["optimizer"]["name"], spec["optimizer"]["lr"], spec["train"]["max_steps"]) == (
        "sgd",
        1e-4,
        3,
    )


def test_the_dry_run_credits_values_to_the_users_files(tmp_path) -> None:
    """The "from" column names the user's experiment and option files, not a shipped option or the schema."""
    experiment = run_cli(["--config-dir", str(USER_CONF), "+experiment=small_lr", "dry_run=true"], tmp_path)
    rows = {line.split()[0]: line.split()[-1] for line in experiment.stdout.splitlines() if line.strip()}
    assert rows["optimizer.lr"] == "experiment=small_lr" and rows["train.max_steps"] == "experiment=small_lr"
    option = run_cli(["--config-dir", str(USER_CONF), "optimizer=my_adamw", "dry_run=true"], tmp_path)
    rows = {line.split()[0]: line.split()[-1] for line in option.stdout.splitlines() if line.strip()}
    assert rows["optimizer.lr"] == "optimizer=my_adamw"
