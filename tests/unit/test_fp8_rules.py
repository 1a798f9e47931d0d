"""precision=fp8: refused before launch where float8 matmuls do not exist, and which layers it converts."""

from __future__ import annotations

import subprocess
import sys

from launcher.front.cli import precheck
from launcher.rules import precision as precision_rules
from launcher.rules.hardware import Hardware


def _errors(*argv: str) -> dict[tuple[str, ...], str]:
    return {e.keys: e.message for e in precheck(list(argv))}


def test_fp8_on_this_cpu_is_refused_with_the_fix() -> None:
    for device in ("cpu", "auto"):  # auto: no GPU on this machine
        message = _errors("precision=fp8", f"launcher.device={device}")[("precision.fp8",)]
        assert "compute capability 8.9" in message and "the CPU" in message and "precision=bf16" in message


def test_train_exits_2_before_launch(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "precision=fp8", f"run_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "precision.fp8" in done.stderr + done.stdout and not (tmp_path / "run" / "metrics.jsonl").exists()


def _gpu_errors(capability: tuple[int, int], *argv: str) -> dict[tuple[str, ...], str]:
    """The fp8 rule's verdict for a spec on a GPU of `capability` (a machine this test cannot have)."""
    from launcher.front import compose
    from launcher.spec import to_spec

    spec = to_spec(compose.strip_hydra(compose.compose(list(argv))))
    hw = Hardware(device_type="cuda", bf16=True, tf32=True, num_gpus=1, fp8=capability >= (8, 9),
                  capability=capability)  # fmt: skip
    return {e.keys: e.message for e in precision_rules._fp8(spec, hw)}


def test_older_gpus_are_refused_and_sm89_accepted() -> None:
    assert "a GPU of compute capability 8.0" in _gpu_errors((8, 0), "precision=fp8")[("precision.fp8",)]
    assert _gpu_errors((8, 9), "precision=fp8") == {}
    assert _gpu_errors((9, 0), "precision=fp8", "precision.fp8_recipe=rowwise") == {}


def test_recipe_bf16_and_quantized_base_are_checked() -> None:
    assert (
        "Did you mean rowwise?"
        in _gpu_errors((9, 0), "precision=fp8", "precision.fp8_recipe=rowwize")[("precision.fp8_recipe",)]
    )
    assert "precision=fp8" in _gpu_errors((9, 0), "precision.fp8=true")[("precision.fp8", "precision.bf16")]
    both = ("precision.fp8", "quantization.method")
    assert "quantization=none" in _gpu_errors((9, 0), "precision=fp8", "quantization=int8_lora")[both]


def test_convert_swaps_eligible_linears_only() -> None:
    """torchao's conversion runs on the CPU (its matmuls do not): blocks convert, the head and odd dims stay."""
    from torchao.float8.float8_linear import Float8Linear

    from launcher.components.model.build import build_model
    from launcher.components.precision import apply_fp8
    from launcher.config.model import ModelConfig
    from launcher.config.precision import PrecisionConfig

    model = build_model(ModelConfig(n_layer=1, d_model=64, n_head=2, d_ff=200))
    apply_fp8(model, PrecisionConfig(bf16=True, fp8=True, fp8_recipe="rowwise"))
    block = model.blocks[0]
    assert all(
        isinstance(getattr(block.attn, n), Float8Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj")
    )
    assert not isinstance(block.mlp.up, Float8Linear)  # 200 is not a multiple of 16
    assert not isinstance(model.lm_head, Float8Linear) and model.lm_head.weight is model.tok_emb.weight
