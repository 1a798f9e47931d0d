"""Every file the launcher writes, read back defensively: damaged copies are named with the fix, never used.

Each file kind is written once for real (a token cache, reference log-probs, the advisor's and the
micro-batch search's records, a sweep's point records, a Hugging Face folder), then damaged the ways
a disk, an interrupted copy or another version damages files: cut short, not JSON, wrong types,
negative sizes, pickle bytes, an odd size, a companion file missing. The readers raise one error
naming the file and what to do (or, for the advisory records, say so on the console and go on
without them); two runs check what the user sees end to end: `train` on a damaged token cache (exit
2, nothing started) and a rank reading damaged reference log-probs (exit 1), with no traceback.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from data_assets import write_jsonl
from payloads import Payload
from preference_assets import pair_records

from conftest import TINY, run_cli, write_spec
from launcher.components.advice import read_state
from launcher.components.data.tokens import build_cache, load_corpus
from launcher.components.files import token_cache
from launcher.components.files.records import DamagedFile
from launcher.components.files.safe_load import RefusedFile
from launcher.config.data import DataConfig
from launcher.config.tokenizer import TokenizerConfig
from launcher.front import sweep_status

DATA = DataConfig(max_bytes=20_000, seq_len=32)
BYTES = TokenizerConfig(kind="bytes")


@pytest.fixture(scope="module")
def good_cache(tmp_path_factory) -> Path:
    """A token cache folder as `train` writes it (the standard library's source, bytes tokenizer)."""
    cfg = DataConfig(**{**DATA.__dict__, "cache_dir": str(tmp_path_factory.mktemp("cache"))})
    folder, built = build_cache(cfg, BYTES)
    assert built and token_cache.read_folder(folder)["sizes"]["train"] > 0
    return folder


def _meta(folder: Path, change) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    change(meta)
    (folder / "meta.json").write_text(json.dumps(meta))


CACHE_DAMAGE = {
    "meta.json cut short": ("meta.json", lambda f: (f / "meta.json").write_text('{"dtype": "|u1", "si')),
    "meta.json not JSON": ("meta.json", lambda f: (f / "meta.json").write_bytes(b"\x80\x04K\x01.")),
    "meta.json a list": ("meta.json", lambda f: (f / "meta.json").write_text("[1, 2]")),
    "negative size": ("meta.json", lambda f: _meta(f, lambda m: m["sizes"].update(train=-5))),
    "size a string": ("meta.json", lambda f: _meta(f, lambda m: m["sizes"].update(val="8000"))),
    "size a bool": ("meta.json", lambda f: _meta(f, lambda m: m["num_documents"].update(train=True))),
    "sizes missing": ("meta.json", lambda f: _meta(f, lambda m: m.pop("sizes"))),
    "unknown dtype": ("meta.json", lambda f: _meta(f, lambda m: m.update(dtype="<f8"))),
    "vocab too small": ("train.tokens", lambda f: _meta(f, lambda m: m.update(vocab_size=10))),
    "pickle bytes as tokens": (
        "train.tokens",
        lambda f: (f / "train.tokens").write_bytes(pickle.dumps({"a": 1})),
    ),
    "tokens one byte long": ("train.tokens", lambda f: _append(f / "train.tokens", b"\x00")),
    "tokens cut short": ("val.tokens", lambda f: os.truncate(f / "val.tokens", 10)),
    "train.flags missing": ("train.flags", lambda f: (f / "train.flags").unlink()),
    "flags hold other bits": ("train.flags", lambda f: _poke(f / "train.flags", 5, 0xFF)),
    "first flag no start": ("train.flags", lambda f: _poke(f / "train.flags", 0, 1)),
}


def _append(path: Path, data: bytes) -> None:
    with path.open("ab") as handle:
        handle.write(data)


def _poke(path: Path, offset: int, value: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] = value
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", list(CACHE_DAMAGE))
def test_a_damaged_token_cache_is_refused_naming_the_file_and_the_fix(good_cache, tmp_path, damage) -> None:
    folder = tmp_path / good_cache.name
    shutil.copytree(good_cache, folder)
    named, change = CACHE_DAMAGE[damage]
    change(folder)
    with pytest.raises(DamagedFile) as refusal:
        token_cache.read_folder(folder)
    assert refusal.value.path == folder / named
    assert str(folder / named) in str(refusal.value) and f"Delete the folder {folder}" in str(refusal.value)


def test_the_cache_a_run_reuses_is_checked_and_a_good_one_loads(good_cache, tmp_path) -> None:
    cache_dir = tmp_path / "cache"
    shutil.copytree(good_cache, cache_dir / good_cache.name)
    cfg = DataConfig(**{**DATA.__dict__, "cache_dir": str(cache_dir)})
    corpus = load_corpus(cfg, BYTES)  # the same key: reused, not rebuilt
    assert len(corpus.train) == token_cache.read_meta(good_cache)["sizes"]["train"]
    os.truncate(cache_dir / good_cache.name / "train.flags", 7)
    with pytest.raises(DamagedFile, match="train.flags does not read back"):
        build_cache(cfg, BYTES)
    with pytest.raises(DamagedFile, match="train.flags does not read back"):
        load_corpus(cfg, BYTES)  # a rank checks sizes too (contents: the launching process)


@pytest.fixture(scope="module")
def logps_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ref") / "ref_logps-0.pt"
    torch.save(torch.randn(6, 2), path)
    return path


def _zip_cut(path: Path, out: Path) -> None:
    out.write_bytes(path.read_bytes()[:200])


LOGPS_DAMAGE = {
    "cut short": lambda good, out: _zip_cut(good, out),
    "plain pickle bytes": lambda good, out: out.write_bytes(pickle.dumps({"logps": [1.0, 2.0]})),
    "empty": lambda good, out: out.write_bytes(b""),
    "a dict of tensors": lambda good, out: torch.save({"x": torch.zeros(6, 2)}, out),
    "wrong shape": lambda good, out: torch.save(torch.zeros(5, 2), out),
    "wrong dtype": lambda good, out: torch.save(torch.zeros(6, 2, dtype=torch.float64), out),
    "NaN": lambda good, out: torch.save(torch.full((6, 2), float("nan")), out),
}


@pytest.mark.parametrize("damage", list(LOGPS_DAMAGE))
def test_damaged_reference_logps_are_refused_naming_the_file(logps_file, tmp_path, damage) -> None:
    assert token_cache.read_ref_logps(logps_file, 6, 2).shape == (6, 2)
    path = tmp_path / logps_file.name
    LOGPS_DAMAGE[damage](logps_file, path)
    with pytest.raises(DamagedFile) as refusal:
        token_cache.read_ref_logps(path, 6, 2)
    text = str(refusal.value)
    assert str(path) in text and f"Delete {path}" in text and "weights_only=False" not in text


def test_reference_logps_that_name_code_stay_evidence(tmp_path) -> None:
    marker, path = tmp_path / "ran", tmp_path / "ref_logps-0.pt"
    torch.save({"x": Payload(marker)}, path)
    with pytest.raises(RefusedFile) as refusal:
        token_cache.read_ref_logps(path, 6, 2)
    assert refusal.value.names_code and not isinstance(refusal.value, DamagedFile)
    assert "left where it is" in str(refusal.value) and not marker.exists() and path.exists()


BAD_ADVICE_STATES = {
    "a list": "[]",
    "not JSON": "global_batch=8",
    "batch a string": '{"global_batch": "x", "lr": 0.001}',
    "batch infinite": '{"global_batch": 1e999, "lr": 0.001}',
    "batch zero": '{"global_batch": 0, "lr": 0.001}',
    "lr missing": '{"global_batch": 8}',
    "lr negative": '{"global_batch": 8, "lr": -1}',
}


@pytest.mark.parametrize("damage", list(BAD_ADVICE_STATES))
def test_a_damaged_advice_state_is_named_and_ignored(tmp_path, damage) -> None:
    path = tmp_path / "advice_state.json"
    path.write_text('{"global_batch": 8, "lr": 0.001}\n')
    assert read_state(tmp_path) == {"global_batch": 8, "lr": 0.001}
    path.write_text(BAD_ADVICE_STATES[damage])
    said: list[str] = []
    assert read_state(tmp_path, said.append) is None
    assert len(said) == 1 and str(path) in said[0] and "this session's global batch" in said[0]


BAD_MICRO_BATCH = {
    "zero": {"key": {"per_rank_batch": 8}, "micro_batch_size": 0},
    "a string": {"key": {"per_rank_batch": 8}, "micro_batch_size": "4"},
    "not a divisor": {"key": {"per_rank_batch": 8}, "micro_batch_size": 3},
    "key a list": {"key": [8], "micro_batch_size": 4},
    "per-rank zero": {"key": {"per_rank_batch": 0}, "micro_batch_size": 4},
}


@pytest.mark.parametrize("damage", [*BAD_MICRO_BATCH, "not JSON"])
def test_a_damaged_micro_batch_record_is_named_and_searched_again(tmp_path, capsys, damage) -> None:
    from launcher.rank.micro_batch import RECORD, Search, _recorded

    search = Search(per_rank_batch=8, seq_len=32, budget_bytes=None, cap=8)
    path = tmp_path / RECORD
    path.write_text(json.dumps({"key": search.key(), "micro_batch_size": 4}))
    assert _recorded(tmp_path, search)["micro_batch_size"] == 4
    path.write_text("{" if damage == "not JSON" else json.dumps(BAD_MICRO_BATCH[damage]))
    assert _recorded(tmp_path, search) is None
    out = capsys.readouterr().out
    assert str(path) in out and "search runs again" in out


BAD_POINTS = {
    "summary a list": ("summary.json", "[1]"),
    "exit reason a number": ("summary.json", '{"exit_reason": 3, "steps": 2}'),
    "loss a string": ("summary.json", '{"exit_reason": "completed", "steps": 2, "final_loss": "low"}'),
    "negative steps": ("summary.json", '{"exit_reason": "completed", "steps": -2, "final_loss": 1.0}'),
    "summary cut short": ("summary.json", '{"exit_reason": "compl'),
    "overrides a string": ("sweep_point.json", '{"num": 1, "overrides": "a=1"}'),
    "overrides of numbers": ("sweep_point.json", '{"num": 1, "overrides": [1, 2]}'),
}


@pytest.mark.parametrize("damage", list(BAD_POINTS))
def test_a_sweep_point_whose_records_are_damaged_shows_as_unreadable(tmp_path, capsys, damage) -> None:
    for num, loss in ((0, 2.0), (1, 1.0)):
        point = tmp_path / str(num)
        point.mkdir()
        (point / "sweep_point.json").write_text(
            json.dumps({"num": num, "overrides": [f"optimizer.lr={num}"]})
        )
        summary = {"exit_reason": "completed", "steps": 2, "final_loss": loss, "eval_loss": None}
        (point / "summary.json").write_text(json.dumps(summary))
    name, text = BAD_POINTS[damage]
    (tmp_path / "1" / name).write_text(text)
    with pytest.raises(SystemExit) as ended:
        sweep_status.main([str(tmp_path)])
    assert ended.value.code == 1  # a point did not complete as far as its records tell
    out = capsys.readouterr().out
    row = next(
        r
        for r in json.loads((tmp_path / "sweep_summary.json").read_text())["points"]
        if r["run_dir"].endswith("1")
    )
    assert row["status"] == "unreadable" and result_winner(tmp_path) == 0
    assert f"{tmp_path / '1' / name} does not read back" in " ".join(out.split())
    assert "winner" in out


def result_winner(sweep_dir: Path) -> int:
    return json.loads((sweep_dir / "sweep_summary.json").read_text())["winner"]["point"]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, hf_tokenizer) -> Path:
    """A tiny Llama folder with the tests' tokenizer, as `save_pretrained` writes it."""
    from hf_assets import hf_config
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("hf") / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config("llama", vocab_size=400), dtype=torch.float32).save_pretrained(
        out
    )
    for path in hf_tokenizer.iterdir():
        shutil.copy(path, out / path.name)
    return out


def _generate(folder: Path, capsys) -> tuple[int, str]:
    from launcher.tools import generate

    code = generate.main([str(folder), "--prompt", "hi", "--max-new-tokens", "2"])
    return code, " ".join(capsys.readouterr().err.split())


def test_generate_refuses_a_folder_whose_shapes_do_not_fit_its_config(hf_folder, tmp_path, capsys) -> None:
    assert _generate(hf_folder, capsys)[0] == 0
    folder = tmp_path / "model"
    shutil.copytree(hf_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    code, err = _generate(folder, capsys)
    assert code == 2 and f"The weights in '{folder}' do not fit the model its config.json describes" in err


@pytest.mark.parametrize("content", ['{"version": "1.0", "model": 5}', '{"version": "1.0", "trunc', ""])
def test_generate_names_a_damaged_tokenizer_json(hf_folder, tmp_path, capsys, content) -> None:
    folder = tmp_path / "model"
    shutil.copytree(hf_folder, folder)
    (folder / "tokenizer.json").write_text(content)
    code, err = _generate(folder, capsys)
    assert code == 2 and f"'{folder / 'tokenizer.json'}' in the tokenizer folder is damaged" in err


def test_train_on_a_damaged_token_cache_exits_2_naming_the_file(tmp_path) -> None:
    cache = tmp_path / "cache"
    args = [*TINY, "train.max_steps=3", "train.eval_every=null", f"data.cache_dir={cache}"]
    first = run_cli([*args, "dry_run=true"], tmp_path)  # tokenizes into the cache, starts nothing
    assert first.returncode == 0, first.stderr
    (folder,) = cache.iterdir()
    _meta(folder, lambda m: m["sizes"].update(train=-1))
    run = run_cli([*args, f"run_dir={tmp_path / 'run'}"], tmp_path)
    err = " ".join(run.stderr.split())
    assert run.returncode == 2 and "Traceback" not in run.stderr + run.stdout
    assert f"{folder / 'meta.json'} does not read back as the launcher wrote it: sizes.train is -1" in err
    assert f"Delete the folder {folder}" in err and not (tmp_path / "run").exists()


def test_a_rank_reading_damaged_reference_logps_exits_1_naming_the_file(tmp_path, capsys) -> None:
    from launcher.rank import worker
    from launcher.rank.objective import cache_file
    from launcher.spec import load_spec

    data = write_jsonl(tmp_path / "pairs.jsonl", pair_records(16))
    spec_path = write_spec(
        [
            "objective=dpo", "objective.reference=precompute", "data=jsonl", "data.format=preference",
            f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32", "model=gpt_tiny",
            "train.max_steps=1", "train.micro_batch_size=4", "train.eval_every=null", "log.progress=false",
            "log.summary_table=false",
        ],
        tmp_path / "run",
    )  # fmt: skip
    spec = load_spec(spec_path)
    build_cache(spec.data, spec.tokenizer)
    path = cache_file(spec)
    torch.save(torch.zeros(3, 2), path)  # another corpus's rows
    assert worker.run(spec_path) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert f"error: {path} does not read back as the launcher wrote it" in out and "Traceback" not in out
    assert re.search(r"holds a torch.float32 tensor \[3, 2\], not float32 \[\d+, 2\]", out) and path.exists()


def test_a_mixture_source_with_a_damaged_meta_is_refused_before_launch(tmp_path) -> None:
    from launcher.components.data import mixture
    from launcher.components.data.tokens import cached_path
    from launcher.front import compose
    from launcher.front.tokenize import prepare_data

    for name in ("web", "code"):
        text = "".join(json.dumps({"text": f"{name} {i} " * 40}) + "\n" for i in range(40))
        (tmp_path / f"{name}.jsonl").write_text(text)
    sources = f"data.sources=[{{path:{tmp_path}/web.jsonl,weight:0.7}},{{path:{tmp_path}/code.jsonl}}]"
    built = compose.build(
        compose.compose([*TINY, sources, f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=16"])
    )
    assert not built.errors and prepare_data(built.spec) == []
    folder = cached_path(mixture.resolve(built.spec.data)[1].data, built.spec.tokenizer)
    (folder / "meta.json").write_text('{"dtype": "|u1", "sizes": {"train": "many"')
    (error,) = prepare_data(built.spec)
    assert error.keys == ("data.cache_dir",) and str(folder / "meta.json") in error.message
    assert "it is not JSON" in error.message and f"Delete the folder {folder}" in error.message
