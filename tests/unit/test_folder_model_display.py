"""A model built from a Hugging Face folder is shown and written with the folder's real shape,
not the preset's n_layer 4 / d_model 128 that its build ignores."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_assets import make_hf_model

from conftest import run_cli
from launcher.front import compose, rundir
from launcher.front.model_dims import describe_model, fill_folder_dims
from launcher.spec import load_spec

SMALL = ["data.seq_len=32", "train.max_steps=20", "scheduler.warmup_steps=2"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny saved Llama: 2 layers, hidden 64, 4 heads (2 key-value), MLP 128, 128 positions, untied head."""
    return make_hf_model("llama", tmp_path_factory.mktemp("hf") / "llama")


def _params(folder: Path) -> int:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def test_dry_run_shows_the_folders_dimensions_and_parameters(llama: Path, tmp_path) -> None:
    proc = run_cli(["model=hf", f"model.path={llama}", *SMALL, "dry_run=true"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert (
        f"model: Hugging Face folder {llama} (shape from its config.json, its weights): 2 layers, d_model 64, "
        "4 heads (2 key-value), d_ff 128, vocab_size 256, max_seq_len 128;"
    ) in text
    assert f"{_params(llama):,} parameters" in text
    # the spec table too: the folder's values, and where they came from
    assert "model.n_layer 2 the folder's config.json" in text
    assert "model.d_model 64 the folder's config.json" in text
    assert "model.max_seq_len 128 the folder's config.json" in text


@pytest.mark.parametrize("key", ["model.path", "model.hf_config"])
def test_spec_yaml_holds_the_folders_real_shape(llama: Path, tmp_path, key: str) -> None:
    built = compose.build(compose.compose(["model=hf", f"{key}={llama}", *SMALL]))
    assert built.errors == ()
    spec = built.spec
    rundir.write(built, tmp_path / "run")
    model = load_spec(tmp_path / "run" / "spec.yaml").model
    shape = (model.n_layer, model.d_model, model.n_head, model.d_ff, model.vocab_size, model.max_seq_len)
    assert shape == (2, 64, 4, 128, 256, 128)
    assert model.tie_embeddings is False
    assert model == spec.model
    assert f"{_params(llama):,} parameters" in describe_model(model)


def test_gpt_and_presets_keep_their_keys() -> None:
    for argv in (["model.n_layer=3"], ["model=hf_llama_tiny"]):
        cfg = compose.compose([*argv, *SMALL])
        spec, errors = compose.validate(cfg)
        assert errors == []
        assert fill_folder_dims(cfg) is cfg
    assert describe_model(spec.model).startswith("model: Hugging Face preset llama")


def test_the_rules_judge_the_folders_context_not_the_group_keys_it_ignores(llama: Path) -> None:
    """data.seq_len is checked against the folder's 128 positions: model.max_seq_len=64 is ignored for it."""
    cfg = compose.compose(
        ["model=hf", f"model.path={llama}", *SMALL, "model.max_seq_len=64", "data.seq_len=100"]
    )
    spec, errors = compose.validate(cfg)
    assert errors == [] and spec.model.max_seq_len == 128
    cfg = compose.compose(["model=hf", f"model.path={llama}", *SMALL, "data.seq_len=200"])
    messages = [str(e) for e in compose.validate(cfg)[1]]
    assert len(messages) == 1 and "(128 positions)" in messages[0]  # one message, naming the folder
