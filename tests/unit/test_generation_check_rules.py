"""The generation checks' pure parts (launcher/components/generation_checks.py) and their rules
(launcher/rules/eval_generation.py): the prompts file judged line by line before launch, answers compared
by each match mode, and the pass@k estimator against its definition. The runs: tests/integration/."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from conftest import TINY, run_cli
from launcher.components.generation_checks import PromptsFileError, is_correct, pass_at_k, read_checks, scores
from launcher.components.rewards.verifiers import math_verify_installed
from launcher.config.eval import GenerationEvalConfig
from launcher.front.cli import precheck


def _cfg(**kw) -> GenerationEvalConfig:
    return GenerationEvalConfig(prompts="unused", **kw)


def test_pass_at_k_is_the_chance_that_k_of_n_samples_hold_a_correct_one() -> None:
    for n, c, k in [(4, 0, 1), (4, 1, 2), (5, 2, 3), (6, 6, 2), (10, 3, 10)]:
        draws = list(itertools.combinations([1] * c + [0] * (n - c), k))  # every k-subset of the n samples
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws))
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    got = scores([0, 2, 4], _cfg(samples=4, pass_at=(1, 4)))
    assert got == {
        "eval/generation/accuracy": 0.5,
        "eval/generation/pass@1": pytest.approx(0.5),
        "eval/generation/pass@4": pytest.approx(2 / 3),
    }


def test_each_match_mode_compares_the_extracted_answer() -> None:
    assert is_correct(" 42 ", "42", _cfg())  # exact, the whole completion stripped
    assert not is_correct("the answer is 42", "42", _cfg())
    assert is_correct("so 1/2 of them, then 0.50", ".5", _cfg(extract="last_number", match="numeric"))
    assert is_correct("<answer> B </answer> C", "B", _cfg(extract="tag:answer"))
    assert is_correct("x = \\boxed{7}", "7", _cfg(extract="boxed|last_number", match="numeric"))
    assert not is_correct("no number here", "7", _cfg(extract="last_number", match="numeric"))
    assert is_correct("Paris, France", "Paris.*", _cfg(match="regex"))
    assert not is_correct("In Paris", "Paris.*", _cfg(match="regex"))  # the whole answer, not a search
    if math_verify_installed():
        assert is_correct("\\boxed{\\frac{1}{2}}", "0.5", _cfg(extract="boxed", match="math_verify"))


def test_the_file_is_read_with_its_fields_and_limit(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"q": "2+3=", "a": 5, "id": 1}\n\n{"q": "1+1=", "a": "2"}\n{"q": "x", "a": "y"}\n')
    checks = read_checks(GenerationEvalConfig(prompts=str(path), prompt_field="q", answer_field="a", limit=2))
    assert [(c.prompt, c.reference, c.line) for c in checks] == [("2+3=", "5", 1), ("1+1=", "2", 3)]


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ('{"prompt": "a", "answer": "b"', "line 2: it is not JSON"),
        ('["a", "b"]', "line 2: it is a JSON list, not an object"),
        ('{"text": "a", "answer": "b"}', "line 2: its 'prompt' is not a non-empty string (no such field)"),
        ('{"prompt": "a", "answer": null}', "line 2: its 'answer' is not a string or a number"),
        ('{"prompt": "a", "answer": "(["}', "line 2: its 'answer' is not a regular expression"),
    ],
)
def test_a_malformed_line_is_named_by_file_and_line(tmp_path: Path, line: str, said: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "answer": "1"}) + "\n" + line + "\n")
    with pytest.raises(PromptsFileError) as err:
        read_checks(GenerationEvalConfig(prompts=str(path), match="regex"))
    assert f"{path}, {said}" in str(err.value)


def test_the_rules_refuse_before_launch(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n')
    base = [f"eval.generation.prompts={path}", "train.eval_every=10"]
    errors = {e.keys: " ".join(e.message.split()) for e in precheck([*base, "eval.generation.samples=4",
              "eval.generation.pass_at=[2,8]", "eval.generation.extract=tag", "parallel.pp_size=2"])}  # fmt: skip
    assert (
        "4 copies of the greedy completion"
        in errors[("eval.generation.samples", "eval.generation.temperature")]
    )
    assert (
        "pass@8 needs k from 1 to the samples per prompt (4)"
        in errors[("eval.generation.pass_at", "eval.generation.samples")]
    )
    assert "names no tag: write tag:NAME" in errors[("eval.generation.extract",)]
    assert "parallel.pp_size=2 does not offer" in errors[("eval.generation.prompts", "parallel.pp_size")]
    engine = {e.keys: e.message for e in precheck([*base, "parallel=zero3"])}
    assert "parallel.strategy=deepspeed does not offer" in " ".join(
        engine[("eval.generation.prompts", "parallel.strategy")].split()
    )
    assert precheck([*base, "checkpoint.keep_best=eval/generation/accuracy", "checkpoint.every=10"]) == []


def test_a_malformed_prompts_file_exits_2_naming_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    result = run_cli([*TINY, f"eval.generation.prompts={path}", f"run_dir={tmp_path / 'run'}"], tmp_path)
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2 and f"{path}, line 2: its 'answer' is not a string or a number" in out, out
    assert not (tmp_path / "run").exists()
