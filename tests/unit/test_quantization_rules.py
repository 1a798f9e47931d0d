"""Every combination the quantization, optimizer and Hugging Face rules refuse, with its message."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from launcher.components.quantization import nf4_backend
from launcher.config.quantization import QuantizationConfig
from launcher.front.cli import precheck


def _errors(*argv: str) -> dict[tuple[str, ...], str]:
    return {e.keys: e.message for e in precheck(list(argv))}


@pytest.mark.parametrize("method", ["int8", "nf4"])
def test_quantized_weights_without_adapters_are_refused(method: str) -> None:
    errors = _errors(f"quantization={method}")
    message = errors[("quantization.method", "quantization.lora.rank")]
    assert "nothing in the blocks would train" in message and f"quantization={method}_lora" in message


def test_each_good_quantization_option_composes() -> None:
    for option in ("none", "lora", "dora", "int8_lora", "nf4_lora"):
        assert _errors(f"quantization={option}") == {}, option


def test_lora_settings_are_checked() -> None:
    errors = _errors("quantization=lora", "quantization.lora.alpha=0", "quantization.lora.dropout=1.0")
    assert "alpha / rank" in errors[("quantization.lora.alpha",)]
    assert "[0, 1)" in errors[("quantization.lora.dropout",)]
    assert (
        "must be 0 (no adapters) or more" in _errors("quantization.lora.rank=-1")[("quantization.lora.rank",)]
    )
    assert "quantization.int8_threshold" in str(
        _errors("quantization=int8_lora", "quantization.int8_threshold=-1")
    )


def test_unknown_lora_target_names_the_model_layers() -> None:
    errors = _errors("quantization=lora", "quantization.lora.targets=[q_proj,lm_head,gate_proj]")
    message = errors[("quantization.lora.targets", "model.kind")]
    assert message.startswith("lm_head, gate_proj match none of this model's adaptable linear layers")
    assert "q_proj, k_proj, v_proj, o_proj, up, down" in message
    llama = _errors("model=hf_llama_tiny", "quantization=lora", "quantization.lora.targets=[up]")
    assert "gate_proj, up_proj, down_proj" in llama[("quantization.lora.targets", "model.kind")]
    empty = _errors("quantization=lora", "quantization.lora.targets=[]")
    assert "adapts nothing" in empty[("quantization.lora.targets",)]


def test_dora_and_rslora_options() -> None:
    assert (
        _errors("quantization=nf4_lora", "quantization.lora.dora=true", "quantization.lora.rslora=true") == {}
    )
    assert (
        _errors("quantization=dora", "parallel=zero3", "launcher=local") == {}
    )  # measured: parity with one process
    int8 = _errors("quantization=int8_lora", "quantization.lora.dora=true")
    message = int8[("quantization.lora.dora", "quantization.method")]
    assert "loses the row scales" in message and "quantization=dora" in message


def test_quantized_weights_cannot_be_sharded_by_zero3() -> None:
    errors = _errors("quantization=nf4_lora", "parallel=zero3", "launcher=local")
    message = errors[("quantization.method", "parallel.strategy", "parallel.zero_stage")]
    assert "cannot be partitioned by ZeRO-3" in message and "DeepSpeed ZeRO 0-2" in message
    assert "one packed tensor" in message  # the reason
    assert _errors("quantization=nf4_lora", "parallel=zero2", "launcher=local") == {}
    assert _errors("quantization=lora", "parallel=zero3", "launcher=local") == {}


FSDP2 = ("parallel=fsdp", "launcher=local", "launcher.nproc=2")
WIDE = ("model.d_model=256", "model.n_head=4")  # block matrices of whole 16384-weight NF4 groups per shard


@pytest.mark.parametrize(
    ("argv", "keys", "needle"),
    [
        (("quantization=lora", "parallel.strategy=tp", "launcher=local", "launcher.nproc=2"),
         ("quantization.lora.rank", "parallel.strategy", "parallel.tp_size"), "tensor parallelism shards"),
        (("quantization=nf4_lora", "parallel=tp_fsdp", "launcher=local", "launcher.nproc=4", *WIDE),
         ("quantization.method", "parallel.strategy", "parallel.tp_size"), "cannot be split by tensor parallelism"),
        (("quantization=int8_lora", *FSDP2), ("quantization.method", "parallel.strategy"), "int8 weights cannot be sharded by FSDP2"),
        (("quantization=nf4_lora", "quantization.nf4_backend=bitsandbytes", *FSDP2, *WIDE),
         ("quantization.nf4_backend", "parallel.strategy"), "nf4_backend=torchao (or auto"),
        (("quantization=nf4_lora", *FSDP2), ("quantization.method", "quantization.nf4_backend", "model.d_model"),
         "cannot be split into 2 row shards"),
        (("quantization=nf4_lora", "quantization.lora.dora=true", *FSDP2, *WIDE),
         ("quantization.lora.dora", "quantization.nf4_backend"), "DoRA rescales"),
        (("quantization=nf4_lora", "quantization.nf4_backend=torchao", "parallel=ddp", "launcher=local",
          "launcher.nproc=2", *WIDE), ("quantization.nf4_backend", "parallel.strategy"), "bitsandbytes (or auto"),
        (("quantization=nf4_lora", "quantization.nf4_backend=fast"), ("quantization.nf4_backend",), "must be one of"),
    ],
)  # fmt: skip
def test_adapters_and_low_bits_per_strategy(
    argv: tuple[str, ...], keys: tuple[str, ...], needle: str
) -> None:
    errors = _errors(*argv)
    assert needle in errors[keys], errors


def test_adapters_and_nf4_are_accepted_under_fsdp2() -> None:
    assert _errors("quantization=lora", *FSDP2) == {}
    assert _errors("quantization=nf4_lora", *FSDP2, *WIDE) == {}  # auto: torchao's NF4 under FSDP2


def test_nf4_auto_backend_follows_the_data_parallel_method() -> None:
    """auto stores nf4 as torchao's shardable tensors wherever FSDP2 shards (the pp alias too), else bitsandbytes."""
    auto = QuantizationConfig(method="nf4")
    chosen = {name: nf4_backend(auto, name) for name in ("single", "ddp", "fsdp", "pp", "deepspeed", "tp")}
    assert {name for name, backend in chosen.items() if backend == "torchao"} == {"fsdp", "pp"}
    assert set(chosen.values()) == {"torchao", "bitsandbytes"}
    under_pp = _errors("quantization=nf4_lora", "parallel=pp", "launcher=local", "launcher.nproc=2")
    assert set(under_pp) == {  # the pipeline's refusals alone
        ("quantization.method", "parallel.strategy"),
        ("quantization.lora.rank", "parallel.strategy"),
    }


def test_optimizer_rules() -> None:
    fused = _errors("optimizer=adamw_8bit", "optimizer.implementation=fused")
    assert "single bitsandbytes kernel" in fused[("optimizer.implementation", "optimizer.name")]
    ada = _errors("optimizer=adafactor", "optimizer.implementation=fused")
    assert "no fused kernel" in ada[("optimizer.implementation", "optimizer.name")]
    betas = _errors("optimizer=lion_8bit", "optimizer.betas=[0.9,1.5]")
    assert "two coefficients in [0, 1)" in betas[("optimizer.betas",)]
    for option in ("adamw_8bit", "paged_adamw_8bit", "lion_8bit", "adafactor"):
        assert _errors(f"optimizer={option}") == {}, option


def test_hf_model_rules(tmp_path) -> None:
    assert (
        "is read only for model.kind=hf"
        in _errors("model.hf_config=llama")[("model.hf_config", "model.kind")]
    )
    assert "needs model.path" in _errors("model.kind=hf")[("model.path", "model.hf_config")]
    missing = _errors("model=hf_llama_tiny", f"model.hf_config={tmp_path / 'nowhere'}")
    assert (
        "neither a preset (llama, gpt2) nor a directory with a config.json" in missing[("model.hf_config",)]
    )
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "vocab_size": 100, "max_position_embeddings": 16})
    )
    small = _errors("model=hf_llama_tiny", f"model.hf_config={tmp_path}", "data.seq_len=32")
    assert "produces 256 token ids but the model" in small[("model.hf_config", "tokenizer.kind")]
    assert "model.resize_embeddings=true" in small[("model.hf_config", "tokenizer.kind")]
    assert "exceed the context of the model" in small[("data.seq_len", "model.hf_config")]


def test_cli_exits_2_before_starting(tmp_path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "launcher", "quantization=nf4", f"run_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "nothing in the blocks would train" in run.stderr and not (tmp_path / "run").exists()
