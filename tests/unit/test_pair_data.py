"""Data that would train nothing is refused before launch with its counts and the fix, a few such pairs are
dropped with a console line (and the ranks leave out the same ones), and the advisor speaks when a real
DPO run's rewards and margins stay exactly 0."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys

import pytest
from data_assets import write_jsonl
from preference_assets import kto_records, pair_records
from rich.console import Console

from conftest import run_inline
from launcher.components.data.batching import PairDocuments
from launcher.components.data.pairs import REJECTED, TRAINED, encode_pair
from launcher.components.data.tokenizer import load_tokenizer
from launcher.components.data.tokens import load_corpus
from launcher.config.tokenizer import TokenizerConfig
from launcher.front import compose
from launcher.front.tokenize import prepare_data

DPO = ["objective=dpo", "data=jsonl", "data.format=preference", "data.seq_len=32", "train.micro_batch_size=2"]


def _prepare(tmp_path, records: list[dict], *args: str) -> tuple[list, str]:
    """(errors, console text) of the launcher's data preparation on these records."""
    data = write_jsonl(tmp_path / "d.jsonl", records)
    spec, errors = compose.validate(compose.compose([*args, f"data.path={data}"]))
    assert errors == []
    out = io.StringIO()
    errors = prepare_data(spec, Console(file=out, width=400))
    return [e.message for e in errors], " ".join(out.getvalue().split())


def test_a_blank_response_keeps_no_trained_token() -> None:
    tokenizer = load_tokenizer(TokenizerConfig())
    ids, flags = encode_pair({"prompt": "q", "chosen": " ", "rejected": " no"}, "preference", TokenizerConfig(),
                             tokenizer, "r")  # fmt: skip
    middle = next(i for i, f in enumerate(flags) if f & REJECTED)
    assert not any(f & TRAINED for f in flags[:middle])  # not even the EOS: the pair checks see an empty side
    assert any(f & TRAINED for f in flags[middle:])


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda r: {**r, "prompt": "long question " * 10 + r["prompt"]},
         ["would train nothing", "with a prompt that leaves no response token within data.seq_len=32",
          "the longest such prompt: 1", "raise data.seq_len"]),
        (lambda r: {**r, "rejected": r["chosen"]},
         ["with the same chosen and rejected text", "drop the records whose chosen and rejected are the same"]),
        (lambda r: {**r, "chosen": ""}, ["with a blank chosen or rejected side", "fill or drop the records"]),
    ],
)  # fmt: skip
def test_pairs_that_cannot_train_are_refused_with_counts_and_the_fix(tmp_path, change, expected) -> None:
    (message,), _ = _prepare(tmp_path, [change(r) for r in pair_records(40)], *DPO)
    assert re.match(r"(\d+) of \1 pairs in data.path", message) and "loss ln 2" in message, message
    assert all(part in message for part in expected), message


def test_a_few_pairs_are_dropped_with_a_count_and_the_ranks_leave_them_out(tmp_path) -> None:
    records = pair_records(60)
    records[3] = {**records[3], "rejected": records[3]["chosen"]}
    records[7] = {**records[7], "prompt": "x" * 80}
    errors, console = _prepare(tmp_path, records, *DPO)
    assert errors == []
    assert (
        "data: leaving out 2 of 59 pairs" in console and "1 with the same chosen and rejected text" in console
    )
    spec, _ = compose.validate(compose.compose([*DPO, f"data.path={tmp_path / 'd.jsonl'}"]))
    assert len(PairDocuments(load_corpus(spec.data, spec.tokenizer).train, 32, kto=False)) == 57


def test_one_class_kto_data_is_refused(tmp_path) -> None:
    records = [{**r, "label": True} for r in kto_records(40)]
    (message,), _ = _prepare(tmp_path, records, "objective=kto", *DPO[1:], "data.format=kto")
    assert "all 38 kto examples in data.path" in message and "labelled true (desirable)" in message
    assert "Add examples of the other label" in message
    assert _prepare(tmp_path, kto_records(40), "objective=kto", *DPO[1:], "data.format=kto")[0] == []


def test_a_source_of_empty_strings_is_refused_naming_it(tmp_path) -> None:
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": f"some words {i}"} for i in range(200)])
    empty = write_jsonl(tmp_path / "blank.jsonl", [{"text": ""} for _ in range(200)])
    spec, errors = compose.validate(
        compose.compose([f"data.sources=[{{path:{text},weight:1}},{{path:{empty},weight:1}}]"])
    )
    assert errors == []
    (error,) = prepare_data(spec, Console(file=io.StringIO()))
    assert error.keys == ("data.sources",) and "source 'blank'" in error.message
    assert "holds no text" in error.message and "set data.field" in error.message


def test_the_cli_refuses_long_prompts_before_launch(tmp_path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{**r, "prompt": "p" * 64} for r in pair_records(40)])
    run = subprocess.run(
        [sys.executable, "-m", "launcher", *DPO, f"data.path={data}", f"run_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr and not (tmp_path / "run").exists()
    assert re.search(r"(\d+) of \1 pairs", run.stderr), run.stderr


def test_the_advisor_speaks_when_a_real_dpo_run_keeps_rewards_at_zero(tmp_path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", pair_records(40))
    run_dir = tmp_path / "run"
    overrides = [
        *DPO, f"data.path={data}", "model=gpt_tiny", "train.max_steps=3", "train.log_every=1",
        "optimizer.lr=1e-30", "log.progress=false", "log.summary_table=false", f"run_dir={run_dir}",
    ]  # fmt: skip  # lr 1e-30: the weights never change, so the policy stays its reference
    assert run_inline(overrides, run_dir) == 0
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(s["rewards/margins"] == 0 for s in steps if "loss" in s)
    (advice,) = json.loads((run_dir / "summary.json").read_text())["advice"]
    assert advice["id"] == "preference_stuck" and advice["step"] == 3
    assert "exactly 0" in advice["message"] and "data.seq_len" in advice["message"]
