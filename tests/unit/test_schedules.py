"""The learning-rate schedules as pure functions, warmup_ratio, and the rules of the schedule's keys and of
schedule-free AdamW (whose warmup is the constant schedule's)."""

from __future__ import annotations

import math

import pytest

from launcher.components.scheduler import lr_factor
from launcher.config.scheduler import SchedulerConfig
from launcher.front import compose
from launcher.front.cli import precheck


def _wsd(shape: str, floor: float = 0.0) -> SchedulerConfig:
    return SchedulerConfig(
        name="wsd", warmup_steps=10, decay_ratio=0.2, decay_shape=shape, min_lr_ratio=floor
    )


@pytest.mark.parametrize(
    ("shape", "at_80", "at_89"),
    [
        ("linear", 0.95, 0.5),
        ("cosine", 0.5 * (1 + math.cos(0.05 * math.pi)), 0.5),
        ("sqrt", 1 - math.sqrt(0.05), 1 - math.sqrt(0.5)),
    ],
)
def test_wsd_warms_up_holds_then_decays_to_the_floor_at_the_last_step(
    shape: str, at_80: float, at_89: float
) -> None:
    """100 steps, 10 of warmup, decay_ratio 0.2: steps 80..99 decay, and step 99 runs at the floor."""
    factor = lr_factor(_wsd(shape), 100)
    assert [factor(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert factor(10) == factor(79) == 1.0  # the stable phase
    assert factor(80) == pytest.approx(at_80)
    assert factor(89) == pytest.approx(at_89)
    assert factor(99) == 0.0
    floored = lr_factor(_wsd(shape, floor=0.1), 100)
    assert floored(99) == pytest.approx(0.1)
    assert floored(89) == pytest.approx(0.1 + 0.9 * at_89)


def test_every_decaying_schedule_honours_the_floor_and_warmup_ratio_counts_steps() -> None:
    for name in ("linear", "cosine", "inverse_sqrt", "wsd"):
        factor = lr_factor(SchedulerConfig(name=name, warmup_steps=1, min_lr_ratio=0.25), 1000)
        assert min(factor(s) for s in range(1000)) == pytest.approx(0.25, abs=2e-3), name
    ratio = SchedulerConfig(name="constant", warmup_steps=999, warmup_ratio=0.05)
    assert [lr_factor(ratio, 200)(s) for s in (0, 9, 10)] == pytest.approx([0.1, 1.0, 1.0])


def test_warmup_ratio_is_written_into_warmup_steps_and_a_typed_warmup_as_well_is_refused() -> None:
    spec, errors = compose.validate(compose.compose(["scheduler.warmup_ratio=0.1", "train.max_steps=55"]))
    assert errors == [] and spec.scheduler.warmup_steps == 5 and spec.scheduler.warmup_ratio == 0.1
    errors = precheck(["scheduler.warmup_ratio=0.1", "scheduler.warmup_steps=5"])
    assert [e.keys for e in errors] == [("scheduler.warmup_steps", "scheduler.warmup_ratio")]
    assert "set by the command line" in errors[0].message


SCHEDULE_RULES = [
    (["scheduler.warmup_ratio=1.0"], ("scheduler.warmup_ratio",), "must be in [0, 1)"),
    (["scheduler.warmup_ratio=nan"], ("scheduler.warmup_ratio",), "finite"),
    (["scheduler=wsd", "scheduler.decay_ratio=0"], ("scheduler.decay_ratio",), "must be in (0, 1]"),
    (["scheduler=wsd", "scheduler.decay_shape=cube"], ("scheduler.decay_shape",), "linear, cosine, sqrt"),
    (
        ["scheduler=wsd", "scheduler.decay_ratio=0.95"],
        ("scheduler.decay_ratio", "scheduler.warmup_steps", "train.max_steps"),
        "overlaps the 20 warmup steps",
    ),
    (["scheduler.decay_ratio=0.3"], ("scheduler.decay_ratio", "scheduler.name"), "Use `scheduler=wsd`"),
    (
        ["scheduler=constant", "scheduler.min_lr_ratio=0"],
        ("scheduler.min_lr_ratio", "scheduler.name"),
        "never decays",
    ),
    (["optimizer=adamw_schedule_free"], ("optimizer.name", "scheduler.name"), "Add `scheduler=constant`"),
    (
        ["optimizer=adamw_schedule_free", "scheduler=constant", "optimizer.implementation=fused"],
        ("optimizer.implementation", "optimizer.name"),
        "no fused kernel",
    ),
    (
        ["optimizer=adamw_schedule_free", "scheduler=constant", "optimizer.betas=[0,0.999]"],
        ("optimizer.betas",),
        "must be above 0",
    ),
    (
        ["optimizer=adamw_schedule_free", "scheduler=constant", "parallel=zero2"],
        ("optimizer.name", "parallel.strategy"),
        "Use parallel=fsdp",
    ),
    (
        ["optimizer=adamw_schedule_free", "scheduler=constant", "prune=magnitude"],
        ("optimizer.name", "prune.method"),
        "optimizer=adamw to prune",
    ),
]


@pytest.mark.parametrize(
    ("argv", "keys", "phrase"), SCHEDULE_RULES, ids=[" ".join(r[0]) for r in SCHEDULE_RULES]
)
def test_schedule_rule_message(argv: list[str], keys: tuple[str, ...], phrase: str) -> None:
    errors = {e.keys: e.message for e in precheck(argv)}
    assert keys in errors, errors
    assert phrase in errors[keys]


def test_schedule_free_with_the_constant_schedule_is_valid() -> None:
    spec, errors = compose.validate(compose.compose(["optimizer=adamw_schedule_free", "scheduler=constant"]))
    assert errors == [] and spec.optimizer.name == "adamw_schedule_free"


def test_the_constant_schedules_warmup_is_schedule_frees_own_bitwise() -> None:
    """The launcher warms schedule-free AdamW up through its LambdaLR (lr x (k+1)/warmup at step k), which
    is exactly the package's own warmup_steps, weights of the average included: the same bits."""
    import schedulefree
    import torch

    from launcher.components.optimizer import OPTIMIZERS
    from launcher.components.scheduler import build_scheduler
    from launcher.config.optimizer import OptimizerConfig

    cfg = OptimizerConfig(name="adamw_schedule_free", lr=1e-2, betas=[0.9, 0.999])
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    theirs.load_state_dict(ours.state_dict())
    opt = OPTIMIZERS["adamw_schedule_free"]([{"params": list(ours.parameters())}], cfg, "cpu")
    schedule = build_scheduler(opt, SchedulerConfig(name="constant", warmup_steps=5), 12)
    own = schedulefree.AdamWScheduleFree(theirs.parameters(), lr=1e-2, betas=(0.9, 0.999), warmup_steps=5)
    opt.train()
    own.train()
    inputs = torch.randn(12, 4, 8, generator=torch.Generator().manual_seed(1))
    for x in inputs:
        for model, optimizer in ((ours, opt), (theirs, own)):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        schedule.step()
    opt.eval()
    own.eval()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_fresh_schedule_free_optimizer_loads_a_dcp_checkpoint_bitwise(tmp_path) -> None:
    """torch's DCP loader (FSDP2, TP checkpoints) steps a fresh optimizer at lr 0 to create its state, which
    schedule-free allows in train mode only, and loads no state where an entry exists: ready_to_load
    prepares both, and the averaged weights and the state come back bit for bit."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from launcher.components.optimizer import OPTIMIZERS
    from launcher.components.schedule_free import ready_to_load
    from launcher.config.optimizer import OptimizerConfig

    cfg = OptimizerConfig(name="adamw_schedule_free", lr=1e-2, betas=[0.9, 0.999])

    def built(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(8, 8)
        return model, OPTIMIZERS["adamw_schedule_free"]([{"params": list(model.parameters())}], cfg, "cpu")

    model, opt = built(0)
    opt.train()
    for x in torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1)):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.eval()  # as a checkpoint holds it
    dcp.save(dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True)), checkpoint_id=tmp_path)
    fresh, fresh_opt = built(1)
    ready_to_load(fresh_opt)  # what launcher.rank.engine does before a checkpoint loads
    state = dict(zip(("model", "optim"), get_state_dict(fresh, fresh_opt), strict=True))  # a template
    dcp.load(state, checkpoint_id=tmp_path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["z"], fresh_opt.state[b]["z"])
    opt.train()
    fresh_opt.train()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
