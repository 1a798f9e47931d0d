"""The run-time advisor's rules on synthetic record streams: each fires on its problem, none on a calm run."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from launcher.components import advice_rules as rules
from launcher.components.advice import STATE_FILE, Advisor, batch_advice, precision_advice
from launcher.components.loggers.observers import RunContext

GiB = 1024**3


def record(step: int, **values) -> dict:
    """A training record shaped like the engine's, calm unless `values` say otherwise."""
    base = {
        "step": step,
        "loss": 5.0 - 0.01 * step + 0.005 * math.sin(step),
        "lr": 1e-3,
        "grad_norm": 0.8 + 0.02 * math.cos(step),
        "tokens_per_s": 1000.0,
        "mfu": None,
        "mem_peak_bytes": 2 * GiB,
        "loss_scale": None,
        "nonfinite_skips": 0,
        "overflow_skips": 0,
        "time_data_s": 0.01,
        "time_forward_s": 0.3,
        "time_backward_s": 0.5,
        "time_optimizer_s": 0.1,
    }
    return {**base, **values}


def calm(num: int = 40, **values) -> list[dict]:
    return [record(step, **values) for step in range(1, num + 1)]


def fired(rule, stream: list[dict]) -> list[tuple[int, str]]:
    """(step, message) of every record the rule speaks on."""
    return [(r["step"], msg) for r in stream if (msg := rule.check(r))]


def all_rules() -> list:
    return rules.record_rules(bf16_capable=True)


def test_no_rule_speaks_on_a_calm_run() -> None:
    for stream in (
        calm(),
        calm(mfu=0.45, mem_reserved_bytes=int(2.2 * GiB)),
        calm(loss_scale=65536.0),
    ):
        for rule in all_rules():
            assert fired(rule, stream) == [], rule.id


def test_data_wait_after_the_warm_up_interval() -> None:
    slow_first = [record(1, time_data_s=5.0), *calm()[1:]]
    assert fired(rules.DataWait(), slow_first) == []  # the first interval is warm-up
    hits = fired(rules.DataWait(), calm(time_data_s=0.2))  # 0.2 / 1.1 = 18%
    assert hits[0][0] == 1 + rules.DATA_WAIT_MIN_RECORDS
    assert "18% of step time" in hits[0][1] and "pre-tokenized" in hits[0][1]


@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_a_spike_names_its_step(key: str) -> None:
    stream = calm(30)
    stream[19] = {**stream[19], key: stream[19][key] * 4}
    (step, message), *_ = fired(rules.Spike(key), stream)
    assert step == 20 and "spiked at step 20" in message
    assert "optimizer.lr" in message and "train.max_grad_norm" in message and "precision=bf16" in message


def test_a_spike_needs_a_full_enough_window() -> None:
    stream = calm(30)
    stream[5] = {**stream[5], "grad_norm": 100.0}  # before SPIKE_MIN_RECORDS records: not judged
    assert fired(rules.Spike("grad_norm"), stream) == []
    stream[25] = {**stream[25], "grad_norm": math.inf}  # non-finite: the non-finite guard's business
    assert fired(rules.Spike("grad_norm"), stream) == []


def test_an_online_rl_surrogate_near_zero_is_no_loss_spike() -> None:
    stream = [record(s, loss=1e-7 * (s % 3), equal_groups=0.1) for s in range(1, 41)]
    stream[29] = {
        **stream[29],
        "loss": 1.5e-5,
    }  # hundreds of deviations of a curve that sits at 0 by construction
    assert fired(rules.Spike("loss"), stream) == []
    assert fired(rules.Spike("grad_norm"), [{**r, "grad_norm": 1.0} for r in stream]) == []


def test_a_falling_loss_is_no_spike() -> None:
    stream = [record(s, loss=6.0 * 0.9**s) for s in range(1, 41)]
    assert fired(rules.Spike("loss"), stream) == []


def test_fp16_loss_scale_collapse() -> None:
    stream = [record(s, loss_scale=65536.0 / 2 ** (s // 2)) for s in range(1, 41)]
    (step, message), *_ = fired(rules.LossScale(bf16_capable=True), stream)
    assert step == 20 and "precision=bf16" in message  # 2**10 below the highest scale
    below_one = fired(rules.LossScale(bf16_capable=False), calm(loss_scale=0.5))
    assert below_one and "lacks it" in below_one[0][1]


def test_fp16_overflow_skips_above_their_share() -> None:
    few = [record(s, loss_scale=1024.0, overflow_skips=4 + s // 40) for s in range(1, 81)]
    assert fired(rules.Overflows(bf16_capable=True), few) == []  # early skips find the scale: fine
    many = [record(s, loss_scale=1024.0, overflow_skips=s // 10) for s in range(1, 81)]
    (step, message), *_ = fired(rules.Overflows(bf16_capable=True), many)
    assert step > rules.OVERFLOW_MIN_STEPS and "fp16 overflow" in message


def test_low_mfu_after_warm_up() -> None:
    warm = [record(s, mfu=0.05 if s <= rules.MFU_WARMUP_RECORDS else 0.4) for s in range(1, 21)]
    assert fired(rules.LowMfu(), warm) == []
    (step, message), *_ = fired(rules.LowMfu(), calm(mfu=0.08))
    assert step == rules.MFU_WARMUP_RECORDS + rules.MFU_MIN_RECORDS and "compile" in message
    assert fired(rules.LowMfu(), calm(mfu=None)) == []  # a CPU: no peak, no judgement


def test_reserved_far_above_allocated() -> None:
    assert (
        fired(rules.ReservedMemory(), calm(mem_reserved_bytes=int(1.2 * GiB), mem_peak_bytes=GiB // 2)) == []
    )
    hits = fired(rules.ReservedMemory(), calm(mem_reserved_bytes=6 * GiB))
    assert hits and "expandable_segments:True" in hits[0][1] and "memory.cuda_alloc_conf" in hits[0][1]


def test_precision_advice_at_start() -> None:
    assert [i for i, _ in precision_advice("fp32", "cuda", bf16_capable=True)] == ["fp32_on_bf16_gpu"]
    assert precision_advice("fp32", "cuda", bf16_capable=False) == []
    assert precision_advice("bf16", "cuda", bf16_capable=True) == []
    ((rule_id, message),) = precision_advice("bf16", "cpu", bf16_capable=True)
    assert rule_id == "bf16_on_cpu" and "tokens/s in fp32" in message
    assert precision_advice("fp32", "cpu", bf16_capable=True) == []


def test_batch_change_without_lr_change() -> None:
    same = {"global_batch": 16, "lr": 1e-3}
    assert batch_advice(same, global_batch=16, lr=1e-3, optimizer="adamw") is None
    assert batch_advice(same, global_batch=64, lr=4e-3, optimizer="adamw") is None  # scaled by hand
    assert batch_advice(None, global_batch=64, lr=1e-3, optimizer="adamw") is None
    adam = batch_advice(same, global_batch=64, lr=1e-3, optimizer="adamw")
    assert "from 16 to 64" in adam and "square-root" in adam and "optimizer.lr=0.002" in adam
    sgd = batch_advice(same, global_batch=64, lr=1e-3, optimizer="sgd")
    assert "linear" in sgd and "optimizer.lr=0.004" in sgd


def _context(run_dir: Path, **kw) -> tuple[RunContext, io.StringIO]:
    out = io.StringIO()
    values = {"device_type": "cpu", "start_step": 0, "session": 0, "world_size": 1, "max_steps": 100, **kw}
    return RunContext(run_dir=run_dir, console=Console(file=out, width=200), **values), out


def _advisor(context: RunContext, **kw) -> Advisor:
    values = {"precision": "fp32", "global_batch": 16, "lr": 1e-3, "optimizer": "adamw", **kw}
    return Advisor(context, **values)


def test_the_advisor_prints_once_and_lists_in_the_summary(tmp_path: Path) -> None:
    context, out = _context(tmp_path)
    advisor = _advisor(context, precision="bf16")
    for r in calm(30, time_data_s=0.5):
        advisor.on_record(r)
    advisor.on_record({"step": 30, "eval_loss": 99.0})
    summary: dict = {}
    advisor.on_finish(summary)
    assert [(a["id"], a["step"]) for a in summary["advice"]] == [("bf16_on_cpu", 0), ("data_wait", 3)]
    assert out.getvalue().count("advice: data_wait (step 3)") == 1
    assert "train.advice=false" in out.getvalue()


def test_a_resumed_session_compares_its_batch_with_the_previous_one(tmp_path: Path) -> None:
    _advisor(_context(tmp_path)[0])
    assert json.loads((tmp_path / STATE_FILE).read_text()) == {"global_batch": 16, "lr": 1e-3}
    context, out = _context(tmp_path, session=1, start_step=50)
    summary: dict = {}
    _advisor(context, global_batch=32).on_finish(summary)
    assert [(a["id"], a["step"]) for a in summary["advice"]] == [("lr_not_scaled", 50)]
    again: dict = {}  # the next session keeps the new batch: nothing to say
    _advisor(_context(tmp_path, session=2, start_step=80)[0], global_batch=32).on_finish(again)
    assert again["advice"] == []


def test_disabled_advice_says_nothing_but_remembers_the_batch(tmp_path: Path) -> None:
    context, out = _context(tmp_path)
    advisor = _advisor(context, precision="bf16", enabled=False)
    for r in calm(30, time_data_s=0.5):
        advisor.on_record(r)
    summary: dict = {}
    advisor.on_finish(summary)
    assert out.getvalue() == "" and "advice" not in summary
    assert (tmp_path / STATE_FILE).is_file()


def test_router_collapse_names_the_block_after_consecutive_records() -> None:
    rule = rules.record_rules(bf16_capable=True, moe_load_ceiling=4.0)[-1]  # 8 experts, top-2
    loads = [1.6, 3.7, 3.9, 2.0, 3.6, 4.0, 4.0, 4.0]  # block 1; block 0 stays balanced
    stream = [record(step, **{"moe_load/0": 1.8, "moe_load/1": v}) for step, v in enumerate(loads, start=1)]
    ((step, message),) = fired(rule, stream)[:1]
    assert step == 7 and rule.id == "router_collapse"  # 3.6 is 90%: records 5, 6, 7
    assert "block 1 (100% of the tokens" in message and "block 0" not in message
    for fix in ("model.moe.aux_loss_coef", "model.moe.bias_update_rate", "optimizer.lr"):
        assert fix in message


def test_router_collapse_needs_moe_blocks_with_a_choice() -> None:
    stream = [record(step, **{"moe_load/0": 2.0}) for step in range(1, 10)]  # 2 experts, top-1, collapsed
    assert fired(rules.record_rules(bf16_capable=True)[-1], stream) == []  # dense model: no ceiling given
    assert fired(rules.record_rules(bf16_capable=True, moe_load_ceiling=1.0)[-1], stream) == []  # top_k = E
    steps = [s for s, _ in fired(rules.record_rules(bf16_capable=True, moe_load_ceiling=2.0)[-1], stream)]
    assert steps[:1] == [3]
