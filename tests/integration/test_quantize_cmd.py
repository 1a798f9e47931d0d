"""`train-quantize`: real torchao post-training quantization of a real (tiny) run, the saved folder
loaded back, and the refusals of bad input."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY, run_inline
from launcher.tools import quantize

RUN = [*TINY, "train.max_steps=10", "train.eval_every=null", "checkpoint.every=10"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> object:
    """One 10-step fp32 run of the tiny GPT, shared by every test here."""
    run_dir = tmp_path_factory.mktemp("ptq") / "run"
    assert run_inline(RUN, run_dir) == 0
    return run_dir


@pytest.fixture(scope="module")
def int8(trained, tmp_path_factory) -> tuple[object, str]:
    """train-quantize --scheme int8_weight_only on that run: (OUT folder, what it printed)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("ptq_out") / "int8"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert quantize.main([str(trained), str(out), "--scheme", "int8_weight_only"]) == 0
    return out, printed.getvalue()


def test_table_sizes_and_loss(int8) -> None:
    out, printed = int8
    record = json.loads((out / "quantize.json").read_text())
    before, after = record["before"], record["after"]
    assert "before (float32)" in printed and "after (int8_weight_only)" in printed
    assert f"{after['eval_loss']:.4f}" in printed and f"{before['bytes']:,}" in printed
    # int8 per-channel weights: the linear layers shrink 4x; the float embeddings keep it above 2.5x
    assert after["bytes"] < before["bytes"] / 2
    # measured: |difference| about 1e-4 on this model; int8 rounding error per weight is <= scale/2
    assert abs(after["eval_loss"] - before["eval_loss"]) < 0.02


def test_saved_model_loads_back_with_the_printed_loss(int8, trained) -> None:
    out, _ = int8
    record = json.loads((out / "quantize.json").read_text())
    model = quantize.load_quantized(out)
    assert type(model.blocks[0].attn.q_proj.weight).__name__ == "Int8Tensor"
    assert model.lm_head.weight is not None  # tied head left in float: it shares the embedding
    spec = quantize.load_spec(out / "spec.yaml")
    again = quantize.evaluate(model, spec)
    assert again["eval_loss"] == pytest.approx(record["after"]["eval_loss"], abs=1e-6)


def test_int4_and_dynamic_schemes_run(trained, tmp_path) -> None:
    model, spec, _ = quantize.load_source(trained)
    base = quantize.evaluate(model, spec)["eval_loss"]
    for scheme in ("int4_weight_only", "int8_dynamic"):
        model, _, _ = quantize.load_source(trained)
        quantize.quantize_model(model, scheme)
        loss = quantize.evaluate(model, spec)["eval_loss"]
        assert torch.isfinite(torch.tensor(loss)) and abs(loss - base) < 0.2, scheme


@pytest.mark.parametrize(
    "case, fix",
    [
        ("missing", "is not a directory"),
        ("empty", "holds no complete checkpoint"),
        ("scheme", "choose one of int8_weight_only, int4_weight_only, int8_dynamic"),
        ("out", "already exists and is not an empty folder"),
    ],
)
def test_bad_input_exits_2_with_the_fix(case, fix, trained, tmp_path, capsys) -> None:
    source, out, scheme = trained, tmp_path / "out", "int8_weight_only"
    if case == "missing":
        source = tmp_path / "nope"
    elif case == "empty":
        source = tmp_path / "empty"
        source.mkdir()
    elif case == "scheme":
        scheme = "int3"
    else:
        out.mkdir()
        (out / "x").write_text("x")
    assert quantize.main([str(source), str(out), "--scheme", scheme]) == 2
    assert fix in capsys.readouterr().err


def test_hf_folder_sizes_only_without_a_spec_and_loads_back(tmp_path, capsys) -> None:
    from hf_assets import make_hf_model

    source = make_hf_model("llama", tmp_path / "hf")
    assert quantize.main([str(source), str(tmp_path / "q"), "--scheme", "int8_weight_only"]) == 0
    printed = capsys.readouterr().out
    assert "no eval: an HF folder has no data of its own; add --spec" in printed
    record = json.loads((tmp_path / "q" / "quantize.json").read_text())
    assert record["kind"] == "hf" and record["after"]["bytes"] < record["before"]["bytes"] / 2
    model = quantize.load_quantized(tmp_path / "q")
    logits = model(input_ids=torch.randint(0, 256, (1, 8)))
    assert logits.shape == (1, 8, 256) and torch.isfinite(logits).all()
