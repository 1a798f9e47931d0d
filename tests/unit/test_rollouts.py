"""The rollout source's pure parts on real components: the prompt stream, the rows' layout, prompt records, and the
reward group's scores turned into advantages, kept rows and metrics (launcher.rank.rollout_scoring)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from launcher.components.data.byte_tokenizer import ByteTokenizer
from launcher.components.data.prompts import Prompt, decode, encode_prompt, prompt_text
from launcher.components.data.sources import RecordError
from launcher.components.rewards import build_rewards
from launcher.config.objective import ObjectiveConfig
from launcher.config.reward import AnswerReward, RewardConfig
from launcher.config.tokenizer import TokenizerConfig
from launcher.rank.rollout_scoring import RewardScoring, overlong_penalty
from launcher.rank.rollouts import PromptStream, Rollouts, padded_rows


def test_the_prompt_stream_is_a_seeded_permutation_per_epoch() -> None:
    stream = PromptStream(5, seed=3)
    first = [stream.index(p) for p in range(10)]
    assert sorted(first[:5]) == sorted(first[5:]) == list(range(5)) and first[:5] != first[5:]
    assert [PromptStream(5, seed=3).index(p) for p in range(7, 10)] == first[7:]  # resumable at any position


def test_rows_are_prompt_then_completion_left_aligned_with_the_completion_as_labels() -> None:
    rows = padded_rows([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]])
    assert rows["input_ids"].tolist() == [[1, 2, 3, 5], [4, 7, 8, 0]]
    assert rows["labels"].tolist() == [[-100, -100, 5, 6], [7, 8, 9, -100]]


def test_prompt_records_are_read_as_text_or_rendered_messages() -> None:
    tok = ByteTokenizer()
    assert prompt_text({"prompt": "2+2=", "answer": "4"}, tok, "f:1") == ("2+2=", {"answer": "4"})
    text, fields = prompt_text({"messages": [{"role": "user", "content": "hi"}], "id": 7}, tok, "f:2")
    assert text == "<|user|>\nhi\0\n<|assistant|>\n" and fields == {"id": 7}
    assert encode_prompt({"prompt": "ab"}, TokenizerConfig(kind="bytes"), tok, "f:3") == (
        [97, 98],
        [False, False],
    )
    with pytest.raises(RecordError, match="f:4: 'prompt' must be a non-empty list"):
        prompt_text({"prompt": [{"role": "user"}]}, tok, "f:4")
    assert decode(tok, [104, 105]) == "hi"


def _rollouts(texts: list[str], truncated: list[bool], answers: list[str]) -> Rollouts:
    prompts = [Prompt(ids=(1,), text="q", fields={"answer": a}) for a in answers]
    ids = [[ord(c) for c in t] or [0] for t in texts]
    return Rollouts(
        prompts=prompts, completions=ids, texts=texts, truncated=truncated,
        rows=padded_rows([p.ids for p in prompts], ids), group_size=2, step=0,
    )  # fmt: skip


def _scoring(**keys) -> RewardScoring:
    rewards = build_rewards(
        RewardConfig(answer=AnswerReward(weight=1.0, extract="last_number")), base_dir=None
    )
    return RewardScoring(rewards, ObjectiveConfig(name="grpo", **keys), torch.float32)


CTX = SimpleNamespace(dist=SimpleNamespace(device=torch.device("cpu")))


def test_rewards_become_group_advantages_and_metrics() -> None:
    scoring = _scoring()
    out = scoring.score(_rollouts(["4", "5", "7", "7"], [False] * 4, ["4", "4", "7", "7"]), CTX)
    assert out["reward"].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert out["advantages"][:2].tolist() == pytest.approx([0.7070, -0.7070], abs=1e-3)
    assert out["advantages"][2:].tolist() == [0.0, 0.0] and out["keep"].tolist() == [1.0] * 4
    record = scoring.record(lambda values: values)
    assert record["reward"] == 0.75 and record["equal_groups"] == 0.5 and record["reward/answer"] == 0.75
    assert scoring.record(lambda values: values) == {}  # no rollouts since: nothing to say


def test_dropped_groups_and_truncated_rows_leave_the_loss_but_never_all_of_it() -> None:
    drop = _scoring(drop_equal_groups=True, mask_truncated_completions=True)
    out = drop.score(_rollouts(["4", "5", "7", "7"], [False, True, False, False], ["4", "4", "7", "7"]), CTX)
    assert out["keep"].tolist() == [1.0, 0.0, 0.0, 0.0]
    none = drop.score(_rollouts(["7", "7", "1", "1"], [False] * 4, ["4", "4", "7", "7"]), CTX)
    assert none["keep"].tolist() == [1.0] * 4 and none["advantages"].tolist() == [0.0] * 4


def test_the_soft_overlong_penalty_is_dapos() -> None:
    cfg = ObjectiveConfig(name="grpo", max_completion_length=10, overlong_buffer=4, overlong_penalty=1.0)
    assert overlong_penalty(torch.tensor([6, 8, 10]), cfg).tolist() == [0.0, -0.5, -1.0]
