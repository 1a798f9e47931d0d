"""torch.compile per block matches eager numerically, with activation checkpointing traced inside.

One test on purpose: a cold compile takes about 20 s on a CPU; Inductor's cache (by default under
/tmp/torchinductor_$USER, or TORCHINDUCTOR_CACHE_DIR) makes later runs take a few seconds.
"""

from __future__ import annotations

import pytest
import torch

from launcher.components import compile as compiling
from launcher.components import memory
from launcher.components.model.gpt import GPT
from launcher.components.model.loss import lm_loss
from launcher.config.model import ModelConfig


def _losses(mode: str) -> tuple[list[float], list[str]]:
    torch.manual_seed(0)
    model = memory.apply(GPT(ModelConfig(n_layer=2, n_head=2, d_model=32, max_seq_len=64)),
                         memory.MemoryConfig(activation_checkpointing="blocks"))  # fmt: skip
    model = compiling.apply(model, compiling.CompileConfig(mode=mode))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    curve = []
    for _ in range(3):
        loss_sum, count = lm_loss(model(ids[:, :-1]), ids[:, 1:])
        (loss_sum / count).backward()
        optimizer.step()
        optimizer.zero_grad()
        curve.append(float(loss_sum.detach() / count))
    return curve, list(model.state_dict())


def test_compiled_blocks_match_eager() -> None:
    eager, eager_keys = _losses("off")
    compiled, compiled_keys = _losses("default")
    assert compiled == pytest.approx(eager, rel=1e-6, abs=1e-6)
    assert compiled_keys == eager_keys  # compiled in place: checkpoints load either way
