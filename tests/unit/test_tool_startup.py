"""The offline commands (train-export, -generate, -quantize, -merge) answer --help and argument errors
before torch or transformers is imported, and train-generate explains why a completion stopped and
refuses --chat without a chat template before any model loads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import write_spec
from launcher.tools import generate
from launcher.tools.hf_folder import byte_tokenizer

HEAVY = ("torch", "transformers", "peft", "torchao", "datasets", "deepspeed", "bitsandbytes")
TOOLS = ("export", "generate", "quantize", "merge")

CHECKS = textwrap.dedent(
    """
    import contextlib, importlib, io, json, sys
    HEAVY = sys.argv[1].split(",")
    report = {}
    for tool in sys.argv[2].split(","):
        module = importlib.import_module(f"launcher.tools.{tool}")
        for case, argv in (("help", ["--help"]), ("bad argument", ["--no-such-flag"])):
            with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
                try:
                    status = module.main(argv)
                except SystemExit as stop:
                    status = stop.code
            heavy = sorted({name.split(".")[0] for name in sys.modules} & set(HEAVY))
            report[f"{tool} {case}"] = {"status": status, "heavy": heavy, "said": bool(out.getvalue() + err.getvalue())}
    print(json.dumps(report))
    """
)


def test_help_and_argument_errors_import_nothing_heavy() -> None:
    """One fresh interpreter, every command in turn (about 1 s)."""
    proc = subprocess.run(
        [sys.executable, "-c", CHECKS, ",".join(HEAVY), ",".join(TOOLS)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report) == 2 * len(TOOLS)
    for case, result in report.items():
        assert result["heavy"] == [], case
        assert result["said"], case
        assert result["status"] == (0 if case.endswith("help") else 2), case


def _source(prefer: int) -> generate.Source:
    """The byte tokenizer and a model that always puts `prefer` first (our own Source protocol)."""
    import torch

    def logits(ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(1, ids.shape[1], 256)
        out[..., prefer] = 1.0
        return out

    return generate.Source(
        model=logits,
        tokenizer=byte_tokenizer(),
        context=64,
        eos_ids=(0,),
        add_special_tokens=False,
        bos_id=None,
    )


def test_stop_reason_explains_an_empty_completion() -> None:
    source = _source(prefer=0)  # the eos byte first
    completion = generate.generate(source, [104, 105], max_new_tokens=8)
    assert (completion.ids, completion.stop, completion.eos_id) == ([], "eos", 0)
    line = generate.stop_line(completion, source, 8)
    assert line.startswith("generated 0 tokens") and "end token 0" in line and "--temperature" in line
    source = _source(prefer=ord("a"))
    completion = generate.generate(source, [104], max_new_tokens=3)
    assert (completion.ids, completion.stop) == ([97, 97, 97], "max_new_tokens")
    assert generate.stop_line(completion, source, 3) == "generated 3 tokens; stopped at --max-new-tokens 3."


def test_chat_without_template_is_refused_before_the_model_loads(tmp_path, hf_tokenizer, capsys) -> None:
    run_dir = tmp_path / "bytes-run"
    write_spec(["train.max_steps=1"], run_dir)  # a run whose checkpoint was never written: no model to load
    assert generate.main([str(run_dir), "--prompt", "hi", "--chat"]) == 2
    assert "byte tokenizer (tokenizer=bytes)" in capsys.readouterr().err
    folder = tmp_path / "hf-folder"  # an HF folder whose tokenizer has no template: refused by its files
    shutil.copytree(hf_tokenizer, folder)
    (folder / "config.json").write_text("{}")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for name in generate.CHAT_TEMPLATE_FILES:
        (folder / name).unlink(missing_ok=True)
    problem = generate.chat_problem(folder)
    assert problem and str(folder) in problem and "byte" not in problem and "chat_template.jinja" in problem
    assert generate.main([str(folder), "--prompt", "hi", "--chat"]) == 2


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja"])
def test_a_template_in_either_place_is_found(tmp_path, where: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    if where == "chat_template.jinja":
        (tmp_path / where).write_text("{{ messages[0]['content'] }}")
    else:
        (tmp_path / where).write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    assert generate.chat_problem(tmp_path) is None
