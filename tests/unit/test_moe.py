"""The built-in GPT's MoE blocks: parameter counts, routing against a token-by-token reference, capacity, the
auxiliary losses through the objective, loss-free balancing on a skewed toy run, and the rules' messages."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from launcher.components.model.experts import expert_mlp, grouped_gemm_available, grouped_mlp
from launcher.components.model.gpt import GPT, MLP
from launcher.components.model.moe import MoE
from launcher.components.model.moe_balance import MoEBalance, moe_blocks
from launcher.components.objectives.auxiliary import with_auxiliary
from launcher.components.objectives.cross_entropy import CrossEntropy
from launcher.config.model import ModelConfig, config_num_params
from launcher.config.moe import MoEConfig
from launcher.front.cli import precheck

TINY = ModelConfig(n_layer=2, n_head=2, d_model=32, max_seq_len=16)


def _cfg(**moe: object) -> ModelConfig:
    return dataclasses.replace(TINY, moe=MoEConfig(**{"num_experts": 4, "top_k": 2, "d_ff": 24, **moe}))


@pytest.mark.parametrize("moe", [{}, {"every": 2, "shared_experts": 1}, {"router": "sigmoid", "top_k": 1}])
def test_counts_match_the_built_model_and_the_interleave(moe: dict) -> None:
    cfg = _cfg(**moe)
    torch.manual_seed(0)
    model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == config_num_params(cfg)
    kinds = [type(block.mlp) for block in model.blocks]
    assert kinds == ([MLP, MoE] if moe.get("every") == 2 else [MoE, MoE])
    assert config_num_params(cfg, active=True) < config_num_params(cfg)


def _token_by_token(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its chosen experts one at a time: what the sorted, batched computation must equal."""
    flat = x.reshape(-1, x.shape[-1])
    _, _, chosen, weights = layer.router(flat)
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for e, w in zip(chosen[t].tolist(), weights[t], strict=True):
            out[t] += w * (F.gelu(flat[t] @ layer.w_up[e], approximate="tanh") @ layer.w_down[e])
    if layer.shared is not None:
        out += layer.shared(flat)
    return out.reshape(x.shape)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_routed_experts_match_a_token_by_token_reference(router: str) -> None:
    torch.manual_seed(0)
    layer = GPT(_cfg(router=router, shared_experts=1)).blocks[0].mlp
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(layer(x), _token_by_token(layer, x), rtol=1e-5, atol=1e-6)
    _, _, _, weights = layer.router(x.reshape(-1, 32))
    torch.testing.assert_close(weights.sum(-1), torch.ones(16))  # top_k > 1: renormalized over the chosen


def test_capacity_drops_and_counts_the_overflow() -> None:
    torch.manual_seed(0)
    model = GPT(_cfg(capacity_factor=0.5))
    layer = model.blocks[0].mlp
    x = torch.randn(2, 8, 32)
    model.train()
    layer(x)
    sums = layer.interval
    assignments = 2 * 8 * 2
    assert float(sums["counts"].sum()) + float(sums["dropped"]) == assignments
    assert float(sums["dropped"]) >= assignments - 4 * 4  # capacity ceil(0.5 * 32 / 4) = 4 per expert
    assert float(sums["counts"].max()) <= 4


def test_auxiliary_losses_reach_the_objective_per_trained_token() -> None:
    """The step's loss is cross-entropy plus each row's weighted aux + z loss counted once per trained token;
    a held-out batch reports cross-entropy alone, and a forward without gradients leaves nothing pending."""
    torch.manual_seed(0)
    model = GPT(_cfg(aux_loss_coef=0.1, z_loss_coef=0.01))
    objective = with_auxiliary(CrossEntropy(), model)
    ids = torch.randint(0, 256, (2, 8))
    labels = ids.clone()
    labels[1, :5] = -100
    batch = {"input_ids": ids, "labels": labels}
    plain, count = CrossEntropy().loss_sum(model(ids), batch)
    layers = moe_blocks(model).values()
    per_row = sum(layer.pending for layer in layers)
    total, count_with = objective.loss_sum(model(ids), batch)
    tokens = (labels != -100).sum(-1).float()
    assert count_with == count
    torch.testing.assert_close(total, plain + (per_row * tokens).sum())
    total.backward()
    assert all(layer.router.gate.weight.grad is not None for layer in layers)
    with torch.no_grad():
        held_out, _ = objective.loss_sum(model(ids), batch, train=False)
    torch.testing.assert_close(held_out, plain)
    assert all(layer.pending is None for layer in layers)


def _skewed_run(rate: float, steps: int = 30) -> tuple[float, float]:
    """A toy run whose router starts skewed towards expert 0: max/mean expert load at the start and the end."""
    torch.manual_seed(0)
    model = GPT(_cfg(num_experts=8, top_k=1, bias_update_rate=rate))
    blocks = {0: model.blocks[0].mlp}
    with torch.no_grad():
        blocks[0].router.gate.weight[0] += 0.05  # tokens lean one way (the shift below): most pick expert 0
    layer = blocks[0]
    balance = MoEBalance(blocks, rate=rate, world_size=1, data_sum=lambda values: values)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.01)
    loads = []
    for step in range(steps):
        balance.before_step(step)
        x = torch.randn(4, 16, 32) + 0.5
        loss = layer(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        balance.after_step(step + 1)
        loads.append(balance.record()["moe_load_max_over_mean"])
    return sum(loads[:3]) / 3, sum(loads[-3:]) / 3


def test_loss_free_balancing_lowers_the_load_where_no_balancing_does_not() -> None:
    start, end = _skewed_run(rate=0.01)
    start_off, end_off = _skewed_run(rate=0.0)
    assert start > 6.0 and start_off > 6.0  # 8 experts, nearly every token on one
    assert end < 3.0 and end_off > 7.0, (end, end_off)


def test_the_bias_is_a_buffer_of_the_checkpoint() -> None:
    model = GPT(_cfg())
    assert "blocks.0.mlp.router.expert_bias" in model.state_dict()


def _messages(*argv: str) -> list[str]:
    return [str(e) for e in precheck(list(argv))]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["model=gpt_moe_tiny", "model.moe.top_k=9"], "model.moe.top_k"),
        (["model=gpt_moe_tiny", "model.moe.every=5"], "model.moe.every"),
        (["model.moe.top_k=1"], "model.moe.num_experts is 0"),
        (
            [
                "model=gpt_moe_tiny",
                "parallel=tp",
                "parallel.sequence_parallel=true",
                "launcher=local",
                "launcher.nproc=2",
            ],
            "parallel.sequence_parallel",
        ),
        (["model=gpt_moe_tiny", "compile.mode=default"], "compile.mode"),
        (["parallel=ddp", "launcher=local", "launcher.nproc=2", "parallel.ep_size=2"], "this model has none"),
        (
            [
                "model=hf_llama_tiny",
                "parallel=ddp",
                "launcher=local",
                "launcher.nproc=2",
                "parallel.ep_size=2",
            ],
            "is dense",
        ),
        (
            [
                "model=gpt_moe_tiny",
                "parallel=ddp",
                "launcher=local",
                "launcher.nproc=2",
                "parallel.ep_size=3",
            ],
            "must be a multiple of parallel.ep_size (3)",
        ),
        (
            [
                "model=gpt_moe_tiny",
                "parallel=tp_fsdp",
                "launcher=local",
                "launcher.nproc=2",
                "parallel.ep_size=2",
            ],
            "data-parallel ranks",
        ),
        (
            [
                "model=gpt_moe_tiny",
                "parallel=pp_fsdp",
                "parallel.pp_schedule=interleaved_1f1b",
                "parallel.pp_stages_per_rank=2",
                "launcher=local",
                "launcher.nproc=4",
                "parallel.ep_size=2",
            ],
            "parallel.pp_stages_per_rank",
        ),
        (
            [
                "model=gpt_moe_tiny",
                "parallel=fsdp",
                "parallel.cp_size=2",
                "model.moe.capacity_factor=1.25",
                "launcher=local",
                "launcher.nproc=2",
            ],
            "model.moe.capacity_factor",
        ),
        (
            [
                "model=gpt_moe_tiny",
                "parallel=pp",
                "parallel.pp_schedule=zero_bubble",
                "parallel.pp_stages_per_rank=2",
                "launcher=local",
                "launcher.nproc=2",
            ],
            "parallel.pp_schedule",
        ),
    ],
)
def test_bad_moe_specs_are_refused_before_launch(argv: list[str], expected: str) -> None:
    messages = _messages(*argv)
    assert any(expected in m for m in messages), messages


def test_the_presets_pass_the_rules() -> None:
    assert _messages("model=gpt_moe_tiny", "parallel=fsdp", "launcher=local", "launcher.nproc=2") == []
    assert _messages("model=gpt_moe_tiny", "parallel=tp", "launcher=local", "launcher.nproc=2") == []
    tp_ep = (
        "model=gpt_moe_tiny",
        "parallel=tp_fsdp",
        "launcher=local",
        "launcher.nproc=4",
        "parallel.ep_size=2",
    )
    assert _messages(*tp_ep) == []
    pp_ep = (
        "model=gpt_moe_tiny",
        "parallel=pp_fsdp",
        "launcher=local",
        "launcher.nproc=4",
        "parallel.ep_size=2",
    )
    assert _messages(*pp_ep) == []
    cp_ep = (
        "model=gpt_moe_tiny",
        "parallel=fsdp",
        "parallel.cp_size=2",
        "launcher=local",
        "launcher.nproc=2",
    )
    assert _messages(*cp_ep, "parallel.ep_size=2") == []
    assert (
        _messages(
            "model=gpt_moe_tiny", "parallel=fsdp", "launcher=local", "launcher.nproc=4", "parallel.ep_size=2"
        )
        == []
    )


def test_activation_checkpointing_recomputes_without_counting_twice() -> None:
    """Checkpointed blocks give the same loss and gradients, and the recomputation adds no counts."""
    import copy
    import functools

    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    plain = GPT(_cfg(aux_loss_coef=0.1, z_loss_coef=0.01))
    recomputed = copy.deepcopy(plain)
    for block in recomputed.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    ids = torch.randint(0, 256, (2, 8))
    batch = {"input_ids": ids, "labels": ids}
    for model in (plain, recomputed):
        loss, _ = with_auxiliary(CrossEntropy(), model).loss_sum(model(ids), batch)
        loss.backward()
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    for a, b in zip(moe_blocks(plain).values(), moe_blocks(recomputed).values(), strict=True):
        assert (
            torch.equal(a.interval["counts"], b.interval["counts"])
            and float(a.interval["counts"].sum()) == 32
        )


def test_experts_without_rows_stay_in_the_graph() -> None:
    """An ep rank whose experts receive no row still backpropagates through its all-to-alls (the others wait in them)."""
    rows = torch.randn(0, 4, requires_grad=True)
    out = expert_mlp(rows, torch.randn(2, 4, 8, requires_grad=True), torch.randn(2, 8, 4), [0, 0])
    assert out.shape == (0, 4) and out.requires_grad
    out.sum().backward()
    assert rows.grad is not None and rows.grad.shape == (0, 4)


@pytest.mark.parametrize("counts", [[3, 0, 4, 3], [0, 0, 0, 10], [1, 2, 3, 4]])
def test_the_grouped_gemm_equals_the_loop_with_empty_experts_and_strided_gradients(counts: list[int]) -> None:
    torch.manual_seed(0)
    n = sum(counts)
    x, w_up, w_down = (
        torch.randn(*shape, requires_grad=True) for shape in ((n, 16), (4, 16, 32), (4, 32, 16))
    )
    grad = torch.randn(16, n).t()  # a transposed (non-contiguous) incoming gradient, as a broadcast one is
    results = []
    for fn in (grouped_mlp, expert_mlp):  # on the CPU expert_mlp is the loop
        out = fn(x, w_up, w_down, counts)
        out.backward(grad)
        results.append((out.detach(), *(t.grad.clone() for t in (x, w_up, w_down))))
        x.grad = w_up.grad = w_down.grad = None
    for grouped, loop in zip(*results, strict=True):
        torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)
    assert not grouped_gemm_available(x, w_up)  # CPU: the loop (torch's grouped kernel is no faster there)
