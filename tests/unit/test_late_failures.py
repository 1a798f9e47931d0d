"""Input that used to pass every check, make the run directory and fail in a rank half a minute later
is refused before launch: exit 2, one paragraph naming the key or file and the fix, no run directory."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hf_assets import hf_config, make_hf_model
from safetensors.torch import load_file

from conftest import run_cli
from launcher.components.model.hf_weights import bin_shapes
from launcher.front import compose

FOLDER_ARGS = ["data.seq_len=32"]


def _errors(argv: list[str]) -> list[str]:
    return [str(e) for e in compose.validate(compose.compose(argv))[1]]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["model.n_layer=0"], "model.n_layer: counts transformer blocks, so it must be 1 or more, got 0"),
        (["model.d_model=-128"], "model.d_model: counts the residual stream's width, so it must be 1 or more"),
        (["model.n_head=-2"], "model.n_head: counts attention heads, so it must be 1 or more, got -2"),
        (["model.d_ff=0"], "model.d_ff: counts the MLP's hidden width"),
        (["model.max_seq_len=0"], "model.max_seq_len: counts positions the model holds"),
        (["model.dropout=2"], "model.dropout: is the probability of zeroing an activation, so it must lie in [0, 1)"),
        (["model.dropout=-0.1"], "model.dropout: is the probability"),
        (["model.d_model=130"], "d_model (130) must be a multiple of n_head (4): each head gets d_model / n_head channels. E.g. model.n_head=5"),
        (["model=hf_llama_tiny", "model.n_layer=0"], "model.n_layer: counts transformer blocks"),
        (["model=hf_llama_tiny", "model.d_model=12", "model.n_head=4"], "(12 / 4 = 3) must be even"),
        (["data.format=bogus"], "data.format: unknown data format 'bogus'. Choose one of: text"),
    ],
)  # fmt: skip
def test_model_numbers_and_names_are_range_checked(argv: list[str], expected: str) -> None:
    errors = _errors(argv)
    assert len(errors) == 1 and expected in errors[0], errors


def test_the_command_line_refuses_them_before_a_run_directory_exists(tmp_path) -> None:
    """One `train` with three of them (one process start, not three): each is named, exit 2, nothing made."""
    argv = ["model.n_layer=0", "model.dropout=2", "data.format=bogus"]
    result = run_cli(argv, tmp_path)
    assert result.returncode == 2 and "invalid (3 problems)" in result.stderr, result.stderr
    assert all(f"  - {arg.split('=')[0]}: " in result.stderr for arg in argv), result.stderr
    assert "Traceback" not in result.stderr and list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny saved Llama, and copies of it broken the ways downloads and hand edits break them."""
    root = tmp_path_factory.mktemp("folders")
    good = make_hf_model("llama", root / "good")
    made = {"good": good}

    def copy(name: str) -> Path:
        made[name] = Path(shutil.copytree(good, root / name))
        return made[name]

    weights = copy("truncated") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    for name, change in (("reshaped", {"intermediate_size": 256}), ("deeper", {"num_hidden_layers": 3}),
                         ("custom", {"model_type": "mystery_lm", "auto_map": {"AutoModelForCausalLM": "m.M"}})):  # fmt: skip
        config_file = copy(name) / "config.json"
        config_file.write_text(json.dumps(json.loads(config_file.read_text()) | change))
    state = load_file(good / "model.safetensors")
    for name, extra in (("bin", None), ("payload", os.system)):
        folder = copy(name)
        (folder / "model.safetensors").unlink()
        torch.save({**state, "x": extra} if extra else state, folder / "pytorch_model.bin")
    config = hf_config("llama")
    config.tie_word_embeddings = True
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(config).save_pretrained(root / "sharded", max_shard_size="100KB")
    made["sharded"] = root / "sharded"
    made["sharded_truncated"] = Path(shutil.copytree(root / "sharded", root / "sharded_truncated"))
    shard = sorted(made["sharded_truncated"].glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:100])
    return made


@pytest.mark.parametrize("name", ["good", "bin", "sharded"])
def test_sound_folders_pass(folders, name: str) -> None:
    assert _errors(["model=hf", f"model.path={folders[name]}", *FOLDER_ARGS]) == []


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("truncated", "model.safetensors' is truncated: its header places"),
        ("sharded_truncated", "safetensors' is truncated: 100 bytes, shorter than its own header"),
        ("reshaped", "do not fit the model its config.json describes (6 tensors: model.layers.0.mlp.gate_proj.weight [128, 64] in the files, [256, 64] for config.json"),
        ("deeper", "lack 9 parameters of the model its config.json describes (model.layers.2."),
        ("custom", "it names code of its own (auto_map {'AutoModelForCausalLM': 'm.M'} for model_type 'mystery_lm'"),
        ("payload", "pytorch_model.bin' is refused by weights-only loading"),
    ],
)  # fmt: skip
def test_broken_folders_are_refused_naming_the_file_and_the_fix(folders, name: str, expected: str) -> None:
    errors = _errors(["model=hf", f"model.path={folders[name]}", *FOLDER_ARGS])
    assert len(errors) == 1 and expected in errors[0] and errors[0].startswith("model.path: "), errors


def test_extra_layers_in_the_weights_are_named(folders, tmp_path) -> None:
    shallower = Path(shutil.copytree(folders["good"], tmp_path / "shallower"))
    config = json.loads((shallower / "config.json").read_text()) | {"num_hidden_layers": 1}
    (shallower / "config.json").write_text(json.dumps(config))
    errors = _errors(["model=hf", f"model.path={shallower}", *FOLDER_ARGS])
    assert len(errors) == 1 and "hold 9 tensors of layers its config.json does not describe" in errors[0], (
        errors
    )


def test_a_bin_with_code_is_refused_without_running_it(folders, tmp_path) -> None:
    """The weights-only check reads the pickle with torch's restricted unpickler: nothing it names is called."""
    from launcher.components.model.hf_weights import WeightsProblem

    with pytest.raises(WeightsProblem, match="posix.system"):
        bin_shapes(folders["payload"] / "pytorch_model.bin")


def test_a_truncated_folder_exits_2_without_a_run_directory(folders, tmp_path) -> None:
    result = run_cli(["model=hf", f"model.path={folders['truncated']}", *FOLDER_ARGS], tmp_path)
    assert result.returncode == 2 and "is truncated" in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_family_is_refused_with_our_message_alone(folders, hf_tokenizer, tmp_path) -> None:
    """The folder's tokenizer loads through AutoTokenizer, which reads config.json too: transformers' own
    warning about the unknown model_type is kept off the console, so the refusal is the first and only line."""
    folder = Path(shutil.copytree(folders["good"], tmp_path / "unknown"))
    for item in hf_tokenizer.iterdir():
        shutil.copy(item, folder / item.name)
    config = json.loads((folder / "config.json").read_text()) | {"model_type": "mystery_lm"}
    (folder / "config.json").write_text(json.dumps(config))
    result = run_cli(["model=hf", f"model.path={folder}", *FOLDER_ARGS], tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("error:"), result.stderr
    assert "model_type 'mystery_lm', a family this transformers release does not hold" in result.stderr
    assert "transformers]" not in result.stderr and "You are using a model of type" not in result.stderr
