"""Tokenizer folders people have (SentencePiece tokenizer.model with or without tokenizer_config.json, GPT-2's
vocab.json + merges.txt) load or are refused before launch naming the missing file or package, and
`tokenizer=auto` picks the model folder's tokenizer (bytes for the built-in GPT and the presets)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from conftest import run_cli
from launcher.components.data.tokenizer import load_problem, load_tokenizer, resolve_auto
from launcher.components.data.tokenizer_folder import folder_problem
from launcher.config.tokenizer import TokenizerConfig
from launcher.front import cli, compose

pytest.importorskip("sentencepiece")

from data_assets import make_gpt2_vocab_files, make_sentencepiece_tokenizer  # noqa: E402
from hf_assets import make_sentencepiece_llama  # noqa: E402

TEXT = "def step(x):\n    return  x * 12  # ünïcode 中文\t"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny Llama folder with a SentencePiece tokenizer.model and tokenizer_config.json."""
    return make_sentencepiece_llama(tmp_path_factory.mktemp("sp") / "llama")


@pytest.fixture(scope="module")
def bare_llama(tmp_path_factory, llama) -> Path:
    """The same folder without tokenizer_config.json (as llama2.c-style folders come)."""
    folder = tmp_path_factory.mktemp("sp") / "bare"
    shutil.copytree(llama, folder)
    (folder / "tokenizer_config.json").unlink()
    return folder


@pytest.mark.parametrize("with_config", [True, False])
def test_sentencepiece_folder_encodes_as_sentencepiece_does(tmp_path, with_config: bool) -> None:
    import sentencepiece

    folder = make_sentencepiece_tokenizer(tmp_path / "tok", config=with_config)
    tok = load_tokenizer(TokenizerConfig(kind="hf", path=str(folder)))
    reference = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    ids, trained = tok.encode([("def step(x):\n", False), (TEXT[13:], True)])
    assert ids == reference.encode(TEXT)
    assert tok.vocab_size == reference.vocab_size() == 512
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert trained[0] is False and trained[-1] is True


@pytest.mark.parametrize(
    ("blocked", "named"),
    [("sentencepiece", "pip install sentencepiece"), ("google.protobuf", "pip install protobuf")],
)
def test_missing_sentencepiece_packages_are_named(tmp_path, monkeypatch, blocked: str, named: str) -> None:
    folder = make_sentencepiece_tokenizer(tmp_path / "tok")
    monkeypatch.setitem(sys.modules, blocked, None)  # the package is absent: importing it fails
    problem = folder_problem(str(folder))
    assert problem is not None and named in problem and "SentencePiece model" in problem
    assert "tiktoken" not in problem
    (folder / "tokenizer.json").write_text("{}")  # a fast tokenizer file needs neither package
    assert folder_problem(str(folder)) is None


def test_a_tiktoken_tokenizer_model_needs_tiktoken(tmp_path, monkeypatch) -> None:
    (tmp_path / "tokenizer.model").write_text("IQ== 0\nIg== 1\nIw== 2\n")  # tiktoken's format: base64 rank
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    problem = folder_problem(str(tmp_path))
    assert problem is not None and "tiktoken BPE file" in problem and "pip install tiktoken" in problem


def test_gpt2_vocab_and_merges_need_a_tokenizer_config(tmp_path) -> None:
    folder = make_gpt2_vocab_files(tmp_path / "gpt2")
    cfg = TokenizerConfig(kind="hf", path=str(folder))
    problem = load_problem(cfg)
    assert problem is not None and "no tokenizer_config.json" in problem and '"GPT2Tokenizer"' in problem
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"})
    )
    assert load_problem(cfg) is None
    tok = load_tokenizer(cfg)
    assert tok.vocab_size == len(json.loads((folder / "vocab.json").read_text()))
    (folder / "merges.txt").unlink()
    assert "merges.txt" in str(folder_problem(str(folder)))


def test_a_tokenizer_that_does_not_load_is_a_problem_not_a_traceback(tmp_path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"model": "not a tokenizer"}')
    problem = load_problem(TokenizerConfig(kind="hf", path=str(tmp_path)))
    assert problem is not None and "does not load" in problem and str(tmp_path) in problem


def test_auto_resolves_from_the_model_folder(tmp_path) -> None:
    auto = TokenizerConfig()
    assert auto.kind == "auto"
    (tmp_path / "tokenizer.model").write_bytes(b"\n")
    assert resolve_auto(auto, str(tmp_path))[0] == TokenizerConfig(kind="hf", path=str(tmp_path))
    assert resolve_auto(auto, str(tmp_path / "none"))[0].kind == "bytes"
    assert resolve_auto(auto, None)[0].kind == "bytes"
    named = TokenizerConfig(path="/tok")
    assert resolve_auto(named, str(tmp_path))[0] == TokenizerConfig(kind="hf", path="/tok")
    explicit = TokenizerConfig(kind="bytes")
    assert resolve_auto(explicit, str(tmp_path))[0] == explicit


def test_auto_reads_an_exported_byte_model_with_bytes(tmp_path) -> None:
    """A folder `train-export` wrote for a bytes run keeps training on bytes (eos the 0 byte), not on its
    equivalent tokenizer.json, which declares no eos."""
    from launcher.tools.hf_folder import byte_tokenizer

    byte_tokenizer().save_pretrained(str(tmp_path))
    assert resolve_auto(TokenizerConfig(), str(tmp_path))[0].kind == "bytes"
    make_sentencepiece_tokenizer(tmp_path / "sp")
    load_tokenizer(TokenizerConfig(kind="hf", path=str(tmp_path / "sp"))).tok.save_pretrained(
        str(tmp_path / "sp")
    )
    assert resolve_auto(TokenizerConfig(), str(tmp_path / "sp"))[0].kind == "hf"


def _validate(args: list[str]):
    return compose.validate(compose.compose(args))


@pytest.mark.parametrize(("which", "adds_bos"), [("llama", True), ("bare_llama", False)])
def test_auto_takes_the_folders_tokenizer_and_its_size(request, which: str, adds_bos: bool) -> None:
    """vocab_size follows the folder, add_bos what its tokenizer does (its config's add_bos_token)."""
    folder = request.getfixturevalue(which)
    spec, errors = _validate(["model=hf", f"model.path={folder}"])
    assert errors == []
    assert (spec.tokenizer.kind, spec.tokenizer.path, spec.model.vocab_size) == ("hf", str(folder), 512)
    assert spec.tokenizer.add_bos is adds_bos
    assert load_tokenizer(spec.tokenizer).vocab_size == 512
    spec, errors = _validate(["model=hf", f"model.path={folder}", "tokenizer.add_bos=false"])
    assert errors == [] and spec.tokenizer.add_bos is False


def test_auto_gives_the_built_in_gpt_bytes() -> None:
    spec, errors = _validate([])
    assert errors == [] and spec.tokenizer.kind == "bytes" and spec.model.vocab_size == 256
    spec, errors = _validate(["model=hf_llama_tiny"])
    assert errors == [] and spec.tokenizer.kind == "bytes"


def test_bytes_on_a_pretrained_folder_with_its_own_vocabulary_is_refused(llama) -> None:
    _, errors = _validate(["model=hf", f"model.path={llama}", "tokenizer=bytes"])
    assert [e.keys for e in errors] == [("tokenizer.kind", "model.path")]
    assert "512 ids" in errors[0].message and "tokenizer=auto" in errors[0].message


def test_cli_names_a_missing_sentencepiece_and_exits_2(tmp_path, bare_llama) -> None:
    """The whole command line, with sentencepiece absent (a module that fails to import shadows it)."""
    shadow = tmp_path / "shadow" / "sentencepiece"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'sentencepiece'\")\n")
    env = {"PYTHONPATH": os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")])}
    run_dir = tmp_path / "run"
    proc = run_cli(["model=hf", f"model.path={bare_llama}", f"run_dir={run_dir}"], tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "pip install sentencepiece" in proc.stderr and "tokenizer.path" in proc.stderr
    assert "Traceback" not in proc.stderr and not run_dir.exists()


def test_dry_run_says_which_tokenizer_auto_chose(llama, capsys) -> None:
    assert cli.run(["model=hf", f"model.path={llama}", "dry_run=true"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"chosen by tokenizer=auto: the model folder '{llama}' holds its own tokenizer" in out
    assert "tokenizer: LlamaTokenizer" in out


def _tiktoken_folder(folder: Path) -> Path:
    """A folder as Llama 3's original/ download has it: a tiktoken tokenizer.model (every byte, a few merges), no more."""
    import base64

    folder.mkdir(parents=True)
    tokens = [bytes([b]) for b in range(256)] + [b"de", b"f ", b"st", b"ep", b"re", b"tu", b"rn"]
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    (folder / "tokenizer.model").write_text("\n".join(lines) + "\n")
    return folder


def test_a_tiktoken_folder_without_an_eos_is_refused_saying_how_to_name_one(tmp_path) -> None:
    pytest.importorskip("tiktoken")
    folder = _tiktoken_folder(tmp_path / "original")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": f"def step(x): return {i}"}) + "\n" for i in range(200)))
    argv = ["data=jsonl", f"data.path={data}", "tokenizer=hf", f"tokenizer.path={folder}"]
    errors = cli.precheck(argv)
    assert [e.keys for e in errors] == [("tokenizer.path", "tokenizer.add_eos")]
    message = errors[0].message
    assert "tiktoken BPE file" in message and '"eos_token": "<|end_of_text|>"' in message
    assert "tokenizer.add_eos=false" in message
    assert cli.precheck([*argv, "tokenizer.add_eos=false"]) == []
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    named = tmp_path / "named"
    shutil.copytree(folder, named)  # another path: the tokenizer is loaded once per path
    tok = load_tokenizer(TokenizerConfig(kind="hf", path=str(named)))
    assert tok.eos_id == 263 and tok.tok.convert_ids_to_tokens(263) == "<|end_of_text|>"
    assert cli.precheck([*argv[:3], f"tokenizer.path={named}"]) == []
