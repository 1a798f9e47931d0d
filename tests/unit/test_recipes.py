"""Recipes compose and validate (GPU ones fail here only for want of a GPU); recipe=auto chooses by memory."""

from __future__ import annotations

import pytest
from rich.console import Console

from conftest import run_cli
from launcher.front import compose, recipe_auto
from launcher.front.command_line import parse
from launcher.front.recipe_auto import Machine

RECIPES = compose.group_options()["recipe"]
# Keys a rule may name when a GPU recipe meets this CPU-only machine.
HARDWARE_KEYS = {"launcher.device", "launcher.nproc", "precision.bf16", "precision.tf32"}
GiB = 1024**3


def test_the_scenario_recipes_exist() -> None:
    expected = {
        "cpu",
        "small_gpu",
        "large_gpu",
        "multi_gpu_ddp",
        "multi_gpu_fsdp",
        "huge_model_zero3_offload",
    }
    assert expected <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_fails_only_for_hardware(recipe: str) -> None:
    cfg = compose.compose([f"recipe={recipe}"])
    spec, errors = compose.validate(cfg)
    if recipe in ("cpu", "cpu_smoke"):
        assert spec is not None and not errors
    for error in errors:
        assert set(error.keys) <= HARDWARE_KEYS, str(error)


def test_auto_picks_the_cpu_recipe_here_and_says_why() -> None:
    console = Console(record=True, width=200)
    line = recipe_auto.resolve(parse(["recipe=auto", "train.max_steps=5"]), console=console)
    assert line.overrides == ("train.max_steps=5", "recipe=cpu")
    assert "recipe=auto -> recipe=cpu: no CUDA GPU is visible" in console.export_text()


def test_auto_on_the_command_line(tmp_path) -> None:
    result = run_cli(["recipe=auto", "dry_run=true"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "recipe=auto -> recipe=cpu" in result.stderr
    assert "memory plan" in result.stdout and "recipe=cpu" in result.stdout


@pytest.mark.parametrize(
    ("machine", "recipe", "nproc"),
    [
        (Machine(num_gpus=1, gpu_memory_bytes=80 * GiB, gpu_name="H100"), "large_gpu", 1),
        (Machine(num_gpus=1, gpu_memory_bytes=12 * GiB), "small_gpu", 1),
        (Machine(num_gpus=4, gpu_memory_bytes=40 * GiB), "multi_gpu_ddp", 4),
        (Machine(num_gpus=4, gpu_memory_bytes=16 * GiB), "multi_gpu_fsdp", 4),
        (Machine(num_gpus=8, gpu_memory_bytes=24 * GiB), "multi_gpu_fsdp", 8),
        (Machine(num_gpus=2, gpu_memory_bytes=6 * GiB), "huge_model_zero3_offload", 2),
    ],
)
def test_auto_picks_gpu_recipes_by_planned_memory(machine: Machine, recipe: str, nproc: int) -> None:
    # gpt_1b at micro batch 8 x 128 tokens: ~25 GiB per GPU with DDP, ~11 GiB with FSDP over 4
    estimate = recipe_auto.planned_bytes(["model=gpt_1b"])
    choice = recipe_auto.choose(machine, estimate)
    assert (choice.recipe, choice.nproc) == (recipe, nproc), choice.reason
    assert recipe in choice.reason and "per GPU" in choice.reason


def test_auto_falls_back_to_the_recipe_that_needs_least() -> None:
    sizes = {"large_gpu": 90 * GiB, "small_gpu": 5 * GiB, "huge_model_zero3_offload": 7 * GiB}
    choice = recipe_auto.choose(Machine(num_gpus=1, gpu_memory_bytes=4 * GiB), lambda name, _: sizes[name])
    assert choice.recipe == "small_gpu" and "no recipe fits" in choice.reason


def test_auto_rewrite_keeps_a_given_nproc() -> None:
    machine = Machine(num_gpus=4, gpu_memory_bytes=80 * GiB)
    line = recipe_auto.resolve(
        parse(["-m", "recipe=auto", "launcher.nproc=2"]), machine=machine, console=Console(quiet=True)
    )
    assert line.argv == ("-m", "launcher.nproc=2", "recipe=multi_gpu_ddp")
    line = recipe_auto.resolve(parse(["recipe=auto"]), machine=machine, console=Console(quiet=True))
    assert line.overrides == ("recipe=multi_gpu_ddp", "launcher.nproc=4")
