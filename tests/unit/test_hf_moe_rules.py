"""Expert parallelism on a Hugging Face MoE folder: what the rules admit and what they refuse, before launch.

The folders hold a config.json alone (`model.hf_config=DIR`: random weights), which is all the rules read.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.front.cli import precheck

transformers = pytest.importorskip("transformers")

from moe_assets import MOE_ARCHITECTURES, moe_config  # noqa: E402

LOCAL = ["launcher=local", "launcher.nproc=2", "parallel.ep_size=2"]


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    """model_type -> a folder holding the tiny config.json of that family (4 experts, 2 per token); 'dense' a Llama."""
    root = tmp_path_factory.mktemp("moe-configs")
    folders = {}
    for arch in MOE_ARCHITECTURES:
        folders[arch] = root / arch
        moe_config(arch).save_pretrained(folders[arch])
    folders["dense"] = root / "dense"
    folders["dense"].mkdir()
    llama = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256
    )
    llama.save_pretrained(folders["dense"])
    return folders


def _messages(folder: Path, *argv: str) -> list[str]:
    return [str(e) for e in precheck(["model=hf", f"model.hf_config={folder}", *argv])]


@pytest.mark.parametrize(
    ("arch", "strategy"), [*((arch, "fsdp") for arch in MOE_ARCHITECTURES), ("qwen3_moe", "ddp")]
)
def test_ep_on_a_moe_folder_is_admitted_under_ddp_and_fsdp2(configs, arch: str, strategy: str) -> None:
    assert _messages(configs[arch], f"parallel={strategy}", *LOCAL) == []


@pytest.mark.parametrize(
    ("folder", "argv", "expected"),
    [
        ("dense", ["parallel=ddp", *LOCAL], "describes a dense model"),
        ("mixtral", ["parallel=ddp", "launcher=local", "launcher.nproc=3", "parallel.ep_size=3"], "4 experts per layer"),
        ("qwen3_moe", ["parallel=tp_fsdp", "launcher=local", "launcher.nproc=4", "parallel.ep_size=2"], "parallel.tp_size"),
        ("mixtral", ["parallel=pp", *LOCAL], "parallel.pp_size"),
        ("mixtral", ["parallel=zero2", *LOCAL], "parallel.strategy=deepspeed"),
        ("mixtral", ["parallel=ddp", "quantization=lora", *LOCAL], "quantization.method"),
        ("mixtral", ["parallel=ddp", "compile.mode=default", *LOCAL], "compile.mode"),
        ("mixtral", ["parallel=fsdp", "launcher=local", "launcher.nproc=3", "parallel.ep_size=2"], "world size (3"),
    ],
)  # fmt: skip
def test_what_ep_on_a_folder_does_not_compose_with_is_refused(configs, folder, argv, expected) -> None:
    messages = _messages(configs[folder], *argv)
    assert any(expected in m and "parallel.ep_size" in m for m in messages), messages


def test_a_dense_preset_is_refused_too() -> None:
    messages = [str(e) for e in precheck(["model=hf_llama_tiny", "parallel=ddp", *LOCAL])]
    assert any("dense" in m and "parallel.ep_size=1" in m for m in messages), messages


def test_an_unreadable_config_is_said_once(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    messages = _messages(tmp_path, "parallel=ddp", *LOCAL)
    assert len([m for m in messages if "config.json" in m]) == 1, messages
