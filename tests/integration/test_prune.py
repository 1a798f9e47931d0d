"""Gradual magnitude and 2:4 pruning through the real loop: the schedule, masks that hold through
AdamW steps, exact resume with mask updates in both halves, and an export that keeps the zeros."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, losses, run_inline, run_ranks
from launcher.components.metrics import read_metrics
from launcher.components.model.build import build_model
from launcher.components.prune import sparsity_at
from launcher.config.prune import MASK
from launcher.spec import load_spec
from launcher.tools import export

# Updates after steps 5, 8, 11 and 14 (every 3 from step 2; 14 is end_step): two in each half of a
# run stopped at step 10, then six steps on the final masks.
MAGNITUDE = [
    *TINY, "prune=magnitude", "prune.target_sparsity=0.75", "prune.start_step=2", "prune.end_step=14",
    "prune.every=3", "optimizer.weight_decay=0.1",
]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, object]:
    """One 20-step pruned run straight, the same stopped at step 10 and resumed, and a 2:4 run."""
    root = tmp_path_factory.mktemp("prune")
    straight, split, semi = root / "straight", root / "split", root / "semi"
    assert run_inline(MAGNITUDE, straight) == 0
    assert run_inline([*MAGNITUDE, "train.stop_after=10"], split) == 0
    assert run_inline([*MAGNITUDE, "resume=auto"], split) == 0
    semi_args = ["prune=semi_2_4", "prune.start_step=0", "prune.end_step=8", "prune.every=4"]
    assert run_inline([*TINY, *semi_args, "train.max_steps=10", "train.eval_every=null"], semi) == 0
    return {"straight": straight, "split": split, "semi": semi}


def _model_state(run_dir, step: int) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / f"step_{step}" / "model.pt", weights_only=True)


def _pruned(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Layer name -> (weight, mask) for every pruned layer of a checkpoint."""
    suffix = f".{MASK}"
    return {
        k[: -len(suffix)]: (state[k[: -len(suffix)] + ".weight"], v)
        for k, v in state.items()
        if k.endswith(suffix)
    }


def test_sparsity_follows_the_cubic_schedule_to_the_target(runs) -> None:
    spec = load_spec(runs["straight"] / "spec.yaml")
    records = [r for r in read_metrics(runs["straight"] / "metrics.jsonl") if "sparsity" in r]
    assert len(records) == 20
    layers = _pruned(_model_state(runs["straight"], 20))
    assert len(layers) == 2 * 6  # q, k, v, o, up, down of 2 blocks: no embedding, head or norm
    total = sum(w.numel() for w, _ in layers.values())
    for record in records:  # global scope: exactly round(s x total) zeros, s from the schedule
        assert abs(record["sparsity"] - sparsity_at(spec.prune, record["step"])) <= 1 / total + 1e-6, record
        assert {f"sparsity/{name}" for name in layers} <= record.keys()
    assert [r["sparsity"] for r in records if r["step"] <= 2] == [0.0, 0.0]
    assert records[-1]["sparsity"] == pytest.approx(0.75, abs=1e-5)


def test_pruned_weights_stay_zero_through_adamw_steps(runs) -> None:
    at_10, at_20 = _pruned(_model_state(runs["straight"], 10)), _pruned(_model_state(runs["straight"], 20))
    for name, (weight, mask) in at_20.items():
        assert torch.equal(weight == 0, mask == 0), name  # zero exactly where the mask prunes
        # what was pruned at step 10 is still exactly zero ten AdamW steps (weight decay 0.1) later
        assert not weight[at_10[name][1] == 0].any(), name
    state = _model_state(runs["straight"], 20)
    assert (state["tok_emb.weight"] != 0).all()  # embeddings (and the head tied to them) are never pruned


def test_resume_with_mask_updates_in_both_halves_is_bitwise_exact(runs) -> None:
    assert losses(runs["split"]) == losses(runs["straight"])
    straight, split = _model_state(runs["straight"], 20), _model_state(runs["split"], 20)
    assert straight.keys() == split.keys()
    assert all(torch.equal(straight[k], split[k]) for k in straight)


def test_2_4_keeps_two_of_every_four_weights(runs) -> None:
    records = [r for r in read_metrics(runs["semi"] / "metrics.jsonl") if "sparsity" in r]
    assert records[-1]["sparsity"] == 0.5
    for name, (weight, mask) in _pruned(_model_state(runs["semi"], 10)).items():
        groups = (weight != 0).reshape(-1, 4).sum(dim=1)  # along the input dimension
        assert (groups == 2).all(), name
        assert torch.equal(weight == 0, mask == 0), name
        kept = weight.abs().reshape(-1, 4)  # the 2 kept are the 2 largest magnitudes of their group
        assert (kept.topk(2, dim=1).values > 0).all()


def test_export_makes_the_pruning_permanent(runs, tmp_path) -> None:
    out = tmp_path / "model.pt"
    assert export.main([str(runs["straight"]), str(out)]) == 0
    state = torch.load(out, weights_only=True)
    assert not any(key.endswith(MASK) for key in state)  # no mask left: plain weights with zeros
    spec = load_spec(runs["straight"] / "spec.yaml")
    build_model(spec.model).load_state_dict(state)  # strict: exactly the plain model's keys
    pruned = _pruned(_model_state(runs["straight"], 20))
    for name, (weight, _) in pruned.items():
        assert torch.equal(state[f"{name}.weight"], weight), name  # the checkpoint's zeros, bit for bit
    zeros = sum(int((state[f"{name}.weight"] == 0).sum()) for name in pruned)
    assert zeros == round(0.75 * sum(weight.numel() for weight, _ in pruned.values()))


def test_ddp_two_ranks_prune_as_one_process(runs, tmp_path) -> None:
    """Two gloo ranks (micro batch 2 each) make the mask updates after steps 5, 8 and 11 as one process does."""
    ddp = tmp_path / "ddp"
    args = [*MAGNITUDE, "parallel=ddp", "train.micro_batch_size=2", "train.stop_after=12"]
    result = run_ranks(args, ddp)
    assert result.returncode == 0, result.stderr[-2000:]
    one, two = losses(runs["straight"]), losses(ddp)
    assert two.keys() == set(range(1, 13))
    for step in two:  # fp32 parity: the all-reduce sums in another order
        assert two[step] == pytest.approx(one[step], abs=1e-4), step
    records = {r["step"]: r for r in read_metrics(ddp / "metrics.jsonl") if "sparsity" in r}
    straight = {r["step"]: r for r in read_metrics(runs["straight"] / "metrics.jsonl") if "sparsity" in r}
    for step in records:  # global magnitude scope: the same count of zeros after every update
        assert records[step]["sparsity"] == pytest.approx(straight[step]["sparsity"], abs=1e-6), step
    for name, (weight, mask) in _pruned(_model_state(ddp, 10)).items():
        assert torch.equal(weight == 0, mask == 0), name  # the checkpoint rank 0 wrote holds the masks
