"""Rewards: the verifiers, the built-in terms, user reward files called as TRL calls them, and their failures."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest

from launcher.components.rewards import RewardError, RewardFileError, build_rewards, stop_message
from launcher.components.rewards.user_files import file_digest, load_function
from launcher.components.rewards.verifiers import answers_match, extract_answer, regex_match
from launcher.config.reward import AnswerReward, FormatReward, LengthReward, RewardConfig


@pytest.mark.parametrize(
    ("text", "how", "expected"),
    [
        ("3 apples and 1,250 pears, so -7.5.", "last_number", "-7.5"),
        ("the total is 1,250 pears", "last_number", "1250"),
        ("half: 1/2", "last_number", "1/2"),
        ("no digits here", "last_number", None),
        (r"so \boxed{\frac{1}{2}} or \boxed{3}", "boxed", "3"),
        (r"we get \boxed{\frac{1}{2}}.", "boxed", r"\frac{1}{2}"),
        (r"unclosed \boxed{3", "boxed", None),
        ("<answer>4</answer> then <answer> 5 </answer>", "tag:answer", "5"),
        ("<think>x</think>", "tag:answer", None),
        ("  whole  ", "none", "whole"),
        ("no box, but 12", "boxed|last_number", "12"),
        (r"\boxed{7} and 12", "boxed|last_number", "7"),
    ],
)
def test_extract_answer(text: str, how: str, expected: str | None) -> None:
    assert extract_answer(text, how) == expected


def test_extract_answer_refuses_an_unknown_extraction() -> None:
    with pytest.raises(ValueError, match="not an extraction"):
        extract_answer("1", "first_number")
    with pytest.raises(ValueError, match="tag:NAME"):
        extract_answer("1", "tag:")


@pytest.mark.parametrize(
    ("predicted", "reference", "mode", "expected"),
    [
        ("0.5", "1/2", "numeric", True),
        (".50", "1/2", "numeric", True),
        ("1,000", "1000", "numeric", True),
        ("$5", "5", "numeric", True),
        ("50%", "0.5", "numeric", True),
        ("0.33", "1/3", "numeric", False),
        ("Paris", "Paris", "numeric", True),
        ("0.5", "1/2", "exact", False),
        (" 42 ", "42", "exact", True),
        (None, "42", "exact", False),
        (r"\frac{1}{2}", "0.5", "math_verify", True),
        (r"\sqrt{4}", "2", "math_verify", True),
        ("x+1", "1+x", "math_verify", True),
        ("3", "2", "math_verify", False),
    ],
)
def test_answers_match(predicted: str | None, reference: str, mode: str, expected: bool) -> None:
    assert answers_match(predicted, reference, mode) is expected


def test_regex_match_is_a_full_match_across_lines() -> None:
    pattern = r"<think>.*</think>\s*<answer>.*</answer>"
    assert regex_match("<think>a\nb</think>\n<answer>3</answer>\n", pattern)
    assert not regex_match("<think>a</think><answer>3</answer> and more", pattern)
    assert not regex_match("prefix <think>a</think><answer>3</answer>", pattern)


def _write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


# The shape of TRL's documented reward functions (GRPOTrainer docs, "Using a custom reward function"): conversational
# completions as lists of message dicts, record fields as keyword lists, **kwargs taking the rest.
TRL_STYLE = """
    import re

    def accuracy_reward(completions, answer, **kwargs):
        contents = [completion[0]["content"] for completion in completions]
        return [1.0 if c.strip().endswith(str(a)) else 0.0 for c, a in zip(contents, answer)]

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    def progress(prompts, completions, completion_ids, trainer_state, log_metric, **kwargs):
        log_metric("seen", len(prompts))
        return [float(len(ids)) + trainer_state.global_step for ids in completion_ids]

    def only_math(completions, task, **kwargs):
        return [1.0 if t == "math" else None for t in task]

    from trl.rewards import think_format_reward

    def broken(completions, **kwargs):
        return [1.0 / (len(c) - 3) for c in completions]

    def short(completions, **kwargs):
        return [1.0]

    def nan(completions, **kwargs):
        return [float("nan")] * len(completions)

    async def judged(completions, **kwargs):
        return [0.5 for _ in completions]

    NOT_A_FUNCTION = 3
    """


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    return _write(tmp_path / "my_rewards.py", TRL_STYLE)


def test_trl_style_functions_work_unchanged_on_conversational_prompts(user_file: Path) -> None:
    cfg = RewardConfig(
        functions=[
            f"{user_file}:accuracy_reward",
            f"{user_file}:think_format_reward",
            f"{user_file}:progress",
        ],
        function_weights=[1.0, 0.5, 0.0],
    )
    rewards = build_rewards(cfg, user_file.parent)
    prompts = [[{"role": "user", "content": "What is 2+2?"}]] * 2
    completions = ["<think>add</think>so 4", "5"]  # plain strings: wrapped as TRL's assistant messages
    scores = rewards.score(
        prompts, completions, [{"answer": 4}, {"answer": 4}], completion_ids=[[1, 2], [3]], step=7
    )
    assert scores.per_function == {
        "accuracy_reward": [1.0, 0.0],
        "think_format_reward": [1.0, 0.0],
        "progress": [9.0, 8.0],
    }
    assert scores.total == [1.5, 0.0]
    assert scores.logged == {"seen": [2.0]}
    assert rewards.names == ["accuracy_reward", "think_format_reward", "progress"]


def test_plain_prompts_pass_plain_strings_and_none_adds_nothing(user_file: Path) -> None:
    rewards = build_rewards(
        RewardConfig(functions=[f"{user_file.name}:reward_len", "my_rewards.py:only_math"]), user_file.parent
    )
    scores = rewards.score(["p", "q"], ["x" * 18, "y" * 20], [{"task": "math"}, {"task": "code"}])
    assert scores.per_function["reward_len"] == [-2.0, 0.0]
    assert scores.per_function["only_math"][0] == 1.0 and math.isnan(scores.per_function["only_math"][1])
    assert scores.total == [-1.0, 0.0]
    judged = build_rewards(
        RewardConfig(functions=[f"{user_file}:judged"]), user_file.parent
    )  # async def, as TRL allows
    assert judged.score(["p", "q"], ["a", "b"], [{}, {}]).total == [0.5, 0.5]
    summary = scores.summary()
    assert summary["reward/only_math/mean"] == 1.0 and summary["reward/mean"] == -0.5


def test_built_in_terms_weighted_and_summed() -> None:
    cfg = RewardConfig(
        answer=AnswerReward(weight=1.0, extract="boxed|last_number", match="numeric"),
        format=FormatReward(weight=0.5, pattern=r"<think>.*</think>.*"),
        length=LengthReward(weight=1.0, max_tokens=4, soft_tokens=2),
    )
    rewards = build_rewards(cfg, Path("."))
    completions = [r"<think>hm</think> \boxed{0.5}", "1/3", "the answer is .50"]
    fields = [{"answer": "1/2"}] * 3
    scores = rewards.score(["q"] * 3, completions, fields, completion_ids=[[1, 2], [1, 2, 3], [1] * 9])
    assert scores.per_function == {
        "answer": [1.0, 0.0, 1.0],
        "format": [1.0, 0.0, 0.0],
        "length": [0.0, -0.5, -1.0],
    }
    assert scores.total == [1.5, -0.5, 0.0]


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("broken", "ZeroDivisionError: float division by zero"),
        ("short", "it returned 1 values for 3 completions"),
        ("nan", "non-finite value nan"),
    ],
)
def test_a_failing_reward_names_function_prompt_and_error(user_file: Path, name: str, error: str) -> None:
    rewards = build_rewards(RewardConfig(functions=[f"{user_file}:{name}"]), user_file.parent)
    prompts = ["first prompt", "second prompt", "third prompt"]
    with pytest.raises(RewardError) as caught:
        rewards.score(prompts, ["abcdef", "abc", "abcd"], [{}] * 3)
    text = str(caught.value)
    assert f"'{name}'" in text and error in text
    expected_prompt = "second prompt" if name == "broken" else "first prompt"  # the row it raises on alone
    assert caught.value.prompt == expected_prompt and expected_prompt in text
    message = stop_message(caught.value, 12, Path("run/checkpoints/step_10"))
    assert "step 12 (exit status 1)" in message and "step_10, is kept" in message


def test_a_missing_record_field_names_the_field() -> None:
    rewards = build_rewards(RewardConfig(answer=AnswerReward(weight=1.0, field="solution")), Path("."))
    with pytest.raises(RewardError, match="no field 'solution'.*reward.answer.field"):
        rewards.score(["q"], ["1"], [{"answer": "1"}])


def test_unusable_entries_name_the_file(user_file: Path, tmp_path: Path) -> None:
    bad = _write(tmp_path / "bad.py", "import not_a_module_anywhere\n")
    cases = {
        f"{tmp_path}/absent.py:f": "does not exist",
        f"{user_file}": "does not name a function",
        f"{user_file}:missing": "defines no 'missing'",
        f"{user_file}:NOT_A_FUNCTION": "is a int, not a function",
        f"{bad}:f": "failed at line 1 with ModuleNotFoundError",
    }
    for entry, problem in cases.items():
        with pytest.raises(RewardFileError, match=problem):
            load_function(entry, tmp_path)


def test_a_changed_file_is_refused_against_its_recorded_digest(user_file: Path) -> None:
    entry = f"{user_file}:reward_len"
    recorded = file_digest(user_file)
    build_rewards(RewardConfig(functions=[entry], digests=[recorded]), user_file.parent)
    user_file.write_text(user_file.read_text() + "\n# edited\n")
    with pytest.raises(RewardFileError, match=r"my_rewards.py .*changed since the run recorded it"):
        build_rewards(RewardConfig(functions=[entry], digests=[recorded]), user_file.parent)
    build_rewards(
        RewardConfig(functions=[entry], digests=[recorded], allow_changed_files=True), user_file.parent
    )
