"""Data mixtures (`data.sources`): the weighted interleave, the spec round trip, the cache per source, the rules."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from conftest import write_spec
from launcher.components.data import mixture
from launcher.components.data.interleave import MixtureStream, choose, source_epochs, thresholds
from launcher.components.data.loader import BackgroundBatches, PrefetchedBatches
from launcher.components.data.sequences import PackedSequences
from launcher.components.data.tokens import START, TokenStore, build_cache, load_corpus
from launcher.front import compose
from launcher.spec import load_spec

SEQ_LEN = 4


def _dataset(offset: int, num_sequences: int) -> PackedSequences:
    """Sequences whose first token names them: source offset + index (tokens below 251)."""
    starts = torch.arange(offset, offset + num_sequences).repeat_interleave(SEQ_LEN)
    tokens = torch.cat([starts, starts[-1:]]).to(torch.uint8)
    return PackedSequences(TokenStore.of_stream(tokens, separator=None), SEQ_LEN)


def _stream(micro: int = 6, rank: int = 0, world: int = 1, seed: int = 3) -> MixtureStream:
    """Three sources: big (100 sequences, ids 0-99), mid (40, ids 100-139), small (7, ids 200-206)."""
    datasets = {"big": _dataset(0, 100), "mid": _dataset(100, 40), "small": _dataset(200, 7)}
    weights = {"big": 5.0, "mid": 3.0, "small": 2.0}
    return MixtureStream(datasets, weights, micro_batch_size=micro, seed=seed, rank=rank, world_size=world)


def _ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return batch["input_ids"][:, 0].tolist()


def test_draws_follow_the_weights_and_are_a_function_of_seed_and_position() -> None:
    cumulative = thresholds([0.7, 0.2, 0.1])
    draws = choose(11, 0, 40_000, cumulative)
    shares = torch.bincount(draws, minlength=3).double() / len(draws)
    for share, weight in zip(shares.tolist(), (0.7, 0.2, 0.1), strict=True):
        assert share == pytest.approx(weight, abs=4 * (weight * (1 - weight) / len(draws)) ** 0.5)
    assert torch.equal(choose(11, 5000, 300, cumulative), draws[5000:5300])  # across a block boundary
    assert not torch.equal(choose(12, 0, 300, cumulative), draws[:300])


def test_ranks_together_see_what_one_process_with_a_bigger_batch_sees() -> None:
    single = _stream(micro=6)
    ranks = [_stream(micro=3, rank=r, world=2) for r in range(2)]
    for _ in range(20):
        expected = single.next_batch()
        parts = [stream.next_batch() for stream in ranks]
        for key in expected:
            assert torch.equal(torch.cat([p[key] for p in parts]), expected[key])
    assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()


def test_rows_are_the_sources_packed_sequences() -> None:
    batch = _stream(micro=12).next_batch()
    sources = {0: _dataset(0, 100), 100: _dataset(100, 40), 200: _dataset(200, 7)}
    for row, first in enumerate(_ids(batch)):
        offset = 200 if first >= 200 else 100 if first >= 100 else 0
        alone = sources[offset].batch(torch.tensor([first - offset]))
        assert all(torch.equal(batch[key][row], alone[key][0]) for key in alone)


def test_each_source_sees_every_sequence_once_per_epoch_and_reshuffles() -> None:
    stream = _stream(micro=8)
    drawn = [i for _ in range(20) for i in _ids(stream.next_batch())]
    small = [i - 200 for i in drawn if i >= 200]
    assert len(small) >= 21  # three epochs of the small source while the big one is in its first
    epochs = [small[k : k + 7] for k in range(0, 21, 7)]
    assert all(sorted(epoch) == list(range(7)) for epoch in epochs)
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]
    big = [i for i in drawn if i < 100]
    assert len(big) == len(set(big)) < 100 and stream.epoch == 0
    state = stream.state_dict()
    assert state["draws"] == 160 and sum(v for k, v in state.items() if k.startswith("seen/")) == 160
    assert (
        source_epochs(state, {"big": 100, "mid": 40, "small": 7})["epoch/small"] == state["seen/small"] // 7
    )


@pytest.mark.parametrize("split_after", [1, 6, 13])
def test_resume_from_a_position_continues_identically(split_after: int) -> None:
    straight = _stream()
    expected = [straight.next_batch() for _ in range(25)]
    first = _stream()
    for _ in range(split_after):
        first.next_batch()
    resumed = _stream()
    resumed.load_state_dict(first.state_dict())
    for batch in expected[split_after:]:
        got = resumed.next_batch()
        assert all(torch.equal(got[key], batch[key]) for key in batch)


def test_proportions_of_a_run_follow_the_weights() -> None:
    stream = _stream(micro=50)
    for _ in range(100):
        stream.skip()
    state = stream.state_dict()
    for name, weight in (("big", 0.5), ("mid", 0.3), ("small", 0.2)):
        assert state[f"seen/{name}"] / 5000 == pytest.approx(
            weight, abs=4 * (weight * (1 - weight) / 5000) ** 0.5
        )


def test_a_mixture_round_trips_spec_yaml_as_a_tuple_of_frozen_entries(tmp_path) -> None:
    (tmp_path / "web.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "code.jsonl").write_text('{"text": "def f(): pass"}\n')
    sources = (
        f"data.sources=[{{path:{tmp_path}/web.jsonl,weight:0.7}},{{path:{tmp_path}/code.jsonl,name:py}}]"
    )
    cfg = compose.compose([sources])
    spec, errors = compose.validate(cfg)
    assert errors == [] and spec is not None
    assert isinstance(spec.data.sources, tuple) and spec.data.sources[0].weight == 0.7
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.data.sources[0].weight = 1.0  # type: ignore[misc]
    written = write_spec([sources], tmp_path / "run")  # train's own launch sequence: dump_spec
    assert load_spec(written).data == spec.data
    assert [(s.name, s.data.kind) for s in mixture.resolve(spec.data)] == [("web", "jsonl"), ("py", "jsonl")]


def test_each_source_is_cached_on_its_own_and_a_weight_change_reuses_it(tmp_path) -> None:
    from launcher.config.data import DataConfig, SourceConfig

    web = tmp_path / "web.jsonl"
    web.write_text("".join(json.dumps({"text": f"page {i} " * 20}) + "\n" for i in range(50)))
    base = DataConfig(seq_len=16, cache_dir=str(tmp_path / "cache"))
    entry = SourceConfig(path=str(web), weight=0.7)
    first = mixture.resolve(
        dataclasses.replace(base, sources=(entry, SourceConfig(path=str(web), name="b")))
    )[0]
    folder, built = build_cache(first.data, _bytes())
    assert built
    reweighted = dataclasses.replace(base, sources=(dataclasses.replace(entry, weight=0.1),))
    again, built_again = build_cache(mixture.resolve(reweighted)[0].data, _bytes())
    assert (again, built_again) == (folder, False)
    single = load_corpus(dataclasses.replace(base, kind="jsonl", path=str(web)), _bytes())
    mixed = load_corpus(first.data, _bytes())
    assert torch.equal(single.train.tokens, mixed.train.tokens)  # a source tokenizes as data.path would
    assert int(mixed.train.flags[0]) & START


def _bytes():  # noqa: ANN202
    from launcher.config.tokenizer import TokenizerConfig

    return TokenizerConfig()


def _errors(tmp_path: Path, *overrides: str) -> list[str]:
    found = compose.check_overrides(list(overrides))
    if found:
        return [str(e) for e in found]
    _, errors = compose.validate(compose.compose(list(overrides)))
    return [str(e) for e in errors]


def test_bad_mixtures_are_refused_naming_the_entry_key(tmp_path) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "hello there"}\n')
    a = f"{tmp_path}/a.jsonl"
    unknown = _errors(tmp_path, f"data.sources=[{{path:{a},wieght:2}}]")
    assert unknown[0].startswith("data.sources[0].wieght: unknown key. Did you mean weight?")
    assert "path, template, train_on, val_path, weight" in unknown[0]
    bad = _errors(tmp_path, f"data.sources=[{{path:{a},weight:0}},{{path:{tmp_path}/gone.jsonl,weight:inf}}]")
    assert any(e.startswith("data.sources[0].weight: must be a positive, finite number") for e in bad)
    assert any(e.startswith("data.sources[1].weight: must be a positive, finite") for e in bad)
    assert any(e.startswith("data.sources[1].path:") and "no file matches" in e for e in bad)
    both = _errors(
        tmp_path, f"data.sources=[{{path:{a}}}]", f"data.path={a}", f"data.val_path={a}", "data.packing=false"
    )
    assert any(e.startswith("data.sources, data.path: data.sources replaces data.path") for e in both)
    assert any(e.startswith("data.sources, data.val_path:") for e in both)
    assert any(e.startswith("data.sources, data.packing:") for e in both)
    same = _errors(tmp_path, f"data.sources=[{{path:{a}}},{{path:{a},format:chat}}]")
    assert any("two sources are named 'a'" in e for e in same)
    assert any(
        e.startswith("data.sources[1].path, data.sources[1].format, data.sources[1].field:") for e in same
    )


@pytest.mark.parametrize("wrap", ["workers", "thread"])
def test_loader_workers_and_the_batch_thread_hand_out_the_streams_batches_and_resume(wrap: str) -> None:
    plain = _stream(micro=4)
    ahead = (
        PrefetchedBatches(_stream(micro=4), num_workers=2, pin_memory=False)
        if wrap == "workers"
        else BackgroundBatches(_stream(micro=4), pin_memory=False)
    )
    for _ in range(12):
        expected, got = plain.next_batch(), ahead.next_batch()
        assert all(torch.equal(expected[key], got[key]) for key in expected)
    assert ahead.state_dict() == plain.state_dict()
    resumed = _stream(micro=4)
    resumed.load_state_dict(ahead.state_dict())
    assert _ids(resumed.next_batch()) == _ids(plain.next_batch())
    if wrap == "thread":
        ahead.close()


def test_a_spec_file_with_an_unknown_entry_key_names_it() -> None:
    from omegaconf import OmegaConf

    from launcher.spec import InvalidSpec, to_spec

    with pytest.raises(InvalidSpec) as caught:
        to_spec(
            OmegaConf.create({"data": {"sources": [{"path": "a.jsonl"}, {"path": "b.jsonl", "wieght": 2}]}})
        )
    assert [str(e).split(" Known")[0] for e in caught.value.errors] == [
        "data.sources[1].wieght: unknown key. Did you mean weight?"
    ]
