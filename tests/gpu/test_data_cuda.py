"""The data path on CUDA: batches built ahead by a thread in pinned memory, resume from the loop's position (skipped without a GPU)."""

from __future__ import annotations

import pytest

from conftest import TINY, losses, run_inline
from launcher.components.data.loader import BackgroundBatches
from launcher.components.data.sequences import BatchStream, PackedSequences
from launcher.components.data.tokens import TokenStore

pytestmark = pytest.mark.gpu


def test_background_batches_are_pinned() -> None:
    import torch

    tokens = (torch.arange(23 * 4 + 1) % 251).to(torch.uint8)
    dataset = PackedSequences(TokenStore.of_stream(tokens, separator=None), 4)
    batches = BackgroundBatches(BatchStream(dataset, micro_batch_size=3, seed=0), pin_memory=True)
    assert all(tensor.is_pinned() for tensor in batches.next_batch().values())
    batches.close()


def test_resume_on_cuda_is_exact_with_batches_built_ahead(tmp_path) -> None:
    args = [*TINY, "launcher.device=cuda", "checkpoint.every=5"]
    assert run_inline(args, tmp_path / "straight") == 0
    split = tmp_path / "split"
    assert run_inline([*args, "train.stop_after=10"], split) == 0
    assert run_inline([*args, "resume=auto"], split) == 0
    want, got = losses(tmp_path / "straight"), losses(split)
    for step in want:  # the same batches; CUDA kernels may use atomics (embedding backward): up to reordering
        assert got[step] == pytest.approx(want[step], rel=1e-5)
