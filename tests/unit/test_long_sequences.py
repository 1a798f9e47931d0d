"""Long sequences on CPU: attention paths, the chunked loss and selective checkpointing against the existing paths."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from launcher.components import memory
from launcher.components.model.build import build_model
from launcher.components.model.long_context import loss_chunk_count
from launcher.components.model.loss import HeadOutputs, lm_loss
from launcher.components.objectives.distillation import kd_loss_sum
from launcher.config.memory import MemoryConfig
from launcher.config.model import ModelConfig

VOCAB, SEQ = 97, 48
CFG = ModelConfig(n_layer=2, n_head=2, d_model=32, d_ff=64, max_seq_len=SEQ, vocab_size=VOCAB)
# row 0 packs three documents; row 1 starts inside a document (positions from 5), then one more
POSITIONS = torch.stack(
    [
        torch.cat([torch.arange(10), torch.arange(20), torch.arange(18)]),
        torch.cat([torch.arange(5, 35), torch.arange(18)]),
    ]
)
IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
LABELS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
LABELS[0, :4] = -100


class Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op creates (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def _step(
    kind: str = "gpt", attention: str = "sdpa", chunks: str = "1", mode: str = "none", matmuls: str = "all"
):
    """(loss, flat gradients, shapes created) of one forward + backward of a fresh, seeded model.

    kind: gpt (built-in), hf (transformers Llama preset) or hf-gpt2 (transformers GPT-2 preset).
    """
    torch.manual_seed(0)
    preset = {"hf": "llama", "hf-gpt2": "gpt2"}.get(kind)
    cfg = dataclasses.replace(CFG, kind="hf" if preset else "gpt", attention=attention, hf_config=preset)
    model = build_model(cfg)
    model.loss_chunks = chunks
    memory.apply(model, MemoryConfig(activation_checkpointing=mode, selective_matmuls=matmuls))
    with Shapes() as seen:
        loss, _ = lm_loss(model(IDS, position_ids=POSITIONS), LABELS)
        loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return loss.detach(), grads, seen.shapes


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    assert ((a - b).norm() / b.norm()).item() < tol


@pytest.mark.parametrize("kind", ["gpt", "hf", "hf-gpt2"])
def test_varlen_matches_the_dense_mask_and_allocates_no_t_by_t_tensor(kind: str) -> None:
    dense_loss, dense_grads, dense_shapes = _step(kind, "sdpa")
    loss, grads, shapes = _step(kind, "varlen")
    torch.testing.assert_close(loss, dense_loss, rtol=1e-5, atol=0)
    _close(grads, dense_grads, 1e-5)
    spans = {SEQ, 10, 20, 18, 30}  # nor a span-by-span one: SDPA's math path would keep those for backward
    square = [s for s in shapes if len(s) >= 2 and s[-1] == s[-2] and s[-1] in spans]
    assert not square, f"varlen created {square}"
    assert any(s[-2:] == (SEQ, SEQ) for s in dense_shapes)  # the check sees the dense path's mask


def test_flex_forward_matches_the_dense_mask_on_cpu() -> None:
    """FlexAttention's forward runs on CPU (its backward is CUDA-only): logits equal the dense path's."""
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(CFG, attention="flex"))
    with torch.no_grad():
        flex = model(IDS, position_ids=POSITIONS)
        model.cfg = dataclasses.replace(CFG, attention="sdpa")
        dense = model(IDS, position_ids=POSITIONS)
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["gpt", "hf"])
def test_chunked_loss_matches_the_whole_logits_and_never_holds_them(kind: str) -> None:
    whole_loss, whole_grads, whole_shapes = _step(kind, chunks="1")
    loss, grads, shapes = _step(kind, chunks="4")
    torch.testing.assert_close(loss, whole_loss, rtol=1e-6, atol=0)
    _close(grads, whole_grads, 1e-6)
    full = (2, SEQ, VOCAB)
    assert full in whole_shapes
    # [rows, vocab] tensors: one chunk of token rows at a time (and the head's weight, [d_model, vocab])
    rows = {torch.Size(s[:-1]).numel() for s in shapes if s[-1:] == (VOCAB,)}
    assert rows - {CFG.d_model} == {2 * SEQ // 4}


def test_chunked_distillation_matches_whole_logits() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(2, SEQ, 16, requires_grad=True)
    head = torch.nn.Linear(16, VOCAB, bias=False)
    teacher = torch.randn(2, SEQ, VOCAB)
    whole = kd_loss_sum(head(hidden), teacher, LABELS, temperature=2.0, loss="forward_kl")
    (g_whole,) = torch.autograd.grad(whole, hidden)
    chunked = kd_loss_sum(HeadOutputs(hidden, head, 3), teacher, LABELS, temperature=2.0, loss="forward_kl")
    (g_chunked,) = torch.autograd.grad(chunked, hidden)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)
    _close(g_chunked, g_whole, 1e-6)


def test_auto_chunks_only_large_logits() -> None:
    assert loss_chunk_count("auto", tokens=16 * 256, vocab=256) == 1  # tiny: whole logits
    assert (
        loss_chunk_count("auto", tokens=8 * 4096, vocab=128_256) == 251
    )  # 15.7 GiB float32 -> 64 MiB chunks
    assert loss_chunk_count("8", tokens=4, vocab=10) == 4  # never more chunks than tokens


@pytest.mark.parametrize("kind", ["gpt", "hf"])
@pytest.mark.parametrize("matmuls", ["all", "every_other"])
def test_selective_checkpointing_is_bitwise_and_saves_less(kind: str, matmuls: str) -> None:
    def saved_bytes(mode: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, grads, _ = _step(kind, mode=mode, matmuls=matmuls)
        return loss, grads, total

    loss, grads, none_bytes = saved_bytes("none")
    sel_loss, sel_grads, sel_bytes = saved_bytes("selective")
    assert torch.equal(sel_loss, loss) and torch.equal(sel_grads, grads)
    assert sel_bytes < none_bytes


@pytest.mark.parametrize(
    ("argv", "keys", "phrase"),
    [
        (["model.attention=flex"], ("model.attention",), "CUDA only"),
        (
            ["model.attention=flex", "model.dropout=0.1"],
            ("model.attention", "model.dropout"),
            "no attention dropout",
        ),
        (["model.attention=dense"], ("model.attention",), "Choose one of"),
        (["train.loss_chunks=0"], ("train.loss_chunks",), "auto or a whole number"),
        (
            ["memory.selective_matmuls=every_other"],
            ("memory.selective_matmuls", "memory.activation_checkpointing"),
            "memory=selective",
        ),
    ],
)
def test_long_sequence_rules(argv: list[str], keys: tuple[str, ...], phrase: str) -> None:
    from launcher.front.cli import precheck

    errors = {e.keys: e.message for e in precheck(argv)}
    assert keys in errors, errors
    assert phrase in errors[keys]


def test_planner_counts_one_chunk_the_dense_mask_and_selective_saves() -> None:
    from launcher.front.compose import compose, strip_hydra
    from launcher.plan.planner import plan
    from launcher.spec import to_spec

    def activations(*argv: str) -> int:
        base = ["data.seq_len=256", "train.micro_batch_size=8", "model.vocab_size=32000", "data.packing=true"]
        return plan(to_spec(strip_hydra(compose([*base, *argv]))), device_type="cpu").activations

    assert activations("train.loss_chunks=8") < activations("train.loss_chunks=1")
    assert activations("model.attention=varlen") < activations("model.attention=sdpa")
    none, blocks = activations(), activations("memory.activation_checkpointing=blocks")
    selective = activations("memory.activation_checkpointing=selective")
    assert blocks < selective < none
