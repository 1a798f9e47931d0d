"""Memory techniques on the real model: same gradients with checkpointing and offload, less activation memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from launcher.components import memory
from launcher.components.model.gpt import GPT
from launcher.components.model.loss import lm_loss
from launcher.config.memory import MemoryConfig
from launcher.config.model import ModelConfig

SMALL = ModelConfig(n_layer=4, n_head=2, d_model=32, max_seq_len=64, dropout=0.1)


def _grads(cfg: MemoryConfig) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of one fp32 forward/backward, with dropout on (checkpointing must replay its RNG)."""
    torch.manual_seed(0)
    model = memory.apply(GPT(SMALL), cfg)
    ids = torch.randint(0, 256, (3, 33), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    loss_sum, count = lm_loss(model(ids[:, :-1]), ids[:, 1:])
    (loss_sum / count).backward()
    return float(loss_sum.detach()), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "cfg",
    [
        MemoryConfig(activation_checkpointing="blocks"),
        MemoryConfig(activation_checkpointing="blocks", checkpoint_every=2),
        MemoryConfig(activation_checkpointing="attention"),
        MemoryConfig(offload_activations=True),
        MemoryConfig(activation_checkpointing="blocks", offload_activations=True),
    ],
    ids=["blocks", "every-2", "attention", "offload", "blocks+offload"],
)
def test_same_loss_and_gradients_as_without(cfg: MemoryConfig) -> None:
    base_loss, base = _grads(MemoryConfig())
    loss, grads = _grads(cfg)
    assert loss == base_loss
    assert grads.keys() == base.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, base[name], rtol=1e-6, atol=1e-7, msg=name)


def test_checkpointed_modules_and_names_are_kept() -> None:
    model = GPT(SMALL)
    names = [n for n, _ in model.named_parameters()]
    chosen = memory.checkpointed_modules(
        model, MemoryConfig(activation_checkpointing="blocks", checkpoint_every=3)
    )
    assert chosen == [model.blocks[0], model.blocks[3]]
    attn = memory.checkpointed_modules(model, MemoryConfig(activation_checkpointing="attention"))
    assert attn == [b.attn for b in model.blocks]
    memory.apply(model, MemoryConfig(activation_checkpointing="blocks"))
    assert [n for n, _ in model.named_parameters()] == names  # state-dict keys unchanged


def test_empty_cache_hook_is_cuda_only() -> None:
    cfg = MemoryConfig(empty_cache_steps=5)
    assert memory.empty_cache_hook(cfg, "cpu") is None  # no caching allocator on CPU: a documented no-op
    assert memory.empty_cache_hook(MemoryConfig(), "cuda") is None
    assert callable(memory.empty_cache_hook(cfg, "cuda"))


_MEASURE = """
import json, re, sys, torch
from launcher.components import memory
from launcher.components.model.gpt import GPT
from launcher.config.model import ModelConfig
from launcher.components.model.loss import lm_loss
torch.set_num_threads(1)
model = GPT(ModelConfig(n_layer=8, n_head=2, d_model=64, max_seq_len=512))
model = memory.apply(model, memory.MemoryConfig(activation_checkpointing=sys.argv[1]))
ids = torch.randint(0, 256, (8, 513))
def rss(field):
    return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
warm = lm_loss(model(ids[:1, :16]), ids[:1, 1:17])[0]  # fault in the library code a first pass touches
warm.backward()
model.zero_grad(set_to_none=True)
del warm
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
before = rss("VmRSS")
loss_sum, count = lm_loss(model(ids[:, :-1]), ids[:, 1:])
(loss_sum / count).backward()
print(json.dumps({"extra_peak_bytes": rss("VmHWM") - before}))
"""


def _extra_peaks(*modes: str) -> list[int]:
    """The extra peak of each mode, measured in processes of their own started together (each reads its own
    resident set, so they do not disturb each other; started one after another they cost three imports of torch).
    """
    # A fixed mmap threshold makes glibc return every freed tensor buffer to the OS at once, so the
    # resident set follows live tensors instead of what malloc keeps for reuse.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    started = [
        subprocess.Popen(
            [sys.executable, "-c", _MEASURE, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for mode in modes
    ]
    peaks = []
    for proc in started:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        peaks.append(json.loads(out.strip().splitlines()[-1])["extra_peak_bytes"])
    return peaks


def test_cuda_alloc_conf_reaches_a_cuda_ranks_environment_only(monkeypatch) -> None:
    from launcher.config.memory import CUDA_ALLOC_ENV
    from launcher.front import compose
    from launcher.rank.worker import configure_process

    spec, errors = compose.validate(compose.compose(['memory.cuda_alloc_conf="expandable_segments:True"']))
    assert not errors, errors
    monkeypatch.setenv("WORLD_SIZE", "1")  # configure_process leaves a launched rank's variables alone
    for name in CUDA_ALLOC_ENV:
        monkeypatch.delenv(name, raising=False)
    configure_process(spec, "cpu")
    assert not any(name in os.environ for name in CUDA_ALLOC_ENV)  # the CPU allocator has no such options
    configure_process(spec, "cuda")
    assert [os.environ[name] for name in CUDA_ALLOC_ENV] == ["expandable_segments:True"] * 2


def test_checkpointing_lowers_peak_memory() -> None:
    """Peak resident memory of one forward/backward in a fresh process, where activations dominate.

    Measured here (8 blocks, d_model 64, 8 x 512 tokens): about 150 MB without checkpointing, 30 MB
    with every block checkpointed, 116 MB with attention only.
    """
    plain, blocks, attention = _extra_peaks("none", "blocks", "attention")
    assert blocks < 0.5 * plain, (blocks, plain)
    assert attention < 0.9 * plain, (attention, plain)


def test_hugging_face_model_is_checkpointed_through_its_own_switch() -> None:
    pytest.importorskip("transformers")
    from launcher.components.model.hf import build_hf_model

    cfg = ModelConfig(kind="hf", hf_config="llama", n_layer=2, n_head=2, d_model=32, d_ff=64)
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    grads = []
    for mem in (MemoryConfig(), MemoryConfig(activation_checkpointing="blocks")):
        torch.manual_seed(0)
        model = memory.apply(build_hf_model(cfg), mem)
        loss_sum, count = lm_loss(model(ids[:, :-1]), ids[:, 1:])
        (loss_sum / count).backward()
        grads.append([p.grad for p in model.parameters()])
    assert model.hf.is_activation_checkpointing
    for with_ckpt, plain in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(with_ckpt, plain, rtol=1e-6, atol=1e-7)
