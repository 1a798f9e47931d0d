"""model.attention=flash_attention_2 is refused with what torch's SDPA already does and why it cannot run."""

from __future__ import annotations

from launcher.front import compose
from launcher.front.cli import precheck
from launcher.rules import flash
from launcher.rules.hardware import Hardware
from launcher.rules.values import installed
from launcher.spec import to_spec


def _errors(*argv: str) -> dict[tuple[str, ...], str]:
    return {e.keys: e.message for e in precheck(list(argv))}


def test_the_built_in_gpt_and_the_cpu_are_refused_saying_what_sdpa_dispatches_to() -> None:
    gpt = _errors("model.attention=flash_attention_2")[("model.attention",)]
    assert "the built-in GPT has its own attention" in gpt
    hf_cpu = _errors("model=hf_llama_tiny", "model.attention=flash_attention_2")[("model.attention",)]
    assert "run on CUDA only, and this run's device is cpu" in hf_cpu
    for message in (gpt, hf_cpu):
        assert "SDPA dispatches causal attention without a mask to its flash kernel" in message
        assert "varlen" in message and "flex" in message and "Use model.attention=auto" in message
    other = _errors("model.attention=flash_attn")[("model.attention",)]
    assert other.startswith("there is no attention path 'flash_attn'") and "flash kernel" in other


def test_on_cuda_the_package_and_the_launchers_paths_decide() -> None:
    """A machine this test cannot have: an HF model on CUDA."""
    spec = to_spec(
        compose.strip_hydra(compose.compose(["model=hf_llama_tiny", "model.attention=flash_attention_2"]))
    )
    gpu = Hardware(device_type="cuda", bf16=True, tf32=True, num_gpus=1)
    (error,) = flash._flash_attention(spec, gpu)
    reason = "not installed here" if not installed("flash_attn") else "take torch's attention paths only"
    assert reason in error.message and "flash kernel" in error.message
    auto = to_spec(compose.strip_hydra(compose.compose(["model=hf_llama_tiny"])))
    assert list(flash._flash_attention(auto, gpu)) == []
