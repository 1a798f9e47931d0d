"""On-policy distillation specs the rules refuse before launch, each with its keys and fix."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli
from launcher.front.cli import precheck

ON_POLICY = ("distill=on_policy", "data.packing=false", "model.vocab_size=300")


def _errors(*argv: str) -> dict[tuple[str, ...], str]:
    return {e.keys: e.message for e in precheck(list(argv))}


def test_a_valid_on_policy_spec_passes(hf_teacher: Path) -> None:
    assert _errors(*ON_POLICY, f"distill.teacher={hf_teacher}") == {}


def test_what_does_not_compose_is_refused(hf_teacher: Path) -> None:
    errors = _errors(
        "distill=on_policy", f"distill.teacher={hf_teacher}", "model.vocab_size=300", "data.seq_len=32",
        "distill.prompt_tokens=16", "distill.max_new_tokens=24", "distill.lmbda=1.5", "distill.beta=-1",
    )  # fmt: skip
    assert "data.packing=false" in errors[("distill.mode", "data.packing")]
    assert "may hold at most 8" in errors[("distill.prompt_tokens", "distill.max_new_tokens", "data.seq_len")]
    assert "[0, 1]" in errors[("distill.lmbda",)] and "[0, 1]" in errors[("distill.beta",)]
    assert (
        "does not run under a pipeline"
        in _errors(*ON_POLICY, f"distill.teacher={hf_teacher}", "parallel.pp_size=2", "launcher.nproc=2")[
            ("distill.teacher", "parallel.pp_size")
        ]
    )


def test_a_teacher_of_another_vocabulary_is_refused(hf_teacher: Path) -> None:
    message = _errors("distill=on_policy", "data.packing=false", f"distill.teacher={hf_teacher}")[
        ("distill.teacher", "model.vocab_size")
    ]
    assert "300 ids and the student's 256" in message


def test_a_prompt_longer_than_the_room_is_refused_before_launch(hf_teacher: Path, tmp_path: Path) -> None:
    """Instruction records' prompts are measured on the tokenized corpus: one too long stops the run, exit 2."""
    rows = [{"instruction": "say hi", "input": "", "output": "hi"}] * 40
    rows[7] = {"instruction": "x" * 200, "input": "", "output": "hi"}
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_cli(
        [*ON_POLICY, f"distill.teacher={hf_teacher}", "data=jsonl", f"data.path={data}", "data.format=instruction",
         "data.seq_len=128", "distill.max_new_tokens=32", f"run_dir={tmp_path / 'run'}"],
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "longer than data.seq_len - distill.max_new_tokens = 128 - 32 = 96 tokens" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
