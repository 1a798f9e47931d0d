"""The routed computation expert parallelism gives transformers' experts modules: each family's own result.

`routed_forward` sorts the token copies by expert and runs the family's expert MLP over them (through the
expert-parallel group when there is one; here, in one process, without): for every MoE family the
launcher trains it must give transformers' own experts forward and its gradients, biases, gpt-oss's
transposed, interleaved and clamped gate included.
"""

from __future__ import annotations

import pytest
import torch

from launcher.components.model.experts import ExpertGroup
from launcher.components.model.hf_expert_parallel import dispatch, is_hf_experts, routed_forward

transformers = pytest.importorskip("transformers")

from moe_assets import MOE_ARCHITECTURES, moe_config  # noqa: E402


def _experts(arch: str) -> torch.nn.Module:
    """The first experts module of a tiny `arch` model in float64 (the sums' order aside), its parameters random."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(arch), dtype=torch.float64)
    module = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
    module.config._experts_implementation = "eager"  # the reference loop (grouped_mm takes no float64)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0, 0.5)
    return module


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_routed_experts_give_transformers_own_forward_and_gradients(arch: str) -> None:
    module = _experts(arch)
    assert is_hf_experts(module)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, 64, generator=generator, dtype=torch.float64)
    index = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(10)])
    weights = torch.rand(10, 2, generator=generator, dtype=torch.float64)
    outs, grads = [], []
    for run in (
        lambda: module(hidden, index, weights),
        lambda: routed_forward(module, hidden, index, weights, None),
    ):
        module.zero_grad()
        out = run()
        out.pow(2).sum().backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-10, atol=1e-10)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-10, atol=1e-10)


def test_dispatch_routes_only_modules_with_a_group() -> None:
    module = _experts("mixtral")
    assert dispatch(module) == []  # no expert_group: transformers' forward stays
    assert "forward" not in module.__dict__
    module.expert_group = ExpertGroup(group=None, rank=0, size=1)  # what expert_parallel.apply sets
    assert dispatch(module) == [""] and "forward" in module.__dict__


def test_experts_that_receive_no_row_stay_in_the_backward() -> None:
    """A rank whose experts receive no token copy still returns an output tied to the arrivals and to every expert
    weight: its backward runs the all-to-alls the other ranks run (else they wait for it) and gives each weight a
    (zero) gradient, for transformers' experts and the built-in GPT's alike."""
    from launcher.components.model.experts import expert_mlp
    from launcher.components.model.hf_expert_parallel import experts_fn

    module = _experts("gpt_oss")  # biases too
    rows = torch.zeros(0, 64, dtype=torch.float64, requires_grad=True)
    out = experts_fn(module)(rows, [0, 0, 0, 0])
    grads = torch.autograd.grad(out.sum(), [rows, *module.parameters()])
    assert out.shape == (0, 64) and all(g is not None and not g.any() for g in grads)
    w_up, w_down = torch.randn(2, 8, 16, requires_grad=True), torch.randn(2, 16, 8, requires_grad=True)
    rows = torch.zeros(0, 8, requires_grad=True)
    out = expert_mlp(rows, w_up, w_down, [0, 0])
    assert out.shape == (0, 8) and len(torch.autograd.grad(out.sum(), [rows, w_up, w_down])) == 3
