"""The vocabulary-parallel cross-entropy on 2 real gloo ranks equals plain cross-entropy of the gathered logits.

Each rank holds its half of the vocabulary of [B, T, vocab] logits as a DTensor (Shard(-1)); the
loss (launcher.components.model.vocab_parallel) and the logits' gradient it returns must equal
F.cross_entropy's on the whole tensor to float32 rounding, with ignored (-100) rows, targets on
both ranks, float32 and bfloat16 logits (the maths in float32, the gradient in the logits' dtype).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from conftest import free_port

VOCAB, ROWS = 50, (3, 7)  # 25 ids per rank; the largest logits fall on either rank


def _compare(dtype: torch.dtype) -> dict[str, float]:
    """Loss and gradient differences between the sharded loss and the whole-tensor reference, on this rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from launcher.components.model.loss import lm_loss

    torch.manual_seed(0)  # the same whole tensors on both ranks
    whole = (torch.randn(*ROWS, VOCAB) * 4).to(dtype)
    labels = torch.randint(0, VOCAB, ROWS)
    labels[0, :3] = -100
    labels[2, -1] = -100
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    logits = distribute_tensor(whole, mesh, [Shard(2)]).requires_grad_(True)
    loss, counted = lm_loss(logits, labels)
    (loss * 0.5).backward()
    assert isinstance(logits.grad, DTensor) and logits.grad.placements == (Shard(2),)
    assert logits.grad.dtype == dtype and logits.grad.to_local().shape == (*ROWS, VOCAB // 2)
    reference = whole.float().requires_grad_(True)
    expected = F.cross_entropy(reference.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    (expected * 0.5).backward()
    grad = logits.grad.full_tensor().float()
    return {
        "loss": abs(loss.item() - expected.item()) / expected.item(),
        "grad": (grad - reference.grad.to(dtype).float()).abs().max().item(),
        "ignored": grad[labels == -100].abs().max().item(),
        "counted": int(counted),
        "plain": float(type(loss) is torch.Tensor and loss.dtype == torch.float32),
    }


def _rank(rank: int, port: int, out: str) -> None:
    """One gloo rank: the comparison for float32 and bfloat16 logits, written to rank<N>.json."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    rows = {str(dtype): _compare(dtype) for dtype in (torch.float32, torch.bfloat16)}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def test_loss_and_gradient_equal_cross_entropy_of_the_gathered_logits(tmp_path: Path) -> None:
    mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in (0, 1):
        rows = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for dtype, row in rows.items():
            assert row["loss"] < 1e-6, (rank, dtype, row)
            # float32: rounding; bfloat16: the same float32 gradient, each rounded once to bfloat16
            assert row["grad"] <= (1e-6 if "float32" in dtype else 2**-8), (rank, dtype, row)
            assert row["ignored"] == 0.0 and row["counted"] == 3 * 7 - 4 and row["plain"] == 1.0, row
