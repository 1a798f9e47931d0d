"""Preference data layouts, pair batches, the objective group's rules, and a single-process DPO run.

Each layout (strings, UltraFeedback message lists, ShareGPT conversations, kto) becomes one document
whose chosen and rejected sides come back whole in one batch, prompt tokens untrained; the rules
refuse what cannot run with the key and the fix; a tiny DPO run with a frozen reference copy starts
at ln 2 and logs the reward metrics.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from data_assets import write_jsonl
from preference_assets import kto_records, pair_records

from conftest import run_inline
from launcher.components.data import pairs as pair_format
from launcher.components.data.batching import PairDocuments
from launcher.components.data.pairs import REJECTED, UNDESIRABLE, encode_pair
from launcher.components.data.tokenizer import load_tokenizer
from launcher.components.data.tokens import START, TRAINED, TokenStore, load_corpus
from launcher.config.tokenizer import TokenizerConfig
from launcher.front.cli import precheck

BYTES = TokenizerConfig()
USER = {"role": "user", "content": "2+2?"}


def _store(*documents: tuple[list[int], list[int]]) -> TokenStore:
    tokens, flags = [], []
    for ids, bits in documents:
        tokens += ids
        flags += [bits[0] | START, *bits[1:]]
    return TokenStore(torch.tensor(tokens, dtype=torch.int32), torch.tensor(flags, dtype=torch.uint8))


def _trained_text(ids: list[int], flags: list[int]) -> str:
    return bytes(t for t, f in zip(ids, flags, strict=True) if f & TRAINED).decode()


@pytest.mark.parametrize(
    "record",
    [
        {"prompt": "2+2?", "chosen": " 4", "rejected": " 5"},
        {"prompt": "2+2?", "chosen": [USER, {"role": "assistant", "content": " 4"}],
         "rejected": [USER, {"role": "assistant", "content": " 5"}]},  # UltraFeedback-binarized
        {"prompt": [USER], "chosen": [{"role": "assistant", "content": " 4"}],
         "rejected": [{"role": "assistant", "content": " 5"}]},  # TRL's conversational layout
        {"conversations": [{"from": "human", "value": "2+2?"}], "chosen": {"from": "gpt", "value": " 4"},
         "rejected": {"from": "gpt", "value": " 5"}},  # ShareGPT / LLaMA-Factory
    ],
)  # fmt: skip
def test_each_preference_layout_is_one_document_with_both_sides(record: dict, hf_tokenizer) -> None:
    tok_cfg = (
        TokenizerConfig(kind="hf", path=str(hf_tokenizer))
        if not isinstance(record.get("chosen"), str)
        else BYTES
    )
    tokenizer = load_tokenizer(tok_cfg)
    ids, flags = encode_pair(record, "preference", tok_cfg, tokenizer, "r0")
    cut = [i for i, f in enumerate(flags) if f & REJECTED]
    assert len(cut) == 1
    if tok_cfg.kind == "hf":
        from transformers import AutoTokenizer

        decode = AutoTokenizer.from_pretrained(hf_tokenizer).decode
    else:
        decode = lambda ids: bytes(ids).decode()  # noqa: E731
    chosen = decode([t for t, f in zip(ids[: cut[0]], flags, strict=False) if f & TRAINED])
    rejected = decode([t for t, f in zip(ids[cut[0] :], flags[cut[0] :], strict=True) if f & TRAINED])
    assert "4" in chosen and "5" not in chosen and "5" in rejected and "2+2" not in chosen + rejected


def test_kto_label_and_bad_records() -> None:
    assert pair_format.TRAINED == TRAINED  # the cache keeps encode_record's flags as they are
    tokenizer = load_tokenizer(BYTES)
    ids, flags = encode_pair(
        {"prompt": "a", "completion": "b", "label": False}, "kto", BYTES, tokenizer, "r0"
    )
    assert flags[0] & UNDESIRABLE and _trained_text(ids, flags).rstrip("\x00") == "b"  # + the eos byte
    from launcher.components.data.sources import RecordError

    with pytest.raises(RecordError, match="'label' must be true or false"):
        encode_pair({"prompt": "a", "completion": "b", "label": "yes"}, "kto", BYTES, tokenizer, "r0")
    with pytest.raises(RecordError, match="prompt.*rejected.*strings or message lists"):
        encode_pair({"prompt": "a", "chosen": "b"}, "preference", BYTES, tokenizer, "r0")


def test_pairs_come_back_whole_chosen_rows_then_rejected_rows_truncated_together() -> None:
    tokenizer = load_tokenizer(BYTES)
    docs = [encode_pair(r, "preference", BYTES, tokenizer, "r") for r in pair_records(3)]
    pairs = PairDocuments(_store(*docs), seq_len=12, kto=False)
    assert len(pairs) == 3
    batch = pairs.batch(torch.tensor([2, 0]))
    assert batch["input_ids"].shape[0] == 4 and batch["input_ids"].shape[1] <= 12
    for row, (i, side) in enumerate([(2, 0), (0, 0), (2, 1), (0, 1)]):
        ids, flags = docs[i]
        start = next(k for k, f in enumerate(flags) if f & REJECTED) if side else 0
        assert batch["input_ids"][row, 0] == ids[start]  # each side starts with its prompt: cut from the end
    assert (batch["labels"][:, 0] == -100).all()  # prompt tokens are never trained
    kto = PairDocuments(_store(([1, 2, 3], [0, 1, 1]), ([4, 5], [UNDESIRABLE, 1])), seq_len=8, kto=True)
    kto_batch = kto.batch(torch.tensor([0, 1]))
    assert kto_batch["kto_label"].tolist() == [1, 0]
    full = torch.cat([kto_batch["input_ids"], kto_batch["labels"][:, -1:].clamp(min=0)], dim=1)
    assert full[2, :2].tolist() == [1, 5] and full[3, :3].tolist() == [
        4,
        2,
        3,
    ]  # KL rows: the previous completion


def _errors(*argv: str) -> dict[tuple[str, ...], str]:
    return {e.keys: e.message for e in precheck(list(argv))}


def test_rules_refuse_what_cannot_run_with_the_fix() -> None:
    data = ["data=jsonl", "data.path=pairs.jsonl"]
    errors = _errors("objective=dpo", *data, "data.format=chat", "objective.beta=0", "objective.loss=hinge")
    assert "data.format=preference" in errors[("objective.name", "data.format")]
    assert "positive" in errors[("objective.beta",)] and "sigmoid, ipo" in errors[("objective.loss",)]
    errors = _errors("objective=kto", *data, "data.format=kto", "data.packing=true")
    assert "data.packing=false" in errors[("objective.name", "data.packing")]
    errors = _errors("data.format=preference", *data)
    assert "objective=dpo" in errors[("objective.name", "data.format")]
    errors = _errors("objective=dpo", *data, "data.format=preference", "parallel=zero3")
    assert "LoRA" in errors[("objective.name", "parallel.strategy")]
    errors = _errors("objective=orpo", *data, "data.format=preference", "parallel=tp")
    assert "tensor parallelism" in errors[("objective.name", "parallel.tp_size")]
    errors = _errors("objective=dpo", *data, "data.format=preference", "parallel=ddp", "parallel.cp_size=2",
                     "launcher.nproc=2", "data.seq_len=64")  # fmt: skip
    assert "context parallel" in errors[("objective.name", "parallel.cp_size")]
    errors = _errors("objective=simpo", *data, "data.format=preference", "parallel=zero3")
    assert not [keys for keys in errors if "objective.name" in keys]  # no reference: DeepSpeed runs it


def test_dpo_run_with_a_frozen_reference_starts_at_ln2_logs_rewards_and_precomputes_alike(
    tmp_path, monkeypatch
) -> None:
    from launcher.rank import build

    loads = []  # the corpus a rank reads: once, though the precomputed reference reads its pairs first

    def counted(*args):
        loads.append(args)
        return load_corpus(*args)

    monkeypatch.setattr(build, "load_corpus", counted)
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_records(48))
    common = [
        "objective=dpo", "data=jsonl", "data.format=preference", f"data.path={data}", "data.seq_len=32",
        "model=gpt_tiny", "train.max_steps=3", "train.micro_batch_size=4", "train.log_every=1",
        "train.eval_every=3", "train.eval_batches=1", "optimizer.lr=3e-3", "scheduler.warmup_steps=1",
        "log.progress=false", "log.summary_table=false",
    ]  # fmt: skip
    records = {}
    for reference in ("model", "precompute"):
        run_dir = tmp_path / reference
        loads.clear()
        assert run_inline([*common, f"objective.reference={reference}", f"run_dir={run_dir}"], run_dir) == 0
        assert len(loads) == 1, reference
        records[reference] = [
            json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]
    steps = [r for r in records["model"] if "loss" in r]
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert {"rewards/chosen", "rewards/margins", "rewards/accuracy", "logps/rejected"} <= set(steps[0])
    assert steps[-1]["rewards/margins"] > 0 and steps[-1]["loss"] < math.log(2)
    assert any("eval_loss" in r and math.isfinite(r["eval_loss"]) for r in records["model"])
    once = [r for r in records["precompute"] if "loss" in r]  # computed once into the token cache, then read
    for a, b in zip(steps, once, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["rewards/margins"] == pytest.approx(a["rewards/margins"], abs=1e-4)
    from launcher.rank.objective import cache_file
    from launcher.spec import load_spec

    assert cache_file(load_spec(tmp_path / "precompute" / "spec.yaml")).is_file()


def _lora_run(tmp_path, name: str, reference: str, max_steps: int) -> list[dict]:
    """The logged steps of a LoRA run of objective `name` on gpt_tiny (24 pairs or kto examples)."""
    records = pair_records(24) if name == "dpo" else kto_records(24)
    data = write_jsonl(tmp_path / "data.jsonl", records)
    run_dir = tmp_path / "run"
    overrides = [
        f"objective={name}", f"objective.reference={reference}", "data=jsonl", f"data.path={data}",
        f"data.format={'preference' if name == 'dpo' else 'kto'}", "data.seq_len=32", "model=gpt_tiny",
        "quantization=lora", f"train.max_steps={max_steps}", "train.micro_batch_size=4", "train.log_every=1",
        "optimizer.lr=3e-3", "scheduler.warmup_steps=0", "log.progress=false", "log.summary_table=false",
        f"run_dir={run_dir}",
    ]  # fmt: skip
    assert run_inline(overrides, run_dir) == 0
    return [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line
    ]


def test_a_lora_run_precomputes_its_reference_with_the_adapters_off(tmp_path) -> None:
    """LoRA starts as the identity, so the base's precomputed log-probs equal the policy's: DPO starts at ln 2."""
    (step,) = _lora_run(tmp_path, "dpo", "precompute", max_steps=1)
    assert step["loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_a_lora_run_reads_its_base_with_the_adapters_off_each_step(tmp_path) -> None:
    """KTO against the base: 0.5 while the policy is its base, rewards away from 0 once the adapters trained."""
    first, second = _lora_run(tmp_path, "kto", "model", max_steps=2)
    assert first["loss"] == pytest.approx(0.5, abs=1e-6) and first["rewards/chosen"] == 0.0
    assert second["rewards/chosen"] != 0.0 and second["rewards/rejected"] != 0.0


@pytest.mark.parametrize(
    ("name", "reference", "lora_rank", "note", "each_step", "copy"),
    [
        ("dpo", "model", 0, "reference copy: ", True, True),
        ("dpo", "model", 8, "(the base, adapters off)", True, False),
        ("dpo", "precompute", 0, "(log-probs precomputed once)", False, False),
        ("kto", "model", 0, "reference copy: ", True, True),
        ("simpo", "model", 0, "(none needed)", False, False),
    ],
)
def test_the_plan_counts_the_reference_the_objective_declares(
    name, reference, lora_rank, note, each_step, copy
):
    """Beside the rows' float32 log-probs: the declared reference's logits each step, and a copy's weights."""
    import dataclasses

    from launcher.components.model.shape import model_shape
    from launcher.config.model import vocab_size
    from launcher.config.objective import ObjectiveConfig
    from launcher.plan.preference import preference_reference
    from launcher.spec import RunSpec

    spec = RunSpec()
    lora = dataclasses.replace(spec.quantization.lora, rank=lora_rank)
    spec = dataclasses.replace(
        spec,
        objective=ObjectiveConfig(name=name, reference=reference),
        quantization=dataclasses.replace(spec.quantization, lora=lora),
    )
    total, text = preference_reference(spec)
    rows = 2 * spec.train.micro_batch_size  # a pair (or a kto example and its KL row) is two rows
    cells = rows * spec.data.seq_len * vocab_size(spec.model)  # float32 under the default precision
    weights = 4 * model_shape(spec.model).num_params if copy else 0
    assert note in text and total == 4 * cells * (2 if each_step else 1) + weights


def test_the_advisor_speaks_on_stuck_rewards_and_on_falling_chosen_logps() -> None:
    from launcher.components.advice_rules import ChosenFalling, PreferenceStuck

    def stream(**series) -> list[dict]:
        return [{"step": i + 1, **{k: f(i) for k, f in series.items()}} for i in range(30)]

    def steps(rule, records) -> list[int]:
        return [r["step"] for r in records if rule.check(r)]

    stuck = stream(**{"rewards/accuracy": lambda i: 0.5, "rewards/margins": lambda i: 0.0})
    assert (
        steps(PreferenceStuck(), stuck)[0] == 11
    )  # the first record (the policy is its reference) is not counted
    learning = stream(
        **{"rewards/accuracy": lambda i: min(0.5 + 0.05 * i, 1.0), "rewards/margins": lambda i: 0.1 * i}
    )
    assert steps(PreferenceStuck(), learning) == []
    falling = stream(**{"logps/chosen": lambda i: -30.0 - 0.5 * i})
    assert steps(ChosenFalling(), falling)[0] == 8
    wobbling = stream(**{"logps/chosen": lambda i: -30.0 - 0.5 * (i % 3)})
    assert steps(ChosenFalling(), wobbling) == []


def test_too_few_pairs_for_one_step_are_refused_before_launch(tmp_path) -> None:
    from launcher.front import compose
    from launcher.front.data_sizes import size_errors

    data = write_jsonl(tmp_path / "pairs.jsonl", pair_records(20))
    args = [
        "objective=dpo",
        "data=jsonl",
        "data.format=preference",
        f"data.path={data}",
        "train.micro_batch_size=64",
    ]
    spec, errors = compose.validate(compose.compose(args))
    assert errors == []
    (error,) = size_errors(spec)
    # 16: the pairs the ranks keep (the tail split cuts the 17th short)
    assert "16 training pairs" in error.message and "packing=true" not in error.message
