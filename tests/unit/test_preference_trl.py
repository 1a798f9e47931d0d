"""The preference losses and log-probs equal TRL's on the same tiny model, tokenizer and pairs (fp32, CPU).

DPO goes through TRL's own DPOTrainer (one pair per batch, so its logged means are that pair's
values); SimPO and ORPO through TRL's loss methods (CPOTrainer.cpo_loss,
ORPOTrainer.odds_ratio_loss and their get_batch_logps); KTO through TRL's KTOTrainer with two examples,
its KL rows (each prompt with the other example's completion) fed to ours. Skipped where trl is not installed (the
`test` extra has it).
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from launcher.components.objectives.preference import Preference, paired_losses, sequence_logps
from launcher.config.objective import ObjectiveConfig

trl = pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[test]')")

PAIR = {"prompt": "def add(a, b):", "chosen": " return a + b", "rejected": " return a - b"}
TOL = 1e-5


@pytest.fixture
def policy(hf_tokenizer):
    """A tiny Llama with seeded random weights and the tests' tokenizer (a fresh one per test: TRL's trainers
    patch the models they are given)."""
    from hf_assets import hf_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_tokenizer)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        hf_config("llama", vocab_size=len(tokenizer)), dtype=torch.float32
    )
    return model, tokenizer


def _ours(trl_batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TRL's rows (input_ids, completion_mask) as our batch: next-token labels, prompt, padding and the last -100.

    The rows keep their last token as input (its label -100), as TRL's forward does: the same shapes, the same sums.
    """
    ids = trl_batch["input_ids"]
    keep = trl_batch["completion_mask"][:, 1:].bool()
    labels = torch.where(keep, ids[:, 1:], torch.full_like(ids[:, 1:], -100))
    return {"input_ids": ids, "labels": torch.cat([labels, torch.full_like(labels[:, :1], -100)], dim=1)}


@pytest.fixture(autouse=True)
def _one_process(monkeypatch) -> None:
    """TRL's trainers (accelerate) read a launcher's rank variables: an inline run earlier in the session leaves them."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def _first_batch(trainer) -> dict[str, torch.Tensor]:
    return next(iter(trainer.get_train_dataloader()))


def test_dpo_matches_trl_trainer(policy, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    model, tokenizer = policy
    common = dict(per_device_train_batch_size=1, report_to=[], use_cpu=True, seed=0, beta=0.1)
    with torch.no_grad():  # move the policy off the reference so the rewards are not all zero
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    for p in reference.parameters():
        p.data.add_(0.01 * torch.randn_like(p))
    dpo = DPOTrainer(
        model=model, ref_model=reference, args=DPOConfig(output_dir=str(tmp_path / "dpo"), **common),
        train_dataset=Dataset.from_list([PAIR]), processing_class=tokenizer,
    )  # fmt: skip
    trl_batch = _first_batch(dpo)
    model.train()
    trl_loss = dpo.compute_loss(dpo.model, trl_batch)
    logged = {k: v[-1] for k, v in dpo._metrics["train"].items()}
    ours = Preference(
        ObjectiveConfig(name="dpo", beta=0.1),
        reference=lambda b: dpo.ref_model(input_ids=b["input_ids"]).logits,
    )
    batch = _ours(trl_batch)
    loss_sum, pairs = ours.loss_sum(dpo.model(input_ids=batch["input_ids"]).logits, batch)
    assert float(pairs) == 1.0
    assert abs(float(loss_sum) - float(trl_loss)) < TOL
    record = ours.metrics(lambda values: values)
    for key in ("logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected"):
        assert abs(record[key] - logged[key]) < TOL * max(1.0, abs(logged[key])), key


def test_kto_matches_trl_trainer(policy, tmp_path):
    """Two examples (one desirable), so TRL's KL rows pair each prompt with the other's completion, as ours do."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    model, tokenizer = policy
    reference = copy.deepcopy(model)
    torch.manual_seed(2)
    for p in reference.parameters():
        p.data.add_(0.01 * torch.randn_like(p))
    rows = [
        {"prompt": PAIR["prompt"], "completion": PAIR["chosen"], "label": True},
        {"prompt": "import os\n", "completion": "print(os.sep)", "label": False},
    ]
    args = KTOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[], use_cpu=True, beta=0.1
    )
    kto = KTOTrainer(
        model=model,
        ref_model=reference,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    trl_batch = _first_batch(kto)
    model.train()
    trl_loss = kto.compute_loss(kto.model, trl_batch)
    examples = _ours(trl_batch)
    kl_rows = _ours(
        {"input_ids": trl_batch["KL_input_ids"], "completion_mask": trl_batch["KL_completion_mask"]}
    )
    width = max(examples["input_ids"].shape[1], kl_rows["input_ids"].shape[1])

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    batch = {
        key: torch.cat([pad(examples[key], fill), pad(kl_rows[key], fill)])
        for key, fill in (("input_ids", 0), ("labels", -100))
    }
    batch["kto_label"] = trl_batch["label"].long()
    ours = Preference(
        ObjectiveConfig(name="kto", beta=0.1),
        reference=lambda b: kto.ref_model(input_ids=b["input_ids"]).logits,
    )
    loss_sum, examples_counted = ours.loss_sum(kto.model(input_ids=batch["input_ids"]).logits, batch)
    assert float(examples_counted) == 2.0
    assert abs(float(loss_sum) / 2 - float(trl_loss)) < TOL


def test_simpo_and_orpo_match_trl_losses(policy):
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    model, tokenizer = policy
    rows = [tokenizer(PAIR["prompt"] + PAIR[side])["input_ids"] for side in ("chosen", "rejected")]
    prompt_len = len(tokenizer(PAIR["prompt"])["input_ids"])
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    labels = ids.clone()
    labels[:, :prompt_len] = -100
    for i, row in enumerate(rows):
        labels[i, len(row) :] = -100
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    mean = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    ours_sum, counts = sequence_logps(logits[:, :-1], labels[:, 1:])
    assert torch.allclose(ours_sum / counts, mean, atol=TOL)
    device = SimpleNamespace(device=torch.device("cpu"))
    cpo = SimpleNamespace(
        beta=2.0, loss_type="simpo", simpo_gamma=0.5, label_smoothing=0.0, alpha=0.0, accelerator=device
    )
    trl_simpo, *_ = CPOTrainer.cpo_loss(cpo, mean[:1], mean[1:])
    simpo = ObjectiveConfig(name="simpo", beta=2.0, gamma=0.5)
    assert torch.allclose(paired_losses(simpo, ours_sum, counts, None)[0], trl_simpo, atol=TOL)
    orpo = SimpleNamespace(beta=0.1, accelerator=device)
    trl_ratio, *_ = ORPOTrainer.odds_ratio_loss(orpo, mean[:1], mean[1:])
    ours_orpo = paired_losses(ObjectiveConfig(name="orpo", beta=0.1), ours_sum, counts, None)[0]
    assert torch.allclose(
        ours_orpo, -mean[:1] - trl_ratio, atol=TOL
    )  # TRL: chosen NLL - beta * log sigmoid(odds)


def test_dpo_loss_is_ln2_with_the_reference_equal_to_the_policy():
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 11)
    labels = torch.randint(0, 11, (4, 6))
    labels[:, :2] = -100
    ours = Preference(ObjectiveConfig(name="dpo", beta=0.1), reference=lambda b: logits.clone())
    loss_sum, pairs = ours.loss_sum(logits, {"input_ids": labels.clamp(min=0), "labels": labels})
    assert float(loss_sum / pairs) == pytest.approx(math.log(2), abs=1e-7)
    assert ours.metrics(lambda values: values)["rewards/margins"] == 0.0
