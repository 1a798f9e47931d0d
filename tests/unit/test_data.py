"""The data pipeline: sources, the held-out split, packing, and the sampler's rank, accumulation and resume contracts."""

from __future__ import annotations

import json

import pytest
import torch

from launcher.components.data.loader import BackgroundBatches
from launcher.components.data.sequences import BatchStream, PackedSequences, val_batches
from launcher.components.data.sources import describe
from launcher.components.data.split import HASH_SPLIT_MIN_DOCUMENTS, held_out_tail, is_val_document
from launcher.components.data.tokens import START, TokenStore, load_corpus
from launcher.config.data import DataConfig


def _documents(store: TokenStore) -> list[bytes]:
    """The documents of a byte-token store, each without its closing 0 byte (eos)."""
    starts = torch.nonzero(store.flags & START).flatten().tolist() + [len(store)]
    data = bytes(store.tokens.tolist())
    return [data[a:b].removesuffix(b"\0") for a, b in zip(starts[:-1], starts[1:], strict=True)]


def _write_docs(folder, count: int) -> list[bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    docs = [f"document {i:03d} ".encode() * 5 for i in range(count)]
    for i, doc in enumerate(docs):
        (folder / f"doc_{i:03d}.txt").write_bytes(doc)
    return docs


def test_stdlib_corpus_is_large_and_deterministic() -> None:
    cfg = DataConfig(max_bytes=300_000, seq_len=64)
    first, second = load_corpus(cfg), load_corpus(cfg)
    assert first.train.tokens.dtype == torch.uint8 and first.train.tokens.ndim == 1
    assert len(first.train) + len(first.val) == 300_000
    assert len(first.val) >= 65
    assert torch.equal(first.train.tokens, second.train.tokens) and torch.equal(
        first.val.flags, second.val.flags
    )
    assert b"import" in bytes(first.train.tokens[:20_000].tolist())
    assert "standard library" in describe(cfg)


def test_split_is_deterministic_disjoint_and_keyed_by_document(tmp_path) -> None:
    docs = _write_docs(tmp_path / "corpus", 300)
    cfg = DataConfig(kind="text", path=str(tmp_path / "corpus" / "*.txt"), val_fraction=0.1, seq_len=8)
    corpus = load_corpus(cfg)
    train, val = _documents(corpus.train), _documents(corpus.val)
    assert sorted(train + val) == sorted(docs) and not set(train) & set(val)
    expected_val = [d for i, d in enumerate(docs) if is_val_document(f"doc_{i:03d}.txt", 0.1)]
    assert val == expected_val and 10 < len(val) < 60
    again = load_corpus(
        DataConfig(kind="text", path=str(tmp_path / "corpus" / "doc_*"), val_fraction=0.1, seq_len=8)
    )
    assert torch.equal(again.val.tokens, corpus.val.tokens) and torch.equal(
        again.train.tokens, corpus.train.tokens
    )


def test_max_bytes_caps_train_and_val_in_proportion(tmp_path) -> None:
    _write_docs(tmp_path, 300)
    cfg = DataConfig(kind="text", path=str(tmp_path / "*.txt"), val_fraction=0.1, seq_len=8, max_bytes=2000)
    corpus = load_corpus(cfg)
    assert (len(corpus.train), len(corpus.val)) == (1800, 200)


def test_a_single_text_file_holds_out_its_tail(tmp_path) -> None:
    data = bytes(range(32, 127)) * 108  # printable ASCII: data=text refuses binary files
    (tmp_path / "one.txt").write_bytes(data)
    corpus = load_corpus(
        DataConfig(kind="text", path=str(tmp_path / "one.txt"), val_fraction=0.1, seq_len=16)
    )
    assert bytes(corpus.train.tokens.tolist()) + bytes(corpus.val.tokens.tolist()) == data + b"\0"  # + eos
    assert len(corpus.val) == int(len(data) * 0.1)
    assert corpus.val.flags[0] & START  # the held-out tail is a document of its own


def test_few_files_hold_out_the_tail_of_their_stream(tmp_path) -> None:
    docs = _write_docs(tmp_path, 3)
    corpus = load_corpus(DataConfig(kind="text", path=str(tmp_path / "*.txt"), seq_len=16))
    assert len(PackedSequences(corpus.val, 16)) >= 1 and len(corpus.train) > len(corpus.val)
    stream = bytes(corpus.train.tokens.tolist()) + bytes(corpus.val.tokens.tolist())
    assert stream == b"".join(doc + b"\0" for doc in docs)  # in order, cut inside the last document
    assert len(corpus.val) == held_out_tail(len(stream), 16, 0.02) == 17


@pytest.mark.parametrize("kind", ["text", "files"])
def test_a_single_document_the_hash_would_hold_out_still_trains(tmp_path, kind: str) -> None:
    assert is_val_document("book321.txt", 0.02) and is_val_document("book321.txt:0", 0.02)
    text = "".join(f"line {i} of the only book\n" for i in range(200))
    (tmp_path / "book321.txt").write_text(text)
    cfg = DataConfig(kind=kind, path=str(tmp_path / "book321.txt"), seq_len=16, cache_dir=str(tmp_path / "c"))
    corpus = load_corpus(cfg)
    total = len(corpus.train) + len(corpus.val)
    assert total >= len(text) and len(corpus.val) == held_out_tail(total, 16, 0.02) == round(0.02 * total)
    assert bytes(corpus.train.tokens[:40].tolist()) == text[:40].encode()


def test_the_hash_rule_starts_at_its_document_count(tmp_path) -> None:
    docs = _write_docs(tmp_path / "corpus", HASH_SPLIT_MIN_DOCUMENTS)
    hashed = load_corpus(DataConfig(kind="text", path=str(tmp_path / "corpus" / "*.txt"), val_fraction=0.1))
    expected = [d for i, d in enumerate(docs) if is_val_document(f"doc_{i:03d}.txt", 0.1)]
    assert _documents(hashed.val) == expected
    (tmp_path / "corpus" / "doc_000.txt").unlink()
    tail = load_corpus(DataConfig(kind="text", path=str(tmp_path / "corpus" / "*.txt"), val_fraction=0.1))
    stream = b"".join(doc + b"\0" for doc in docs[1:])
    assert bytes(tail.train.tokens.tolist()) + bytes(tail.val.tokens.tolist()) == stream
    assert len(tail.val) == round(0.1 * len(stream))


def test_jsonl_reads_the_field_of_every_line_of_a_glob(tmp_path) -> None:
    for part in range(2):
        lines = [json.dumps({"text": f"record {part}-{i} " * 4, "id": i}) for i in range(50)]
        (tmp_path / f"part{part}.jsonl").write_text("\n".join(lines) + "\n\n")
    corpus = load_corpus(DataConfig(kind="jsonl", path=str(tmp_path / "part*.jsonl"), seq_len=16))
    docs = _documents(corpus.train) + _documents(corpus.val)
    assert len(docs) == 100 and b"record 1-49 " * 4 in docs
    other_field = tmp_path / "other.jsonl"
    other_field.write_text("\n".join(json.dumps({"body": f"x{i}" * 20}) for i in range(5)))
    corpus = load_corpus(DataConfig(kind="jsonl", path=str(other_field), field="body", seq_len=8))
    assert b"x0" * 20 in _documents(corpus.train) + _documents(corpus.val)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "bad.jsonl:2: not valid JSON"),
        ('{"title": "x"}', "bad.jsonl:2: field 'text' is missing"),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path, line: str, message: str) -> None:
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_corpus(DataConfig(kind="jsonl", path=str(tmp_path / "bad.jsonl")))


def test_missing_files_are_reported(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no file matches"):
        load_corpus(DataConfig(kind="text", path=str(tmp_path / "*.txt")))


def test_packed_sequences_shift_labels_by_one() -> None:
    tokens = torch.arange(50, dtype=torch.uint8)
    data = PackedSequences(TokenStore.of_stream(tokens, separator=None), 8)
    assert len(data) == 6  # (50 - 1) // 8
    batch = data.batch(torch.tensor([5, 0]))
    assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].shape == (2, 8)
    assert batch["input_ids"][0].tolist() == list(range(40, 48))
    assert batch["labels"][0].tolist() == list(range(41, 49))
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])


def _dataset(num_sequences: int = 23, seq_len: int = 4) -> PackedSequences:
    tokens = torch.arange(num_sequences * seq_len + 1) % 251
    return PackedSequences(TokenStore.of_stream(tokens.to(torch.uint8), separator=None), seq_len)


def _ids(batch: dict[str, torch.Tensor]) -> list[int]:
    """Sequence index of each row (first token // seq_len, valid while tokens stay below 251)."""
    return [int(row[0]) // 4 for row in batch["input_ids"]]


def test_ranks_together_see_what_one_process_with_a_bigger_batch_sees() -> None:
    single = BatchStream(_dataset(), micro_batch_size=6, seed=7)
    ranks = [BatchStream(_dataset(), micro_batch_size=3, seed=7, rank=r, world_size=2) for r in range(2)]
    for _ in range(9):  # 3 global micro batches per epoch: crosses two epoch boundaries
        expected = single.next_batch()
        parts = [stream.next_batch() for stream in ranks]
        for key in ("input_ids", "labels"):
            assert torch.equal(torch.cat([p[key] for p in parts]), expected[key])
    assert single.epoch == ranks[0].epoch == 2
    assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()


def test_every_epoch_is_a_fresh_permutation_without_repeats() -> None:
    stream = BatchStream(_dataset(), micro_batch_size=5, seed=3)
    epochs = [sorted(sum((_ids(stream.next_batch()) for _ in range(4)), [])) for _ in range(2)]
    assert all(len(set(e)) == 20 for e in epochs)
    orders = [BatchStream(_dataset(), micro_batch_size=5, seed=s).next_batch()["input_ids"] for s in (3, 4)]
    assert not torch.equal(*orders)


def test_accumulated_micro_batches_see_the_big_batch_sequences_across_epochs() -> None:
    big = BatchStream(_dataset(), micro_batch_size=6, seed=11)
    small = BatchStream(_dataset(), micro_batch_size=2, seed=11, grad_accum_steps=3)
    for _ in range(8):  # 23 sequences: 3 steps of 6 per epoch, 5 dropped each time
        step = sum((_ids(small.next_batch()) for _ in range(3)), [])
        assert step == _ids(big.next_batch())
    assert small.epoch == big.epoch == 2


@pytest.mark.parametrize("split_after", [2, 3, 5])  # mid-epoch, at the boundary, in the next epoch
def test_state_dict_round_trip_continues_identically(split_after: int) -> None:
    straight = BatchStream(_dataset(), micro_batch_size=3, seed=5, rank=1, world_size=2)
    expected = [straight.next_batch() for _ in range(8)]
    first = BatchStream(_dataset(), micro_batch_size=3, seed=5, rank=1, world_size=2)
    got = [first.next_batch() for _ in range(split_after)]
    state = json.loads(json.dumps(first.state_dict()))  # plain ints survive any serialization
    resumed = BatchStream(_dataset(), micro_batch_size=3, seed=5, rank=1, world_size=2)
    resumed.load_state_dict(state)
    got += [resumed.next_batch() for _ in range(8 - split_after)]
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert resumed.state_dict() == straight.state_dict()


def test_background_batches_are_the_streams_and_resume_where_the_loop_is() -> None:
    """A thread builds ahead; state_dict is still the position after the loop's last batch."""

    def stream() -> BatchStream:
        return BatchStream(_dataset(), micro_batch_size=3, seed=5, rank=1, world_size=2)

    straight, plain = stream(), stream()
    expected = [straight.next_batch() for _ in range(8)]
    ahead = BackgroundBatches(stream(), pin_memory=False)
    got = [ahead.next_batch() for _ in range(5)]  # into the next epoch; the thread is further still
    for _ in range(5):
        plain.next_batch()
    state = ahead.state_dict()
    assert state == plain.state_dict() and ahead.epoch == plain.epoch
    ahead.load_state_dict(state)  # the thread stops and restarts there
    got += [ahead.next_batch() for _ in range(3)]
    ahead.close()
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert ahead.state_dict() == straight.state_dict()


def test_too_small_dataset_names_the_fix() -> None:
    with pytest.raises(ValueError, match=r"Lower train.micro_batch_size or data.seq_len"):
        BatchStream(_dataset(5), micro_batch_size=3, seed=0, world_size=2)


def test_val_batches_are_ordered_sharded_and_capped() -> None:
    data = _dataset()
    single = list(val_batches(data, micro_batch_size=4, max_batches=3))
    assert [_ids(b) for b in single] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    ranks = [
        list(val_batches(data, micro_batch_size=2, max_batches=10, rank=r, world_size=2)) for r in range(2)
    ]
    assert [_ids(b) for b in ranks[1]][:2] == [[2, 3], [6, 7]]
    assert len(ranks[0]) == len(ranks[1]) == 5  # 23 sequences: 5 global batches of 4
    tiny = list(val_batches(_dataset(3), micro_batch_size=8, max_batches=4, rank=1, world_size=2))
    assert [_ids(b) for b in tiny] == [[1]]
    with pytest.raises(ValueError, match="Raise data.val_fraction or lower data.seq_len"):
        next(val_batches(_dataset(1), micro_batch_size=8, max_batches=4, world_size=2))
