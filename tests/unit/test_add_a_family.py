"""docs/architecture.md's recipe "A model family", followed on a copy of the package: a throwaway decoder
family `toy` (its own module names: `embed`, `layers.N.wq`, `w_in`, `final_norm`, `out`, none of the GPT's)
is added as a FAMILIES entry and its module only, and trains under tensor parallelism inside FSDP2 on 4
ranks and in 2 pipeline stages: the tensor-parallel plan and the stage cut can only come from the family,
and each rank's log says what it got (one of the two heads; one of the two layers).

A 4-rank run takes about 25 s of CPU (about a minute of wall time on a busy 2-core machine), the
2-stage run about 10 s: the 4-rank run is the smallest that has both axes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from package_copy import copy_package, edit, recipe_paths, run_python

RECIPE_HEADING = "**A model family**"

FAMILY = '''
"""A throwaway decoder family: RMSNorm layers with a SiLU MLP, names of its own, no positions but causality."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from launcher.components.model.family import TensorParallelPlan
from launcher.components.model.shape import ModelShape
from launcher.config.model import ModelConfig, vocab_size


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.head_dim, self.heads, self.told = d // cfg.n_head, cfg.n_head, False
        self.pre_mix, self.pre_ff = nn.RMSNorm(d), nn.RMSNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w_in, self.w_out = nn.Linear(d, 2 * d, bias=False), nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.pre_mix(x)
        q, k, v = (w(h) for w in (self.wq, self.wk, self.wv))
        heads = q.shape[-1] // self.head_dim  # the local heads under tensor parallelism
        if not self.told:  # what the test reads in the rank's log: the plan split the heads
            print(f"toy: {heads} of {self.heads} heads on this rank", flush=True)
            self.told = True
        q, k, v = (z.view(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.wo(y)
        return x + self.w_out(F.silu(self.w_in(self.pre_ff(x))))


class ToyLM(nn.Module):
    model_family: ClassVar[str] = "toy"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.loss_chunks = "1"
        self.embed = nn.Embedding(vocab_size(cfg), cfg.d_model)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layer))
        self.final_norm = nn.RMSNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, vocab_size(cfg), bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)
        if cfg.tie_embeddings:
            self.out.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = input_ids if self.embed is None else self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return x if self.out is None else self.out(self.final_norm(x))


def build(cfg: ModelConfig, *, empty: bool = False, announce: bool = True) -> nn.Module:
    if empty:
        raise ValueError("the toy family has no folder to load after sharding.")
    return ToyLM(cfg)


def init_on_meta(cfg: ModelConfig) -> bool:
    return False


def from_folder(cfg: ModelConfig) -> bool:
    return False


def folder(cfg: ModelConfig) -> str | None:
    return None


def shape(cfg: ModelConfig) -> ModelShape:
    d, n, rows = cfg.d_model, cfg.n_layer, vocab_size(cfg)
    linears = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w_in": (d, 2 * d), "w_out": (2 * d, d)}
    layer = sum(i * o for i, o in linears.values()) + 2 * d
    total = rows * d * (1 if cfg.tie_embeddings else 2) + n * layer + d
    equivalent = dataclasses.replace(cfg, kind="gpt", d_ff=2 * d, vocab_size=rows)
    return ModelShape(num_params=total, block_linears=linears, equivalent=equivalent)


def source(cfg: ModelConfig) -> str:
    return "toy decoder"


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    return model.layers


def checkpointing(model: nn.Module, every_n_layers: int, options: dict | None) -> bool:
    return False


def tp_plan(model: nn.Module, *, sequence_parallel: bool) -> TensorParallelPlan:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if sequence_parallel:
        raise ValueError("the toy family has no sequence-parallel plan.")
    col = {name: ColwiseParallel() for name in ("wq", "wk", "wv", "w_in")}
    row = {name: RowwiseParallel() for name in ("wo", "w_out")}
    return TensorParallelPlan(layer={**col, **row}, head="out", embedding="embed")


def ep_plan(model: nn.Module) -> Any:
    return None


def stage(model: nn.Module, layers: range, *, first: bool, last: bool) -> nn.Module:
    from launcher.components.model.stage_layers import StageLayers

    model.layers = StageLayers({i: model.layers[i] for i in layers})
    print(f"toy: stage of layers {list(layers)}", flush=True)
    if not first:
        model.embed = None
    if not last:
        model.final_norm, model.out = None, None
    return model


def tied_names(cfg: ModelConfig) -> tuple[str, str] | None:
    return ("embed.weight", "out.weight") if cfg.tie_embeddings else None


def transformers_prefix() -> str | None:
    return None


def to_transformers(state: dict[str, torch.Tensor], cfg: ModelConfig) -> Any:
    raise ValueError("the toy family has no transformers export.")
'''

BASE = [
    "model.kind=toy", "model.n_layer=2", "model.d_model=32", "model.n_head=2", "data.seq_len=32",
    "data.max_bytes=200000", "train.max_steps=6", "train.log_every=1", "train.eval_every=null",
    "train.eval_at_end=false", "checkpoint.every=null", "checkpoint.save_final=false", "optimizer.lr=3e-3", "scheduler=constant",
    "log.progress=false", "log.summary_table=false", "launcher=local",
]  # fmt: skip


def _follow_the_recipe(root: Path) -> set[str]:
    """Add family `toy` to the package copy at `root`; the repository paths the recipe touched."""
    pkg = root / "launcher"
    (pkg / "components" / "model" / "family_toy.py").write_text(FAMILY)
    edit(pkg / "config" / "model.py", "FAMILIES: dict[str, str] = {\n",
          '    "toy": "launcher.components.model.family_toy",\n')  # fmt: skip
    return {"launcher/components/model/family_toy.py", "launcher/config/model.py"}


def _recipe_paths() -> set[str]:
    """The files docs/architecture.md's recipe names (with `toy` for the family)."""
    return recipe_paths(RECIPE_HEADING, {"<name>": "toy"})


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[str]]:
    root = copy_package(tmp_path_factory.mktemp("add_a_family"))
    return root, _follow_the_recipe(root)


def _train(root: Path, run_dir: Path, *args: str) -> list[float]:
    """Train the toy family on the copy; the logged losses (rank logs under run_dir/logs)."""
    out = run_python(root, "-m", "launcher", *BASE, f"run_dir={run_dir}", *args, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def _log(run_dir: Path, rank: int) -> str:
    """What a rank printed."""
    return (run_dir / "logs" / f"rank_{rank}.log").read_text()


def _assert_trained(losses: list[float]) -> None:
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0] - 0.1, losses


def test_the_recipe_names_every_file_it_takes(package_copy: tuple[Path, set[str]]) -> None:
    _, touched = package_copy
    missing = touched - _recipe_paths()
    assert not missing, f"docs/architecture.md's recipe does not name {sorted(missing)}"


def test_a_family_added_by_the_recipe_trains_under_fsdp_and_tensor_parallel(
    package_copy: tuple[Path, set[str]], tmp_path: Path
) -> None:
    root, _ = package_copy
    losses = _train(
        root, tmp_path / "run", "parallel=fsdp", "parallel.tp_size=2", "launcher.nproc=4",
        "train.micro_batch_size=4",
    )  # fmt: skip
    _assert_trained(losses)
    for rank in range(4):
        assert "toy: 1 of 2 heads on this rank" in _log(tmp_path / "run", rank)


def test_a_family_added_by_the_recipe_trains_in_pipeline_stages(
    package_copy: tuple[Path, set[str]], tmp_path: Path
) -> None:
    root, _ = package_copy
    losses = _train(
        root, tmp_path / "run", "parallel.pp_size=2", "launcher.nproc=2", "train.micro_batch_size=4"
    )
    _assert_trained(losses)
    assert "toy: stage of layers [0]" in _log(tmp_path / "run", 0)
    assert "toy: stage of layers [1]" in _log(tmp_path / "run", 1)
