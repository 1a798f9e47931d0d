"""Tensor parallel's head is split over the vocabulary: a rank holds its vocab / tp_size slice of the logits.

The parity of the losses with one process (sequence parallelism on and off, FSDP2 x TP, a tied and an
untied Hugging Face head) is held by tests/integration/test_fsdp_tp.py and test_hf_pretrained.py; this
checks the layout itself on rank 0 of torch's fake process group of 2 (its collectives return at
once, so shapes and placements are real and values are not looked at), and the planner's logits term.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from launcher.components.model.gpt import GPT
from launcher.config.model import ModelConfig
from launcher.plan.activations import ActivationShape, head_bytes, loss_grad_bytes

VOCAB = 256


@pytest.fixture
def tp_mesh():
    """A tensor-parallel mesh of 2 ranks on torch's fake process group, this process its rank 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_rank_holds_its_vocabulary_slice_of_the_logits(tp_mesh, sequence_parallel: bool) -> None:
    from torch.distributed.tensor import DTensor, Shard

    from launcher.parallel.tensor_parallel import apply_tensor_parallel

    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=1, n_head=2, d_model=32, vocab_size=VOCAB, max_seq_len=16))
    model = apply_tensor_parallel(model, tp_mesh, sequence_parallel=sequence_parallel)
    head, embedding = model.lm_head.weight, model.tok_emb.weight
    assert head is embedding, "the tied head and embedding are one parameter"
    assert isinstance(head, DTensor) and head.placements == (Shard(0),)
    assert head.to_local().shape == (VOCAB // 2, 32)
    logits = model(torch.randint(0, VOCAB, (2, 8)))
    assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
    assert logits.shape == (2, 8, VOCAB) and logits.to_local().shape == (2, 8, VOCAB // 2)


def test_the_planner_counts_a_ranks_vocabulary_slice() -> None:
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=64, vocab_size=32_000, max_seq_len=1024)
    whole = ActivationShape(micro_batch=4, seq_len=1024, act_bytes=2)
    split = ActivationShape(micro_batch=4, seq_len=1024, act_bytes=2, tp_size=4)
    slice_bytes = 4 * 1024 * 32_000 // 4 * 4  # one float32 [rows, vocab / 4] slice
    assert loss_grad_bytes(cfg, whole) == 2 * 4 * slice_bytes  # the plain loss's two gradients
    assert loss_grad_bytes(cfg, split) == 0  # its gradient is made in the kept softmax slice
    logits = 4 * 1024 * 32_000 * (4 + 2)  # float32 log-probabilities and the 16-bit logits
    assert head_bytes(cfg, whole) - head_bytes(cfg, split) == pytest.approx(
        0.75 * logits + loss_grad_bytes(cfg, whole) - loss_grad_bytes(cfg, split), rel=0.01
    )
