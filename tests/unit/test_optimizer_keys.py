"""Every optimizer.* key reaches the optimizer an option builds, or setting it on purpose is refused.

The walk goes over OPTIMIZERS and launcher.config.optimizer.READS (one row per option), so a new
option is covered by adding its row; optimizers are real (torch, bitsandbytes) on a 2-layer module.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from launcher.components.optimizer import OPTIMIZERS, build_optimizer, param_groups
from launcher.config.optimizer import READS, SHARED_KEYS, OptimizerConfig, reads
from launcher.front import command_line, compose
from launcher.front.cli import precheck
from launcher.rules.optimizer import unread_keys

KEYS = [f.name for f in dataclasses.fields(OptimizerConfig) if f.name != "name"]
CONF = Path(__file__).parents[2] / "conf" / "optimizer"

NON_DEFAULT = {
    "lr": 3e-3,
    "weight_decay": 0.05,
    "decay_norms_and_biases": True,
    "betas": [0.8, 0.9],
    "eps": 1e-6,
    "momentum": 0.5,
    "nesterov": True,
    "implementation": "for_loop",
    "beta2_decay": -0.5,
    "eps2": 1e-2,
    "clip_threshold": 2.0,
    "muon_exclude": ["0.*"],
    "ns_steps": 3,
    "adjust_lr_fn": "original",
    "adamw_lr": 1e-4,
}
"""A legal value away from the schema default, per key: what the walk sets to see it reach the optimizer."""


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))  # 64x64: bitsandbytes keeps 8-bit state


def _build(cfg: OptimizerConfig, model: nn.Module | None = None) -> torch.optim.Optimizer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged_adamw_8bit on a CPU says it runs unpaged
        return build_optimizer(model or _model(), cfg, "cpu")


def _seen(opt: torch.optim.Optimizer) -> str:
    """What the optimizer will step with: its class and every parameter group's settings and size."""
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "num_params": len(group["params"])}
        for group in opt.param_groups
    ]
    return repr((type(opt).__name__, groups))


def test_every_option_has_a_row_and_every_key_a_reader() -> None:
    assert set(READS) == set(OPTIMIZERS), "add a row to launcher.config.optimizer.READS for each option"
    fields = set(KEYS) | {"name"}
    assert {key for row in READS.values() for key in row} | set(SHARED_KEYS) <= fields
    assert {key for option in OPTIMIZERS for key in reads(option)} == fields  # no key nobody reads
    missing = [key for key in KEYS if key not in NON_DEFAULT]
    assert not missing, f"give NON_DEFAULT a legal non-default value for {missing}"


def test_each_option_file_sets_only_keys_its_optimizer_reads() -> None:
    """Choosing an option never refuses its own file's values."""
    for path in sorted(CONF.glob("*.yaml")):
        values = yaml.safe_load(path.read_text())
        unread = set(values) - {"defaults"} - set(reads(values["name"]))
        assert not unread, (
            f"{path.name} sets {sorted(unread)}, which optimizer={values['name']} does not read"
        )


PAIRS = [(option, key) for option in OPTIMIZERS for key in reads(option) if key != "name"]


@pytest.mark.parametrize(("option", "key"), PAIRS, ids=[f"{option}-{key}" for option, key in PAIRS])
def test_a_key_the_option_reads_reaches_the_optimizer(option: str, key: str) -> None:
    default = _build(OptimizerConfig(name=option))
    changed = _build(OptimizerConfig(name=option, **{key: NON_DEFAULT[key]}))
    assert _seen(changed) != _seen(default), f"optimizer={option} ignores optimizer.{key}"


def test_every_key_an_option_does_not_read_is_refused_when_set() -> None:
    for option in OPTIMIZERS:
        unread = [key for key in KEYS if key not in reads(option)]
        for key in KEYS:
            errors = unread_keys(option, {f"optimizer.{key}": "command line"})
            if key not in unread:
                assert errors == [], (option, key)
                continue
            [error] = errors
            assert error.keys == (f"optimizer.{key}",)
            assert f"optimizer={option} does not read it" in error.message
            assert f"Remove optimizer.{key} from the command line" in error.message
        set_by = {f"optimizer.{key}": "recipe=mine" for key in KEYS}
        assert len(unread_keys(option, set_by)) == len(unread)
        assert unread_keys(option, {}) == []  # keys at their defaults are never refused


def test_adafactor_receives_its_keys_and_the_weight_decay() -> None:
    cfg = OptimizerConfig(
        name="adafactor", eps=1e-30, eps2=1e-2, beta2_decay=-0.5, clip_threshold=2.0, weight_decay=0.1
    )
    opt = _build(cfg)
    assert isinstance(opt, torch.optim.Adafactor)
    assert opt.defaults["eps"] == (1e-30, 1e-2)
    assert (opt.defaults["beta2_decay"], opt.defaults["d"]) == (-0.5, 2.0)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # matrices decay, biases do not
    assert "optimizer.beta2_decay" in unread_keys("adafactor", {"optimizer.betas": "command line"})[0].message


def test_the_adafactor_option_steps_as_torchs_defaults_and_takes_eps_from_the_command_line() -> None:
    """optimizer=adafactor reproduces torch's Adafactor at its defaults bit for bit (eps[0] is float32's machine
    epsilon, what torch picks for float32 weights), and a composed optimizer.eps reaches torch as eps[0]."""
    spec, errors = compose.validate(compose.compose(["optimizer=adafactor", "optimizer.eps=1e-30"]))
    assert errors == [] and spec is not None
    assert _build(spec.optimizer).defaults["eps"] == (1e-30, 1e-3)
    spec, _ = compose.validate(compose.compose(["optimizer=adafactor"]))
    ours, reference = _model(), _model()
    opt = _build(spec.optimizer, ours)
    torch_default = torch.optim.Adafactor(param_groups(reference.named_parameters(), spec.optimizer), lr=1e-2)
    batch = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    for model, optimizer in ((ours, opt), (reference, torch_default)):
        for _ in range(3):
            model(batch).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), reference.parameters(), strict=True))


def test_recipes_and_chosen_files_are_held_to_it_too(tmp_path: Path) -> None:
    """A file of overrides that sets a key the optimizer ignores is named; the default adamw refuses momentum."""
    experiment = tmp_path / "experiment" / "sgd_eps.yaml"
    experiment.parent.mkdir()
    experiment.write_text(
        "# @package _global_\ndefaults:\n  - override /optimizer: sgd\noptimizer:\n  eps: 1.0e-6\n"
    )
    [error] = precheck(command_line.normalize(["--config-dir", str(tmp_path), "+experiment=sgd_eps"]))
    assert error.keys == ("optimizer.eps",) and "by experiment=sgd_eps" in error.message
    [error] = precheck(["optimizer.momentum=0.5"])
    assert "optimizer=adamw does not read it" in error.message and "reads it (sgd" in error.message
    assert precheck(["optimizer=sgd", "optimizer.momentum=0.5", "optimizer.nesterov=true"]) == []


def test_the_command_line_refuses_an_unread_key_before_anything_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "optimizer=sgd",
            "optimizer.betas=[0.8,0.9]",
            f"run_dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    message = " ".join(result.stderr.split())
    assert "optimizer.betas is set (on the command line) but optimizer=sgd does not read it" in message
    assert "Traceback" not in result.stderr and not run_dir.exists()


def test_a_sweep_reports_the_point_whose_optimizer_ignores_a_key() -> None:
    line = command_line.normalize(["-m", "optimizer=adamw,sgd", "optimizer.betas=[0.8,0.9]"])
    [error] = precheck(line)
    assert (
        error.message.startswith("sweep point 1 (optimizer=sgd")
        and "optimizer=sgd does not read" in error.message
    )


def test_offloaded_adamw_refuses_a_kernel_choice_deepspeeds_cpu_adam_ignores() -> None:
    [error] = precheck(["parallel=zero3_offload", "optimizer.implementation=foreach"])
    assert error.keys == ("optimizer.implementation", "parallel.offload_optimizer")
    assert "DeepSpeed's CPU Adam" in error.message
