"""The meta-device build: the same initial values as an eager build, bit for bit, and the same random state
after it; no rank of a sharded run holds the whole model while it is built; the planner counts that build."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from launcher.components.model.gpt import GPT
from launcher.components.model.meta_init import build_on_meta
from launcher.config.model import ModelConfig
from launcher.front import compose
from launcher.front.command_line import of
from launcher.plan.moments import FP32, StepBytes, build_bytes
from launcher.spec import RunSpec

TINY = ModelConfig(kind="gpt", n_layer=2, n_head=4, d_model=64, vocab_size=256, max_seq_len=64)


def _spec(overrides: list[str]) -> RunSpec:
    line = of(overrides)
    cfg, errors = compose.compose_checked(list(line.overrides), line.source)
    assert cfg is not None, errors
    return compose.build(cfg).spec


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_meta_build_gives_the_eager_values_and_random_state(tied: bool) -> None:
    cfg = dataclasses.replace(TINY, tie_embeddings=tied, bias=True)
    torch.manual_seed(7)
    eager, eager_next = GPT(cfg), torch.rand(4)
    torch.manual_seed(7)
    built = build_on_meta(lambda: GPT(cfg))
    assert built is not None
    model, init = built
    meta_next = torch.rand(4)  # drawn before the values are filled: the build alone moved the state on
    assert torch.equal(meta_next, eager_next)
    assert all(p.device.type == "meta" for p in model.parameters())
    init.fill(model, torch.device("cpu"))
    assert (model.lm_head.weight is model.tok_emb.weight) == tied
    for (name, value), (_, expected) in zip(
        model.state_dict().items(), eager.state_dict().items(), strict=True
    ):
        assert torch.equal(value, expected), name


def test_a_constructor_that_reads_its_values_is_built_eagerly() -> None:
    def construct() -> nn.Module:
        layer = nn.Linear(8, 8)
        nn.init.trunc_normal_(layer.weight)  # uniform_, then arithmetic on the drawn values
        return layer

    assert build_on_meta(construct) is None


def test_a_sharded_rank_never_holds_the_whole_model_while_it_builds(tmp_path: Path) -> None:
    """Rank 0 of 2 under FSDP2 on torch's fake process group (collectives return at once), real tensors."""
    from torch.profiler import ProfilerActivity, profile
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from launcher.parallel.dims import DistContext, ParallelDims
    from launcher.rank.build import build_trainable

    spec = _spec(["model=gpt_tiny", "model.n_layer=2", "parallel=fsdp", "launcher=local", "launcher.nproc=2"])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        dims = ParallelDims.of(spec.parallel, 2)
        ctx = DistContext(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), dims=dims)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            trainable = build_trainable(spec, ctx)
    finally:
        dist.destroy_process_group()
    live = peak = 0
    for _, nbytes in sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    ):
        live += nbytes
        peak = max(peak, live)
    whole = sum(p.numel() for p in GPT(spec.model).parameters()) * FP32
    shards = sum(p.to_local().numel() for p in trainable.strategy.model.parameters()) * FP32
    largest = spec.model.d_model * 4 * spec.model.d_model * FP32  # an MLP matrix, the largest parameter
    assert shards == pytest.approx(whole / 2, rel=0.01)
    assert peak < whole  # an eager build holds all of it (and the tied head's first weight) on every rank
    assert peak == pytest.approx(
        shards + largest, rel=0.10
    )  # the shards, one whole parameter, a few small tensors
    step = StepBytes(
        held=shards,
        parameters=shards,
        forward_buffers=0,
        backward_buffers=0,
        activations=0,
        gradients=0,
        shard=2,
    )
    assert build_bytes(spec, step) == shards + largest  # the planner's build moment: the same sum
