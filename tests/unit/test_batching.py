"""Unpacked documents: padding with -100 labels, length grouping, token budgets, rank split and exact resume."""

from __future__ import annotations

import torch

from launcher.components.data.batching import Documents, LengthGroupedStream, TokenBudgetStream
from launcher.components.data.sequences import BatchStream, PackedSequences
from launcher.components.data.tokens import TokenStore


def _corpus(num_docs: int = 400, seed: int = 0) -> torch.Tensor:
    """Documents of 3..120 bytes of text, each ended by the 0 separator."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for _ in range(num_docs):
        n = int(torch.randint(3, 120, (1,), generator=g))
        parts.append(torch.randint(97, 123, (n,), generator=g, dtype=torch.uint8))
        parts.append(torch.zeros(1, dtype=torch.uint8))
    return torch.cat(parts)


def test_documents_are_padded_with_ignored_labels() -> None:
    tokens = torch.tensor([5, 6, 7, 0, 8, 9, 10, 11, 12, 13, 0], dtype=torch.uint8)
    docs = Documents(TokenStore.of_stream(tokens), seq_len=4)
    # doc 1: 5 6 7 0 -> 3 inputs; doc 2 (7 tokens) -> chunks of 4 inputs and 2 inputs
    assert docs.lengths.tolist() == [3, 4, 2]
    batch = docs.batch(torch.tensor([0, 1, 2]))
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 10, 11], [12, 13, 0, 0]]
    assert batch["labels"].tolist() == [[6, 7, 0, -100], [9, 10, 11, 12], [13, 0, -100, -100]]


def _padding(stream, calls: int) -> float:
    real = total = 0
    for _ in range(calls):
        labels = stream.next_batch()["labels"]
        real += int((labels != -100).sum())
        total += labels.numel()
    return 1 - real / total


def test_grouping_by_length_cuts_padding() -> None:
    docs = Documents(TokenStore.of_stream(_corpus()), seq_len=64)
    fixed = BatchStream(docs, micro_batch_size=8, seed=1)
    grouped = LengthGroupedStream(docs, micro_batch_size=8, seed=1)
    assert _padding(grouped, 40) < 0.5 * _padding(fixed, 40)


def test_token_budget_batches_stay_within_budget_and_cover_the_data() -> None:
    docs = Documents(TokenStore.of_stream(_corpus()), seq_len=64)
    stream = TokenBudgetStream(docs, max_tokens=256, seed=1)
    seen, sizes = [], set()
    while stream.epoch == 0:
        batch = stream.next_batch()
        if stream.epoch:
            break
        assert batch["input_ids"].numel() <= 256
        sizes.add(len(batch["input_ids"]))
        seen.extend(batch["input_ids"][:, 0].tolist())
    assert len(sizes) > 3  # the number of documents per batch varies with their length
    assert len(seen) == len(docs)  # one epoch visits every document once (accumulation 1)


def test_ranks_split_each_global_batch_and_stay_in_step() -> None:
    docs = Documents(TokenStore.of_stream(_corpus(120)), seq_len=64)
    ranks = [
        TokenBudgetStream(docs, max_tokens=256, seed=3, rank=r, world_size=2, grad_accum_steps=2)
        for r in range(2)
    ]
    for _ in range(30):  # crosses epoch boundaries: both ranks start a new epoch on the same call
        a, b = (s.next_batch() for s in ranks)
        assert ranks[0].state_dict() == ranks[1].state_dict()
        assert a["input_ids"].numel() <= 256 and b["input_ids"].numel() <= 256
    assert ranks[0].epoch >= 1
    global_batches = ranks[0]._plan_epoch(0)
    assert all(
        torch.equal(x, y)
        for g, h in zip(global_batches, ranks[1]._plan_epoch(0), strict=True)
        for x, y in zip(g, h, strict=True)
    )
    used = torch.cat([part for g in global_batches for part in g])
    assert len(used) == len(set(used.tolist()))  # no document on two ranks or twice in an epoch
    assert len(used) > 0.9 * len(docs)  # only a last odd batch may be left out


def _continues_exactly(make) -> None:
    straight = make()
    expected = [straight.next_batch() for _ in range(50)]
    first = make()
    for _ in range(17):
        first.next_batch()
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    for want in expected[17:]:
        got = resumed.next_batch()
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["labels"], want["labels"])


def test_streams_resume_exactly() -> None:
    docs = Documents(
        TokenStore.of_stream(_corpus(120)), seq_len=64
    )  # a small corpus: the 50 batches span several epochs
    _continues_exactly(lambda: LengthGroupedStream(docs, micro_batch_size=4, seed=5, grad_accum_steps=2))
    _continues_exactly(lambda: TokenBudgetStream(docs, max_tokens=200, seed=5, grad_accum_steps=3))


def test_a_position_resumed_with_another_global_batch_continues_the_epoch_and_ends_it_cleanly() -> None:
    """Written with 4 sequences per step, resumed with 5 x 2 = 10 (12 taken: no multiple of 10): the epoch's
    permutation goes on where it stopped (no sequence repeated or skipped), and the epoch ends before a step
    that would run past it."""
    data = PackedSequences(TokenStore.of_stream(_corpus(60)), seq_len=32)
    n = len(data)
    first = BatchStream(data, micro_batch_size=4, seed=3, grad_accum_steps=1)
    taken = [first._next_indices() for _ in range(3)]  # 3 steps: 12 sequences
    state = first.state_dict()
    resumed = BatchStream(data, micro_batch_size=5, seed=3, grad_accum_steps=2)
    resumed.load_state_dict(state)
    for _ in range(n):  # bounded: a stream that never ends its epoch fails here, not by running on
        before = resumed.state_dict()
        step = [resumed._next_indices(), resumed._next_indices()]
        if resumed.epoch > 0:
            assert before["offset"] + 10 > n  # the epoch ended only where a whole step no longer fit
            break
        taken += step
    assert resumed.epoch == 1, "the resumed stream ran past the end of its epoch"
    order = torch.cat(taken)
    assert len(set(order.tolist())) == len(order) == 12 + 10 * ((n - 12) // 10)
    assert torch.equal(order, first._permutation(0)[: len(order)])
    assert all(len(t) in (4, 5) for t in taken)
