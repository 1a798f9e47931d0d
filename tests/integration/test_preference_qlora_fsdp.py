"""DPO with QLoRA under FSDP2 on 2 real ranks (the reference: the base, adapters off): it learns a
learnable preference set, resumes bitwise, and `train-export --merge` writes the merged model.

One run of 4 steps with checkpoints at 2 and 4, then a copy of it resumed from step 2: its steps 3
and 4 must repeat the first run's losses and rewards exactly. About 40 s on 2 idle cores.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest

from conftest import run_ranks
from launcher.tools import export

pytest.importorskip("torchao")

from data_assets import write_jsonl  # noqa: E402
from preference_assets import pair_records, wide_llama  # noqa: E402

RUN = [
    "objective=dpo", "data=jsonl", "data.format=preference", "quantization=nf4_lora",
    "quantization.lora.dropout=0", "parallel=fsdp", "launcher=local", "launcher.nproc=2", "train.max_steps=4",
    "train.micro_batch_size=2", "data.seq_len=32", "train.eval_every=null", "checkpoint.every=2",
    "optimizer.lr=3e-3", "scheduler.warmup_steps=1", "train.log_every=1", "log.progress=false",
    "log.summary_table=false",
]  # fmt: skip


def _records(run_dir) -> dict[tuple[int, int], dict]:
    """(session, step) -> the step's logged record."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {(r["session"], r["step"]): r for r in map(json.loads, lines) if "loss" in r}


@pytest.mark.slow
def test_dpo_qlora_fsdp2_learns_resumes_bitwise_and_exports(tmp_path, hf_tokenizer) -> None:
    folder = wide_llama(tmp_path / "llama", hf_tokenizer)
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_records(64))
    run_dir = tmp_path / "run"
    args = ["model=hf", f"model.path={folder}", f"data.path={data}", *RUN]
    proc = run_ranks(args, run_dir, nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = _records(run_dir)
    assert sorted(first) == [(0, 1), (0, 2), (0, 3), (0, 4)]
    assert first[(0, 1)]["loss"] == pytest.approx(
        math.log(2), abs=1e-6
    )  # the reference is the initial policy
    assert first[(0, 1)]["rewards/margins"] == 0.0
    assert first[(0, 4)]["rewards/accuracy"] > 0.5 and first[(0, 4)]["rewards/margins"] > 0

    resumed = tmp_path / "resumed"  # the same run, stopped after step 2
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_4")
    (resumed / "checkpoints" / "latest").write_text("step_2")
    proc = run_ranks([*args, "resume=auto"], resumed, nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    again = _records(resumed)
    for step in (3, 4):
        for key in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen"):
            assert again[(1, step)][key] == first[(0, step)][key], (step, key)

    out = tmp_path / "export"
    assert export.main([str(run_dir), str(out), "--format", "hf", "--merge"]) == 0
    assert (out / "config.json").is_file() and any(out.glob("*.safetensors"))
