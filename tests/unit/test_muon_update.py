"""optimizer=muon in one process: the parameter split on real models, the update against torch's own
Muon and AdamW, the state dict, and the rules that refuse it before launch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from launcher.components.model.build import build_model
from launcher.components.optimizer import build_optimizer, muon_param_groups
from launcher.config.model import ModelConfig
from launcher.config.optimizer import OptimizerConfig
from launcher.front.cli import precheck

MUON = OptimizerConfig(name="muon", momentum=0.95, nesterov=True, weight_decay=0.1, implementation="for_loop")


def _split(model: nn.Module, cfg: OptimizerConfig = MUON) -> tuple[set[str], set[str]]:
    """(names Muon updates, names AdamW updates)."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = muon_param_groups(model.named_parameters(), cfg)
    muon = {names[id(p)] for g in groups if g["use_muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in groups if not g["use_muon"] for p in g["params"]}
    return muon, adamw


def test_gpt_split_gives_muon_the_block_matrices_only() -> None:
    model = build_model(ModelConfig(n_layer=2, n_head=2, d_model=32, max_seq_len=16, tie_embeddings=False))
    muon, adamw = _split(model)
    assert muon == {
        f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.q_proj", "attn.k_proj", "attn.v_proj",
                                                             "attn.o_proj", "mlp.up", "mlp.down")
    }  # fmt: skip
    assert {"tok_emb.weight", "pos_emb.weight", "lm_head.weight", "norm_f.weight"} <= adamw
    assert all(
        model.get_parameter(n).ndim == 1
        for n in adamw - {"tok_emb.weight", "pos_emb.weight", "lm_head.weight"}
    )


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_hf_families_keep_embeddings_and_heads_on_adamw(family: str) -> None:
    """The default muon_exclude covers the names of Hugging Face families (real transformers models)."""
    import transformers

    small = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 2, "tie_word_embeddings": False}  # fmt: skip
    config = {
        "llama": lambda: transformers.LlamaConfig(**small),
        "gpt2": lambda: transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(**small),
    }[family]()
    model = transformers.AutoModelForCausalLM.from_config(config)
    muon, adamw = _split(model)
    heads = {n for n in adamw if model.get_parameter(n).ndim == 2}
    expected = {
        "llama": {"model.embed_tokens.weight", "lm_head.weight"},
        "gpt2": {"transformer.wte.weight", "transformer.wpe.weight"},  # lm_head is tied to wte
        "gpt_neox": {"gpt_neox.embed_in.weight", "lm_head.weight"},
    }[family]
    assert heads == expected
    assert muon and all(model.get_parameter(n).ndim == 2 for n in muon)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.hidden = nn.Linear(8, 12)
        self.norm = nn.LayerNorm(12)
        self.lm_head = nn.Linear(12, 16, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(torch.relu(self.hidden(self.emb(ids))))).logsumexp(-1).mean()


def _steps(model: nn.Module, optimizers: list[torch.optim.Optimizer], num_steps: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(num_steps):
        model(torch.randint(0, 16, (4, 5), generator=gen)).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)


def test_update_is_torch_muon_on_matrices_and_torch_adamw_on_the_rest() -> None:
    torch.manual_seed(0)
    ours, reference = _Tiny(), None
    reference = copy.deepcopy(ours)
    cfg = OptimizerConfig(**{**MUON.__dict__, "adamw_lr": 3e-3, "adjust_lr_fn": "original"})
    _steps(ours, [build_optimizer(ours, cfg, "cpu")], 3)
    hidden = [reference.hidden.weight]
    muon = torch.optim.Muon(
        hidden, lr=cfg.lr, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="original"
    )
    adamw = torch.optim.AdamW(
        [
            {"params": [reference.emb.weight, reference.lm_head.weight], "weight_decay": 0.1},
            {"params": [reference.hidden.bias, reference.norm.weight, reference.norm.bias], "weight_decay": 0.0},
        ],
        lr=3e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False,
    )  # fmt: skip
    _steps(reference, [adamw, muon], 3)
    for (name, got), want in zip(ours.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, want), name


def test_state_dict_round_trip_continues_bitwise() -> None:
    """torch's load replaces the groups and the state; the AdamW part must step the loaded ones."""
    torch.manual_seed(0)
    straight = _Tiny()
    opt = build_optimizer(straight, MUON, "cpu")
    _steps(straight, [opt], 2)
    saved_model, saved_opt = copy.deepcopy(straight.state_dict()), copy.deepcopy(opt.state_dict())
    _steps(straight, [opt], 2, seed=1)
    resumed = _Tiny()
    resumed.load_state_dict(saved_model)
    again = build_optimizer(resumed, MUON, "cpu")
    again.load_state_dict(saved_opt)
    assert {k for s in again.state_dict()["state"].values() for k in s} == {
        "momentum_buffer", "step", "exp_avg", "exp_avg_sq"
    }  # fmt: skip
    _steps(resumed, [again], 2, seed=1)
    for got, want in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(got, want)


def _errors(*argv: str) -> dict[tuple[str, ...], str]:
    return {e.keys: e.message for e in precheck(list(argv))}


def test_muon_composes_with_torch_strategies_and_is_refused_under_zero() -> None:
    assert _errors("optimizer=muon") == {}
    assert _errors("optimizer=muon", "parallel=fsdp", "launcher=local", "launcher.nproc=2") == {}
    message = _errors("optimizer=muon", "parallel=zero2", "launcher=local", "launcher.nproc=2")[
        ("optimizer.name", "parallel.strategy")
    ]
    assert "ZeRO stage 2" in message and "parallel=fsdp" in message


def test_muon_keys_are_checked() -> None:
    assert (
        "match_rms_adamw"
        in _errors("optimizer=muon", "optimizer.adjust_lr_fn=rms")[("optimizer.adjust_lr_fn",)]
    )
    assert ("optimizer.ns_steps",) in _errors("optimizer=muon", "optimizer.ns_steps=0")
    assert ("optimizer.adamw_lr",) in _errors("optimizer=muon", "optimizer.adamw_lr=0")


def test_planner_counts_muon_state_as_built() -> None:
    """One float32 momentum per hidden matrix weight, two AdamW moments for the rest: the planner's bytes."""
    from launcher.front import compose
    from launcher.plan.states import optimizer_state_bytes
    from launcher.spec import to_spec

    spec = to_spec(compose.strip_hydra(compose.compose(["optimizer=muon"])))
    model = build_model(spec.model)
    optimizer = build_optimizer(model, spec.optimizer, "cpu")
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    built = sum(t.nbytes for s in optimizer.state.values() for k, t in s.items() if k != "step")
    trainable = sum(p.numel() for p in model.parameters())
    assert optimizer_state_bytes(spec) * trainable == pytest.approx(built, rel=1e-6)
    assert built < 8 * trainable * 0.6  # gpt_tiny: AdamW's 6.5 MiB of state becomes 3.5 MiB
