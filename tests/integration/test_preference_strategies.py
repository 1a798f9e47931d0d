"""DPO on 2 real ranks equals one process: DDP with a frozen reference copy, ZeRO-3 with LoRA (the reference:
adapters off). Same global batch of pairs, fp32; each rank's pairs whole in its micro batches."""

from __future__ import annotations

import json
import math

import pytest
from data_assets import write_jsonl
from preference_assets import pair_records

from conftest import run_inline, run_ranks

COMMON = [
    "objective=dpo", "data=jsonl", "data.format=preference", "data.seq_len=32", "model=gpt_tiny",
    "train.max_steps=3", "train.log_every=1", "train.eval_every=null", "checkpoint.every=null",
    "optimizer.lr=3e-3", "scheduler.warmup_steps=1", "log.progress=false", "log.summary_table=false",
]  # fmt: skip
STRATEGIES = {
    "ddp-reference-copy": ["parallel=ddp"],
    "zero3-lora": ["parallel=zero3", "quantization=lora", "quantization.lora.dropout=0"],
}


def _steps(run_dir) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}


# ZeRO-3 with LoRA in the extended tier: DPO's two-rank parity is held by the DDP case, LoRA's parity under
# ZeRO-3 by test_lora_distributed.py's zero3 case, the adapters-off reference by test_preference_qlora_fsdp.py.
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.extended) if n == "zero3-lora" else n for n in STRATEGIES]
)
def test_dpo_on_two_ranks_matches_one_process(tmp_path, name: str) -> None:
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_records(48))
    args = [*COMMON, f"data.path={data}", *STRATEGIES[name][1:]]
    one_dir, two_dir = tmp_path / "one", tmp_path / "two"
    assert run_inline([*args, "train.micro_batch_size=4", f"run_dir={one_dir}"], one_dir) == 0
    proc = run_ranks(
        [*args, STRATEGIES[name][0], "launcher=local", "launcher.nproc=2", "train.micro_batch_size=2"],
        two_dir,
        nproc=2,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = _steps(one_dir), _steps(two_dir)
    assert one.keys() == two.keys() == {1, 2, 3}
    assert one[1]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # reference == initial policy
    for step in one:
        for key in ("loss", "rewards/margins", "logps/chosen"):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-6), (step, key)
    assert one[3]["loss"] < math.log(2)
