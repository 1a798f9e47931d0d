"""precision=fp8 (torchao float8 training) on a GPU of compute capability 8.9+: it trains, its losses follow
bf16's, and the linear layers really are float8 ones. Skipped without such a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import TINY, losses, run_inline

pytestmark = pytest.mark.gpu
# TINY's dims are multiples of 16 (d_model 64, d_ff 256; 4 x 32 tokens a micro batch), as fp8 GEMMs need
CUDA = [*TINY, "launcher.device=cuda", "checkpoint.every=null"]


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_trains_close_to_bf16(tmp_path, recipe: str) -> None:
    if _capability() < (8, 9) or (recipe == "rowwise" and _capability() < (9, 0)):
        pytest.skip(f"fp8 {recipe} needs compute capability {'9.0' if recipe == 'rowwise' else '8.9'}+")
    assert run_inline([*CUDA, "precision=bf16"], tmp_path / "bf16") == 0
    assert run_inline([*CUDA, "precision=fp8", f"precision.fp8_recipe={recipe}"], tmp_path / recipe) == 0
    want, got = losses(tmp_path / "bf16"), losses(tmp_path / recipe)
    assert all(math.isfinite(loss) for loss in got.values())
    assert got[20] < got[1] - 0.5  # it learns
    # fp8 rounds each matmul input to 3 mantissa bits (e4m3) against bf16's 7: a few percent per step at most
    assert got[20] == pytest.approx(want[20], rel=0.05)
