"""model.attention=flash_attention_2: refused with what torch's SDPA already does and why it cannot run, and
accepted for a Hugging Face model on CUDA with flash_attn installed, in bf16, which transformers then runs."""

from __future__ import annotations

from launcher.front import compose
from launcher.front.cli import precheck
from launcher.rules import flash
from launcher.rules.hardware import Hardware
from launcher.spec import to_spec

GPU = Hardware(device_type="cuda", bf16=True, tf32=True, num_gpus=1)
"""A machine these tests cannot have."""


def _errors(*argv: str) -> dict[tuple[str, ...], str]:
    return {e.keys: e.message for e in precheck(list(argv))}


def _on_gpu(*argv: str) -> list[str]:
    spec = to_spec(
        compose.strip_hydra(
            compose.compose(["model=hf_llama_tiny", "model.attention=flash_attention_2", *argv])
        )
    )
    return [e.message for e in flash._flash_attention(spec, GPU)]


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


def test_on_cuda_without_the_package_it_is_refused() -> None:
    (message,) = _on_gpu("precision=bf16")
    assert "the flash_attn package is not installed here" in message


def test_on_cuda_with_the_package_in_bf16_transformers_gets_flash_attention_2(tmp_path, monkeypatch) -> None:
    """An importable flash_attn (a package of that name on the path: the rule asks only whether it imports)."""
    from launcher.components.model.hf_attention import hf_implementation
    from launcher.components.model.hf_family import family_attention
    from launcher.components.model.hf_files import hf_config

    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _on_gpu("precision=bf16") == []
    assert "take bf16 or fp16 only" in _on_gpu("precision=fp32")[0]
    assert "pipeline stages" in _on_gpu("precision=bf16", "parallel=pp", "launcher.nproc=2")[0]
    spec = to_spec(compose.strip_hydra(compose.compose(["model=hf_llama_tiny"])))
    family = family_attention(hf_config(spec.model))
    for packed in (True, False):  # transformers finds packed documents from the position ids itself
        assert (
            hf_implementation("flash_attention_2", family, packed=packed, device_type="cuda")
            == "flash_attention_2"
        )
