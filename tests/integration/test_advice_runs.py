"""The run-time advisor end to end: real runs whose advice is printed once in a box and listed in summary.json."""

from __future__ import annotations

import json

from conftest import TINY, run_inline

# SGD whose warmup walks the learning rate past the model's stability limit near step 8: a calm
# start, then the loss and gradient norm take off (a real spike, not a synthetic record).
SPIKING = [
    *TINY,
    "train.max_steps=10",
    "train.eval_every=null",
    "checkpoint.every=null",
    "checkpoint.save_final=false",
    "optimizer=sgd",
    "optimizer.momentum=0",
    "optimizer.lr=2.4",
    "scheduler=constant",
    "scheduler.warmup_steps=9",
    "train.max_grad_norm=null",
    "precision=bf16",
]


def test_advice_is_printed_once_and_listed_in_the_summary(tmp_path, capsys) -> None:
    assert run_inline(SPIKING, tmp_path / "run") == 0
    out = capsys.readouterr().out
    advice = json.loads((tmp_path / "run" / "summary.json").read_text())["advice"]
    ids = [a["id"] for a in advice]
    assert ids[0] == "bf16_on_cpu" and advice[0]["step"] == 0
    assert "tokens/s in fp32" in advice[0]["message"]
    spikes = [a for a in advice if a["id"] in ("loss_spike", "grad_norm_spike")]
    assert spikes and all(a["step"] > 8 for a in spikes)  # after the window's first 8 records
    assert f"spiked at step {spikes[0]['step']}" in spikes[0]["message"]
    assert len(ids) == len(set(ids))
    for a in advice:
        assert out.count(f"advice: {a['id']} (step {a['step']})") == 1  # the box's title, once


def test_train_advice_false_silences_it(tmp_path, capsys) -> None:
    args = [*TINY, "train.max_steps=3", "train.eval_every=null", "checkpoint.every=null", "precision=bf16"]
    assert run_inline([*args, "checkpoint.save_final=false", "train.advice=false"], tmp_path / "run") == 0
    assert "advice:" not in capsys.readouterr().out
    assert "advice" not in json.loads((tmp_path / "run" / "summary.json").read_text())


def test_a_resumed_run_whose_batch_grew_is_told_to_scale_its_lr(tmp_path, capsys) -> None:
    run_dir, base = tmp_path / "run", [*TINY, "train.eval_every=null", "checkpoint.every=null"]
    assert run_inline([*base, "train.max_steps=3"], run_dir) == 0
    assert json.loads((run_dir / "summary.json").read_text())["advice"] == []
    resumed = [*base, "train.max_steps=4", "resume=auto", "train.grad_accum_steps=2"]  # 4 -> 8 sequences
    assert run_inline(resumed, run_dir) == 0
    (advice,) = json.loads((run_dir / "summary.json").read_text())["advice"]
    assert advice["id"] == "lr_not_scaled" and advice["step"] == 3
    assert "from 4 to 8" in advice["message"] and "square-root rule" in advice["message"]
    assert "optimizer.lr=0.00141" in advice["message"]  # 1e-3 x sqrt(2), for AdamW
    assert capsys.readouterr().out.count("advice: lr_not_scaled (step 3)") == 1


# A 2-block MoE GPT (8 experts, top-2): without any balancing its routers send every token to the same two
# experts within 7 steps; with the preset's balancing (auxiliary losses, loss-free bias) they do not.
MOE = [
    *TINY, "model=gpt_moe_tiny", "model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.moe.d_ff=64",
    "train.max_steps=10", "train.eval_every=null", "checkpoint.every=null", "checkpoint.save_final=false",
]  # fmt: skip
UNBALANCED = ["model.moe.aux_loss_coef=0", "model.moe.z_loss_coef=0", "model.moe.bias_update_rate=0"]


def test_a_collapsing_router_is_named_and_a_balanced_one_is_not(tmp_path, capsys) -> None:
    assert run_inline([*MOE, *UNBALANCED], tmp_path / "collapsed") == 0
    advice = json.loads((tmp_path / "collapsed" / "summary.json").read_text())["advice"]
    (collapse,) = [a for a in advice if a["id"] == "router_collapse"]
    assert "MoE block" in collapse["message"] and "model.moe.bias_update_rate" in collapse["message"]
    assert f"advice: router_collapse (step {collapse['step']})" in capsys.readouterr().out
    assert run_inline(MOE, tmp_path / "balanced") == 0
    advice = json.loads((tmp_path / "balanced" / "summary.json").read_text())["advice"]
    assert "router_collapse" not in [a["id"] for a in advice]
