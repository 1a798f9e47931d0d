"""Training on real text: every record format on one process and on 2 ranks, exact resume with streaming and loader workers."""

from __future__ import annotations

import json

import pytest
from data_assets import alpaca_records, chat_records, text_records, write_json, write_jsonl, write_parquet

from conftest import losses, run_cli, run_inline, run_ranks
from launcher.components.data.tokenizer import load_tokenizer
from launcher.config.tokenizer import TokenizerConfig

SMALL = [
    "model.n_layer=2", "model.d_model=64", "model.n_head=2", "data.seq_len=32", "data.val_fraction=0.1",
    "train.max_steps=6", "train.log_every=1", "train.eval_batches=1", "scheduler.warmup_steps=1",
    "checkpoint.every=null", "log.progress=false", "log.summary_table=false",
]  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, hf_tokenizer):
    """One file per format, in the public layouts (parquet, alpaca JSON, messages JSONL, token ids)."""
    folder = tmp_path_factory.mktemp("formats")
    write_parquet(folder / "text.parquet", text_records(200))
    write_json(folder / "alpaca.json", alpaca_records(200))
    write_jsonl(folder / "chat.jsonl", chat_records(200))
    tok = load_tokenizer(TokenizerConfig(kind="hf", path=str(hf_tokenizer)))
    ids = []
    for record in alpaca_records(200):
        prompt = tok.tok(record["instruction"], add_special_tokens=False)["input_ids"]
        answer = tok.tok(" " + record["output"], add_special_tokens=False)["input_ids"] + [tok.eos_id]
        ids.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    write_jsonl(folder / "ids.jsonl", ids)
    return folder


FORMATS = {  # format -> a file in its public layout
    "text": "text.parquet",
    "instruction": "alpaca.json",
    "chat": "chat.jsonl",
    "pretokenized": "ids.jsonl",
}


def _args(data_dir, hf_tokenizer, fmt: str) -> list[str]:
    return [
        *SMALL, "data=files", f"data.path={data_dir / FORMATS[fmt]}", f"data.format={fmt}",
        "tokenizer=hf", f"tokenizer.path={hf_tokenizer}",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def one_process(data_dir, hf_tokenizer, tmp_path_factory):
    """format -> run directory of a one-process run with micro batch 4 (made on first use)."""
    runs = {}

    def run(fmt: str):
        if fmt not in runs:
            runs[fmt] = tmp_path_factory.mktemp(f"one-{fmt}")
            assert (
                run_inline([*_args(data_dir, hf_tokenizer, fmt), "train.micro_batch_size=4"], runs[fmt]) == 0
            )
        return runs[fmt]

    return run


# Each format once on 2 ranks, the strategies alternating: DDP and FSDP2 each get a format whose prompts are
# masked (chat, instruction) and so a different count of trained tokens on each rank (4 launches, not 8).
FORMAT_STRATEGY = [("text", "ddp"), ("instruction", "fsdp"), ("chat", "ddp"), ("pretokenized", "fsdp")]
# text and pretokenized in the extended tier: every token trained, the same count on each rank, which the
# masked formats' uneven counts include; their one-process training is test_text_data.py's and the default job's.
UNMASKED = ("text", "pretokenized")


@pytest.mark.parametrize(
    ("fmt", "strategy"),
    [pytest.param(f, s, marks=pytest.mark.extended) if f in UNMASKED else (f, s) for f, s in FORMAT_STRATEGY],
)
def test_every_format_trains_alike_on_one_process_and_two_ranks(
    fmt, strategy, data_dir, hf_tokenizer, one_process, tmp_path
) -> None:
    """2 ranks x 2 sequences match 1 process x 4: the loss is the mean over every trained token of a step."""
    one_dir = one_process(fmt)
    args = [*_args(data_dir, hf_tokenizer, fmt), "train.micro_batch_size=2", f"parallel={strategy}"]
    result = run_ranks(args, tmp_path / "two")
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = losses(one_dir), losses(tmp_path / "two")
    assert len(one) == 6 and one.keys() == two.keys()
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=2e-5), (step, one, two)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["world_size"] == 2
    record = json.loads((one_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert 0 < record["trained_tokens_per_step"] < 4 * 32  # prompts and document starts are not counted


def test_a_hugging_face_model_trains_on_the_tokenizer_it_is_sized_for(
    data_dir, hf_tokenizer, tmp_path
) -> None:
    args = [*_args(data_dir, hf_tokenizer, "instruction"), "model=hf_llama_tiny", "train.micro_batch_size=4"]
    assert run_inline(args, tmp_path / "run") == 0
    steps = losses(tmp_path / "run")
    assert steps[6] < steps[1]
    assert "vocab_size: 448" in (tmp_path / "run" / "spec.yaml").read_text()


def test_a_bad_record_leaves_the_last_checkpoint_untouched(hf_tokenizer, tmp_path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", text_records(1500))
    run_dir = tmp_path / "run"
    args = [*SMALL, "data=jsonl", f"data.path={path}", "checkpoint.every=3", f"run_dir={run_dir}"]
    assert run_cli(args, tmp_path).returncode == 0
    before = {p.name: p.read_bytes() for p in (run_dir / "checkpoints" / "step_6").iterdir()}
    records = text_records(1500)
    records[1400] = {"body": "no text field"}
    write_jsonl(path, records)
    again = run_cli([*args, "resume=auto", "train.max_steps=9"], tmp_path)
    assert again.returncode == 2, again.stderr
    assert (
        "docs.jsonl:1401: field 'text' is missing" in again.stderr and "no rank was started" in again.stderr
    )
    after = {p.name: p.read_bytes() for p in (run_dir / "checkpoints" / "step_6").iterdir()}
    assert after == before and (run_dir / "checkpoints" / "latest").read_text().strip() == "step_6"


def test_streaming_with_loader_workers_resumes_bitwise_across_an_epoch(
    data_dir, hf_tokenizer, tmp_path
) -> None:
    args = [
        *_args(data_dir, hf_tokenizer, "chat"), "data.streaming=true", "data.num_workers=2",
        "train.micro_batch_size=8", "train.max_steps=16", "train.eval_every=null", "verify_resume=true",
        "data.max_bytes=3000",
        f"run_dir={tmp_path / 'check'}",
    ]  # fmt: skip
    result = run_cli(args, tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "all 16 per-step losses are bitwise equal. PASS" in " ".join(result.stdout.split())
    epochs = [
        r.get("epoch") for r in map(json.loads, (tmp_path / "check" / "straight" / "metrics.jsonl").open())
    ]
    assert max(e for e in epochs if e is not None) >= 1  # the run crossed an epoch boundary
