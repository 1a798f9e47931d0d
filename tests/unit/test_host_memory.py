"""The loop's CPU allocator policy: freed blocks stay in malloc's heap for the next step, none is faulted in again."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from launcher.config.memory import MemoryConfig
from launcher.rank import host_memory
from launcher.rank.engine import Engine

pytestmark = pytest.mark.skipif(host_memory._glibc() is None, reason="the policy is glibc's mallopt")

STEPS = """
import json, resource, sys, torch
from launcher.components.model.build import build_model
from launcher.components.model.loss import lm_loss
from launcher.config.model import ModelConfig
from launcher.rank import host_memory

torch.manual_seed(0)
model = build_model(ModelConfig(vocab_size=256))  # gpt_tiny
optimizer = torch.optim.AdamW(model.parameters(), fused=True)
ids = torch.randint(0, 256, (16, 128))

def step():
    loss_sum, count = lm_loss(model(ids), ids)
    (loss_sum / count).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

def faults_per_step():
    for _ in range(4):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(6):
        step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 6

def resident_mib():
    status = open("/proc/self/status").read().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024

out = {"default": faults_per_step()}
with host_memory.reuse_freed_memory(True) as kept:
    out.update(kept=kept, loop=faults_per_step(), held=resident_mib())
out["after"] = resident_mib()
print(json.dumps(out))
"""


def test_a_training_step_reuses_freed_pages_in_the_loop_and_returns_them_after() -> None:
    """gpt_tiny's steps in a fresh process (a process's thresholds stay fixed once any mallopt call
    sets them): with glibc's defaults each step faults pages in again, in the loop almost none."""
    done = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, check=True)
    numbers = json.loads(done.stdout.splitlines()[-1])
    assert numbers["kept"]
    assert numbers["default"] > 600, numbers  # measured 890-4,000 per step
    assert numbers["loop"] < numbers["default"] / 5, numbers  # measured 0-210
    assert numbers["after"] < numbers["held"] - 8, numbers  # on exit the free heap goes back to the kernel


def test_disabled_it_leaves_malloc_alone() -> None:
    with host_memory.reuse_freed_memory(False) as kept:
        assert not kept


@pytest.mark.parametrize(
    ("device", "reuse", "kept"), [("cpu", True, True), ("cpu", False, False), ("cuda", True, False)]
)
def test_the_loop_keeps_freed_memory_on_cpu_ranks_unless_told_not_to(
    device: str, reuse: bool, kept: bool
) -> None:
    memory = MemoryConfig(cpu_malloc_reuse=reuse)
    loop = SimpleNamespace(device=torch.device(device), spec=SimpleNamespace(memory=memory))
    with Engine.loop_policies(loop) as policy:
        assert policy is kept
        assert not gc.isenabled()  # with the collector's policy, as before
    assert gc.isenabled()
