"""`train-generate --prompts FILE`: JSONL in, JSONL out (stdout or --out), the same completions whatever
the batch size and as `--prompt` gives one by one; a malformed file or option is refused with exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hf_assets import hf_config

from launcher.tools import generate

PROMPTS = ["def main(", "import os\nimport sys\n", "x = ", "class Point:\n    def __init__(self"]
FEW = ["--max-new-tokens", "6"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, hf_tokenizer) -> Path:
    """A tiny GPT-2 folder sized to the test tokenizer (400 ids, eos 2), tokenizer files beside the weights."""
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("gpt2-with-tokenizer")
    config = hf_config("gpt2", vocab_size=400)
    config.bos_token_id, config.eos_token_id = 1, 2
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    shutil.copytree(hf_tokenizer, out, dirs_exist_ok=True)
    return out


def _prompts_file(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_a_prompts_file_gives_one_jsonl_record_per_prompt(folder, tmp_path, capsys) -> None:
    lines = [json.dumps({"prompt": p, "id": i}) for i, p in enumerate(PROMPTS)]
    prompts = _prompts_file(tmp_path, [lines[0], "", *lines[1:]])  # a blank line is skipped
    out = tmp_path / "out.jsonl"
    assert (
        generate.main([str(folder), "--prompts", str(prompts), "--out", str(out), *FEW, "--batch-size", "3"])
        == 0
    )
    records = _records(out.read_text())
    assert [r["prompt"] for r in records] == PROMPTS
    assert all(set(r) == {"prompt", "completion", "token_ids", "stop"} for r in records)
    assert all(r["stop"] in ("eos", "max_new_tokens") and len(r["token_ids"]) <= 6 for r in records)
    assert "tokens for 4 prompts" in capsys.readouterr().err
    assert generate.main([str(folder), "--prompts", str(prompts), *FEW, "--batch-size", "1"]) == 0
    assert _records(capsys.readouterr().out) == records  # on stdout, one prompt at a time: the same
    assert generate.main([str(folder), "--prompt", PROMPTS[1], *FEW]) == 0
    assert capsys.readouterr().out == records[1]["completion"] + "\n"


def test_the_seeded_samples_do_not_depend_on_the_batch_size(folder, tmp_path, capsys) -> None:
    prompts = _prompts_file(tmp_path, [json.dumps({"prompt": p}) for p in PROMPTS])
    sample = ["--temperature", "0.9", "--top-k", "20", "--top-p", "0.95", "--seed", "5"]
    got = []
    for size in ("1", "4"):
        assert (
            generate.main([str(folder), "--prompts", str(prompts), *FEW, *sample, "--batch-size", size]) == 0
        )
        got.append(_records(capsys.readouterr().out))
    assert got[0] == got[1]


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("{not json", "line 2 is not JSON"),
        ('["def main("]', "line 2 holds a JSON list, not an object"),
        ('{"text": "def main("}', 'line 2 has no "prompt" field (its fields: text)'),
        ('{"prompt": ""}', 'line 2 has a "prompt" that is not a non-empty string'),
    ],
)
def test_a_malformed_prompts_file_is_refused_naming_file_and_line(
    tmp_path, capsys, line: str, said: str
) -> None:
    prompts = _prompts_file(tmp_path, ['{"prompt": "fine"}', line])
    missing_model = tmp_path / "no-such-model"  # refused before any model is looked for
    assert generate.main([str(missing_model), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert (
        f"--prompts {prompts} {said}" in err and "fix or remove that line" in err and "Traceback" not in err
    )


def test_bad_options_of_a_prompts_run_are_refused(folder, tmp_path, capsys) -> None:
    prompts = _prompts_file(tmp_path, ['{"prompt": "fine"}'])
    empty = tmp_path / "empty"
    empty.mkdir()
    taken = tmp_path / "taken.jsonl"
    taken.write_text("mine\n")
    cases = {
        ("--prompts", str(prompts), "--top-k", "-1"): "--top-k must be 0",
        ("--prompts", str(prompts), "--batch-size", "0"): "--batch-size must be 1 or more",
        ("--prompt", "x", "--out", str(tmp_path / "o.jsonl")): "--out writes the JSONL of --prompts",
        ("--prompts", str(prompts), "--out", str(taken)): "already exists",
        ("--prompts", str(tmp_path / "none.jsonl")): "cannot be read",
        ("--prompts", str(_prompts_file(empty, ["", "  "]))): "holds no prompts",
    }
    for args, said in cases.items():
        assert generate.main([str(folder), *args]) == 2, args
        assert said in capsys.readouterr().err, args
    assert taken.read_text() == "mine\n"
    with pytest.raises(SystemExit) as stopped:  # argparse: one of --prompt / --prompts, not both
        generate.main([str(folder), "--prompt", "x", "--prompts", str(prompts)])
    assert stopped.value.code == 2
