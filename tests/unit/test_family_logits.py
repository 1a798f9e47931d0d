"""Packed rows give the logits transformers gives on each document alone, for every family and attention path.

Tiny configs of each family the launcher lists, with a sliding window (8 tokens) shorter than the
documents, Gemma-2's attention and final-logit softcaps, and Gemma-3's local/global layers. The
reference is transformers' own model, eager attention, one document at a time.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from launcher.components.model.hf import HFCausalLM, conv1d_to_linear, hf_stage  # noqa: E402
from launcher.components.model.hf_attention import hf_path  # noqa: E402
from launcher.components.model.hf_family import PIPELINE_FAMILIES, VARLEN_FAMILIES, family_attention  # noqa: E402

WINDOW = 8
LENGTHS = (20, 13, 31)  # one packed row of three documents, each longer than the window
VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, use_cache=False, bos_token_id=None, eos_token_id=None,
    pad_token_id=None,
)  # fmt: skip
SLIDING = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])


MOE = {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
"""Qwen3-MoE's experts; Mixtral's are num_local_experts (its MLP width intermediate_size)."""


def _configs() -> dict[str, object]:
    t = transformers
    return {
        "llama": t.LlamaConfig(**COMMON),
        "mistral": t.MistralConfig(**COMMON, sliding_window=WINDOW),
        "ministral": t.MinistralConfig(**COMMON, **SLIDING, head_dim=16),
        "qwen2": t.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0),
        "qwen3": t.Qwen3Config(**COMMON, head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0),
        "gemma": t.GemmaConfig(**COMMON, head_dim=16),
        "gemma2": t.Gemma2Config(
            **COMMON, **SLIDING, head_dim=16, attn_logit_softcapping=5.0, final_logit_softcapping=3.0
        ),
        "gemma3_text": t.Gemma3TextConfig(**COMMON, **SLIDING, head_dim=16),
        "phi3": t.Phi3Config(**COMMON, sliding_window=WINDOW),
        "olmo2": t.Olmo2Config(**COMMON),
        "olmo3": t.Olmo3Config(**COMMON, **SLIDING),
        "granite": t.GraniteConfig(**COMMON, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0),
        "starcoder2": t.Starcoder2Config(**COMMON, sliding_window=WINDOW),
        "cohere2": t.Cohere2Config(**COMMON, **SLIDING),
        "smollm3": t.SmolLM3Config(**COMMON, no_rope_layers=[1, 0]),
        "gpt2": t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, use_cache=False),
        "mixtral": t.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": t.Qwen3MoeConfig(**COMMON, **MOE, head_dim=16),
    }  # fmt: skip


CONFIGS = _configs()


@pytest.fixture(scope="module")
def families() -> dict[str, tuple[torch.nn.Module, list[torch.Tensor], torch.Tensor]]:
    """Per family: the eager reference model, the documents, and their logits one document at a time."""
    built = {}
    for name, config in CONFIGS.items():
        torch.manual_seed(0)
        config._attn_implementation = "eager"
        ref = transformers.AutoModelForCausalLM.from_config(config).eval()
        docs = [torch.randint(0, VOCAB, (n,)) for n in LENGTHS]
        with torch.no_grad():
            want = torch.cat([ref(input_ids=d[None], use_cache=False).logits[0] for d in docs])
        built[name] = (ref, docs, want)
    return built


def _packed(docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat(docs)[None], torch.cat([torch.arange(len(d)) for d in docs])[None]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def test_every_listed_family_is_checked() -> None:
    """The families the varlen path and the pipeline stages claim are exactly those checked here."""
    assert set(VARLEN_FAMILIES) == set(CONFIGS)
    assert set(CONFIGS) >= PIPELINE_FAMILIES


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packed_logits_equal_transformers_per_document(families, name: str) -> None:
    ref, docs, want = families[name]
    row, positions = _packed(docs)
    family = family_attention(ref.config, type(ref))
    paths = ["sdpa", "varlen"] + (["flex"] if family.flex else [])
    for path in paths:
        model = HFCausalLM(conv1d_to_linear(copy.deepcopy(ref)), attention=path).eval()
        with torch.no_grad():
            got = model(row, positions)[0]
        assert _relative(got, want) < 1e-5, (name, path)


@pytest.mark.parametrize("name", sorted(PIPELINE_FAMILIES))
def test_pipeline_stages_repeat_the_family_forward(families, name: str) -> None:
    """Two stages (one layer each) chained on a packed row give transformers' per-document logits."""
    ref, docs, want = families[name]
    row, positions = _packed(docs)
    first = hf_stage(HFCausalLM(copy.deepcopy(ref), attention="sdpa"), range(0, 1), first=True, last=False)
    last = hf_stage(HFCausalLM(copy.deepcopy(ref), attention="sdpa"), range(1, 2), first=False, last=True)
    with torch.no_grad():
        got = last(first(row, positions), positions)[0]
    assert _relative(got, want) < 1e-5


@pytest.mark.parametrize("name", ["gemma2", "qwen2"])
def test_varlen_gradients_equal_transformers_per_document(families, name: str) -> None:
    """Training through varlen (softcap and window in backward) gives transformers' per-document gradients."""
    ref, docs, _ = families[name]
    row, positions = _packed(docs)
    reference = copy.deepcopy(ref).train()
    sum(
        reference(input_ids=d[None], use_cache=False).logits.float().square().mean() * len(d) for d in docs
    ).backward()
    model = HFCausalLM(copy.deepcopy(ref), attention="varlen").train()
    logits = model(row, positions)[0]
    bounds = torch.tensor((0,) + LENGTHS).cumsum(0).tolist()
    sum(
        logits[a:b].float().square().mean() * (b - a) for a, b in zip(bounds, bounds[1:], strict=False)
    ).backward()
    for (key, p), q in zip(reference.named_parameters(), model.hf.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), key


def test_auto_steps_around_what_a_family_lacks() -> None:
    """auto never picks a path that would not reproduce the family; a chosen one it lacks is refused."""
    gpt2 = family_attention(CONFIGS["gpt2"])
    assert not gpt2.flex
    assert hf_path("auto", gpt2, packed=True, device_type="cuda") == "varlen"
    with pytest.raises(ValueError, match="no FlexAttention for gpt2"):
        hf_path("flex", gpt2, packed=True, device_type="cuda")
    neox = family_attention(transformers.GPTNeoXConfig())
    assert neox.varlen_problem and "gpt_neox" in neox.varlen_problem
    assert hf_path("auto", neox, packed=True, device_type="cpu", seq_len=4096) == "sdpa"
    assert hf_path("auto", neox, packed=True, device_type="cuda") == "flex"  # transformers' own masks
    gemma2 = family_attention(CONFIGS["gemma2"])
    assert gemma2.dense == "eager"  # transformers has no SDPA for Gemma-2's softcap
    bidirectional = transformers.Gemma3TextConfig(**COMMON, use_bidirectional_attention=True)
    assert "bidirectional" in family_attention(bidirectional).varlen_problem
