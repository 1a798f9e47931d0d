"""One run end to end on a layout people have: ShareGPT records in a JSON array, read by data=jsonl, format=auto."""

from __future__ import annotations

import json
import math

from data_assets import sharegpt_records, write_json

from conftest import losses, run_inline


def test_sharegpt_json_array_trains_with_format_auto(hf_tokenizer, tmp_path) -> None:
    path = write_json(tmp_path / "sharegpt.json", sharegpt_records(120))
    args = [
        "model.n_layer=2", "model.d_model=64", "model.n_head=2", "data.seq_len=32", "data.val_fraction=0.1",
        "train.max_steps=4", "train.micro_batch_size=4", "train.log_every=1", "train.eval_batches=1",
        "scheduler.warmup_steps=1", "checkpoint.every=null", "log.progress=false", "log.summary_table=false",
        "data=jsonl", f"data.path={path}", "data.format=auto", "tokenizer=hf", f"tokenizer.path={hf_tokenizer}",
    ]  # fmt: skip
    assert run_inline(args, tmp_path / "run") == 0
    steps = losses(tmp_path / "run")
    assert sorted(steps) == [1, 2, 3, 4] and all(math.isfinite(v) for v in steps.values())
    assert "format: sharegpt" in (tmp_path / "run" / "spec.yaml").read_text()
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert 0 < record["trained_tokens_per_step"] < 4 * 32  # system and user turns are not trained
