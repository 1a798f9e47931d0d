"""Which runs evaluate after their last step (train.eval_at_end) and so need held-out data."""

from __future__ import annotations

import pytest

from launcher.spec import TrainConfig


@pytest.mark.parametrize(
    ("max_steps", "eval_every", "eval_at_end", "at_end", "evaluates"),
    [
        (1, 100, None, False, False),  # a short run is short: no evaluation at all
        (99, 100, None, False, False),
        (100, 100, None, True, True),
        (250, 100, None, True, True),  # the last interval is partial: still evaluated
        (1, 100, True, True, True),  # asked for
        (300, 100, False, False, True),
        (5, None, True, True, True),  # only at the end
        (5, None, None, False, False),
        (10, 100, False, False, False),  # shorter than the interval, none at the end: none
        (100, 100, False, False, True),  # step 100 evaluates
    ],
)
def test_end_of_run_evaluation(max_steps, eval_every, eval_at_end, at_end: bool, evaluates: bool) -> None:
    train = TrainConfig(max_steps=max_steps, eval_every=eval_every, eval_at_end=eval_at_end)
    assert train.evaluates_at_end() is at_end
    assert train.evaluates() is evaluates
