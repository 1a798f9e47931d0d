"""The reward group before launch: its presets, every refusal with its key and fix, the files' digests in the spec
and a resume whose reward file changed."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher.components import checkpoint
from launcher.config.reward import checkpoint_record
from launcher.front import compose
from launcher.front.cli import precheck
from launcher.spec import RunSpec, dump_spec, spec_text, to_spec

READ_BY = ("reward", "objective.name")
"""The refusal of rewards under an objective that reads none (these tests run objective=sft)."""
SHIPPED = sorted(p.stem for p in (Path(__file__).parents[2] / "conf" / "reward").glob("*.yaml"))


def _errors(*argv: str) -> dict[tuple[str, ...], str]:
    return {e.keys: e.message for e in precheck(list(argv))}


@pytest.fixture
def rewards_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "def correct(prompts, completions, answer, **kwargs):\n"
        "    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answer)]\n"
    )
    return path


def test_every_preset_composes_to_its_rewards() -> None:
    names = {}
    for option in SHIPPED:
        built = compose.build(compose.compose([f"reward={option}"]))
        names[option] = [e.message for e in built.errors if e.keys == READ_BY]
        assert [e for e in built.errors if e.keys != READ_BY] == [], option
    assert names["none"] == []
    assert "rewards are set (answer, format)" in names["r1"][0] and "objective=grpo" in names["r1"][0]


def test_built_in_settings_are_refused_with_their_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    errors = _errors(
        "reward=r1", "reward.answer.extract=tag:|first", "reward.format.pattern='<think>(.*'",
        "reward.length.weight=0.5", "reward.length.max_tokens=8", "reward.length.soft_tokens=9",
    )  # fmt: skip
    assert "names no tag" in errors[("reward.answer.extract",)]
    assert "not a valid Python regex" in errors[("reward.format.pattern",)]
    assert "at most 8" in errors[("reward.length.soft_tokens", "reward.length.max_tokens")]
    assert "max_tokens, which is null" in _errors("reward.length.weight=1")[("reward.length.max_tokens",)]
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as where the package is not installed
    message = _errors("reward=math_verify")[("reward.answer.match",)]
    assert "`pip install math-verify`" in message and "reward.answer.match=numeric" in message


def test_unusable_reward_files_are_refused_naming_them(rewards_file: Path, tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("def f(:\n")
    cases = {
        f"{tmp_path}/absent.py:correct": "absent.py does not exist",
        f"{rewards_file}:wrong": "defines no 'wrong' (its functions: correct)",
        f"{tmp_path}/broken.py:f": "broken.py failed at line 1 with SyntaxError",
    }
    errors = precheck([f"reward.functions=[{','.join(cases)}]", "reward.function_weights=[1,2]"])
    messages = [e.message for e in errors if e.keys == ("reward.functions",)]
    for entry, problem in cases.items():
        assert any(entry in m and problem in m for m in messages), (entry, messages)
    weights = [e.message for e in errors if e.keys == ("reward.function_weights", "reward.functions")]
    assert "2 weight(s) for 3 reward function(s)" in weights[0]


def test_the_command_line_exits_2_naming_the_file(tmp_path: Path) -> None:
    from conftest import run_cli

    done = run_cli(
        [f"reward.functions=[{tmp_path}/absent.py:fn]", "objective=sft"], cwd=tmp_path, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "absent.py does not exist" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def _built(*overrides: str) -> compose.Built:
    return compose.build(compose.compose(list(overrides)))


def _spec(built: compose.Built) -> RunSpec:
    """The spec a build made, its problems aside (these tests run objective=sft, which refuses rewards)."""
    return to_spec(compose.strip_hydra(built.config))


def test_the_spec_records_each_file_digest_and_a_reproduction_checks_it(rewards_file: Path) -> None:
    entry = f"reward.functions=[{rewards_file}:correct]"
    built = _built(entry)
    digest = hashlib.sha256(rewards_file.read_bytes()).hexdigest()
    assert OmegaConf.to_container(built.config.reward.digests) == [digest]
    assert f"- {digest}" in spec_text(_spec(built), rewards_file.parent / "spec.yaml")
    assert _built(entry, f"reward.digests=[{digest}]").errors == built.errors  # reproduced unchanged: fine
    rewards_file.write_text(rewards_file.read_text() + "# edited\n")
    problems = {e.keys: e.message for e in _built(entry, f"reward.digests=[{digest}]").errors}
    assert "my_rewards.py (reward.functions entry" in problems[("reward.functions", "reward.digests")]
    assert "changed since the run recorded it" in problems[("reward.functions", "reward.digests")]
    accepted = _built(entry, f"reward.digests=[{digest}]", "reward.allow_changed_files=true")
    assert accepted.config.reward.digests[0] == hashlib.sha256(rewards_file.read_bytes()).hexdigest()


@pytest.mark.parametrize("recorded_in", ["manifest", "spec.yaml"])
def test_a_resume_whose_reward_file_changed_is_refused(
    rewards_file: Path, tmp_path: Path, recorded_in: str
) -> None:
    run_dir = tmp_path / "run"
    entry = f"reward.functions=[{rewards_file}:correct]"
    spec = _spec(_built(entry, f"run_dir={run_dir}"))
    info = checkpoint_record(spec.reward) if recorded_in == "manifest" else {}
    checkpoint.save(
        run_dir, 2, lambda files: (files.directory / "weights.bin").write_bytes(b"w"), keep=2, info=info
    )
    if (
        recorded_in == "spec.yaml"
    ):  # a checkpoint whose manifest records no digest: the spec.yaml beside it does
        dump_spec(spec, run_dir / "spec.yaml")
    resume = (f"run_dir={run_dir}", "resume=auto")
    if recorded_in == "manifest":
        assert not [e for e in _built(entry, *resume).errors if "resume" in e.keys]
    rewards_file.write_text(rewards_file.read_text() + "# edited\n")
    problems = {e.keys: e.message for e in _built(entry, *resume).errors}
    message = problems[("resume", "reward.functions")]
    assert "step_2 was trained with other reward code" in message and str(rewards_file) in message
    assert not [
        e for e in _built(entry, *resume, "reward.allow_changed_files=true").errors if "resume" in e.keys
    ]
