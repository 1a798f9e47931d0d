"""Long sequences on a CUDA device: FlexAttention's block mask trains like the dense document mask (skipped without a GPU)."""

from __future__ import annotations

import pytest

from conftest import TINY, losses, run_inline

pytestmark = pytest.mark.gpu

PACKED = [
    "launcher.device=cuda", "precision=fp32", "data.packing=true", "data.document_mask=true",
    "train.max_steps=6", "checkpoint.every=null", "checkpoint.save_final=false", "train.eval_every=null",
]  # fmt: skip


@pytest.mark.parametrize("model", [[], ["model=hf_llama_tiny", "model.n_layer=2"]], ids=["gpt", "hf-llama"])
def test_flex_trains_like_the_dense_document_mask(tmp_path, model: list[str]) -> None:
    """model.attention=flex (forward and backward on CUDA) gives the dense-mask path's losses, fp32."""
    base = [*TINY, *model, *PACKED]
    assert run_inline([*base, "model.attention=sdpa", "train.loss_chunks=1"], tmp_path / "dense") == 0
    assert run_inline([*base, "model.attention=flex", "train.loss_chunks=4"], tmp_path / "flex") == 0
    dense, flex = losses(tmp_path / "dense"), losses(tmp_path / "flex")
    assert dense.keys() == flex.keys()
    assert all(abs(flex[s] - dense[s]) <= 2e-4 * abs(dense[s]) for s in dense), (dense, flex)
