"""The grpo and rloo losses equal TRL's on the same fixed rollouts (fp32, CPU), for every aggregation option.

TRL's own loss code runs: a real GRPOTrainer (RLOOTrainer) over a tiny Llama is built once, set to each
configuration as its constructor sets it (loss_type, beta, epsilon_low/high), and its `_compute_loss` is given
prepared rollouts (prompt and completion ids and masks, advantages, the
sampling policy's and the reference's per-token log-probs). Ours reads the same rows in our layout (prompt
+ completion left-aligned, the completion as labels) with the same model's logits. The prompts are of one
length, so TRL's left padding is none and both forwards see the same positions. Skipped where trl is not
installed (the `test` extra has it).
"""

from __future__ import annotations

import copy

import pytest
import torch

from launcher.components.objectives.policy_gradient import PolicyGradient, group_advantages, token_logps
from launcher.config.objective import ObjectiveConfig

trl = pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[test]')")

TOL = 1e-5
PROMPT, COMPLETION, ROWS = 5, 6, 4
TEMPERATURE = 0.7


@pytest.fixture(scope="module", autouse=True)
def _one_process():
    """TRL's trainers (accelerate) read a launcher's rank variables: an inline run earlier in the session leaves them.

    Module-scoped, so the variables are gone before the module-scoped trainers below are built."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            patch.delenv(name, raising=False)
        yield


@pytest.fixture(scope="module")
def tiny(hf_tokenizer):
    """A tiny Llama with seeded random weights, its tokenizer, and fixed rollouts of it."""
    from hf_assets import hf_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_tokenizer)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        hf_config("llama", vocab_size=len(tokenizer)), dtype=torch.float32
    )
    generator = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(5, 300, (ROWS, PROMPT), generator=generator)
    completion_ids = torch.randint(5, 300, (ROWS, COMPLETION), generator=generator)
    lengths = torch.tensor([6, 3, 5, 1])  # completions of several lengths: right padding in the mask
    completion_mask = (torch.arange(COMPLETION)[None] < lengths[:, None]).long()
    rewards = torch.tensor([[1.0, 0.0], [0.5, 2.0]])
    return model, tokenizer, prompt_ids, completion_ids, completion_mask, rewards, generator


def _ours(prompt_ids, completion_ids, completion_mask) -> dict[str, torch.Tensor]:
    """The rows in our layout: input_ids (prompt + completion, the last token dropped), labels on the completion."""
    full = torch.cat([prompt_ids, completion_ids], dim=1)
    labels = torch.full_like(full[:, 1:], -100)
    labels[:, PROMPT - 1 :] = torch.where(
        completion_mask.bool(), completion_ids, torch.full_like(completion_ids, -100)
    )
    return {"input_ids": full[:, :-1], "labels": labels}


def _spread(per_completion: torch.Tensor) -> torch.Tensor:
    """Completion-position values [rows, COMPLETION] placed at our label positions [rows, PROMPT + COMPLETION - 1]."""
    out = torch.zeros(ROWS, PROMPT + COMPLETION - 1)
    out[:, PROMPT - 1 :] = per_completion
    return out


def _trainer(kind: str, model, tokenizer, tmp_path, **options):
    """A real TRL trainer of `kind` (grpo or rloo) over a copy of `model`, as its training loop holds it."""
    from datasets import Dataset

    config_class, trainer_class = (
        (trl.GRPOConfig, trl.GRPOTrainer) if kind == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)
    )
    args = config_class(
        output_dir=str(tmp_path / kind), per_device_train_batch_size=ROWS, num_generations=2, report_to=[],
        use_cpu=True, bf16=False, seed=0, max_completion_length=COMPLETION, temperature=TEMPERATURE, **options,
    )  # fmt: skip
    trainer = trainer_class(
        model=copy.deepcopy(model), reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=Dataset.from_list([{"prompt": "a b c"}] * 4), processing_class=tokenizer,
    )  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop
    return trainer


@pytest.fixture(scope="module")
def grpo(tiny, tmp_path_factory):
    model, tokenizer = tiny[:2]
    return _trainer("grpo", model, tokenizer, tmp_path_factory.mktemp("trl"), num_iterations=2, beta=0.0)


@pytest.fixture(scope="module")
def rloo(tiny, tmp_path_factory):
    model, tokenizer = tiny[:2]
    return _trainer("rloo", model, tokenizer, tmp_path_factory.mktemp("trl"), num_iterations=2, beta=0.0)


def _configure(trainer, options: dict) -> None:
    """Set TRL's trainer to `options` as its constructor does from its config."""
    trainer.loss_type = options.get("loss_type", "dapo")
    trainer.beta = options.get("beta", 0.0)
    trainer.epsilon_low = options["epsilon"]
    trainer.epsilon_high = options.get("epsilon_high") or options["epsilon"]
    trainer._metrics["train"].clear()


def _fixed_logps(model, prompt_ids, completion_ids, completion_mask, generator):
    """(the policy's per-token log-probs of the completions, an 'old' policy's and a reference's: nearby values)."""
    batch = _ours(prompt_ids, completion_ids, completion_mask)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    current = token_logps(logits, batch["labels"], TEMPERATURE)[0][:, PROMPT - 1 :]
    old = current + 0.3 * torch.randn(current.shape, generator=generator)
    ref = current + 0.2 * torch.randn(current.shape, generator=generator)
    return old * completion_mask, ref * completion_mask


CASES = {
    "grpo": {"loss_type": "grpo"},
    "bnpo": {"loss_type": "bnpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "dapo": {"loss_type": "dapo"},
    "dapo-kl-clip_higher": {"loss_type": "dapo", "beta": 0.04, "epsilon_high": 0.28},
    "grpo-kl-no_scaling": {"loss_type": "grpo", "beta": 0.1, "scale_rewards": "none"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_grpo_loss_matches_trl(tiny, grpo, case: str) -> None:
    model, tokenizer, prompt_ids, completion_ids, mask, rewards, generator = tiny
    options = {"beta": 0.0, "epsilon": 0.2, "scale_rewards": "group", **CASES[case]}
    ours_model = copy.deepcopy(model)  # TRL patches the head of the model it trains
    old, ref = _fixed_logps(ours_model, prompt_ids, completion_ids, mask, generator)
    cfg = ObjectiveConfig(
        name="grpo", max_completion_length=COMPLETION, temperature=TEMPERATURE, num_iterations=2, **options
    )
    advantages = group_advantages(rewards, cfg).reshape(-1)
    trainer = grpo
    _configure(trainer, options)
    inputs = {
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
        "completion_mask": mask, "advantages": advantages, "old_per_token_logps": old,
        "ref_per_token_logps": ref, "num_items_in_batch": mask.sum(),
    }  # fmt: skip
    expected = trainer._compute_loss(trainer.model, inputs)
    batch = {
        **_ours(prompt_ids, completion_ids, mask), "advantages": advantages, "keep": torch.ones(ROWS),
        "old_logps": _spread(old), "ref_logps": _spread(ref),
    }  # fmt: skip
    objective = PolicyGradient(cfg)
    loss_sum, count = objective.loss_sum(ours_model(input_ids=batch["input_ids"]).logits, batch)
    assert float(count) == objective.count(batch)
    assert float(loss_sum / count) == pytest.approx(float(expected), abs=TOL, rel=TOL)
    logged = trainer._metrics["train"]
    metrics = objective.metrics(lambda values: values)
    assert metrics["entropy"] == pytest.approx(logged["entropy"][-1], abs=TOL)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(logged["clip_ratio/region_mean"][-1], abs=TOL)
    if options["beta"]:
        assert metrics["kl"] == pytest.approx(logged["kl"][-1], abs=TOL)


def test_group_advantages_match_trl_formulas(tiny) -> None:
    """grpo's (std-scaled or not) and rloo's leave-one-out advantages, as TRL's _generate_and_score_completions has them."""
    from trl.trainer.utils import nanstd

    rewards = tiny[5]
    mean = rewards.mean(1, keepdim=True)
    scaled = group_advantages(rewards, ObjectiveConfig(name="grpo"))
    assert torch.allclose(scaled, (rewards - mean) / (nanstd(rewards, dim=1)[:, None] + 1e-4))
    plain = group_advantages(rewards, ObjectiveConfig(name="grpo", scale_rewards="none"))
    assert torch.allclose(plain, rewards - mean)
    loo = group_advantages(rewards, ObjectiveConfig(name="rloo"))
    assert torch.allclose(loo, rewards - (rewards.sum(1, keepdim=True) - rewards) / (rewards.shape[1] - 1))


@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_rloo_loss_matches_trl(tiny, rloo, epsilon_high) -> None:
    model, tokenizer, prompt_ids, completion_ids, mask, rewards, generator = tiny
    ours_model = copy.deepcopy(model)
    old, _ = _fixed_logps(ours_model, prompt_ids, completion_ids, mask, generator)
    old = old * 0.05  # summed over a row the ratio stays near 1, some rows clipped
    options = {"epsilon": 0.2, "epsilon_high": epsilon_high} if epsilon_high else {"epsilon": 0.2}
    cfg = ObjectiveConfig(name="rloo", temperature=TEMPERATURE, num_iterations=2, **options)
    advantages = group_advantages(rewards, cfg).reshape(-1)
    trainer = rloo
    _configure(trainer, options)
    inputs = {
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
        "completion_mask": mask, "advantages": advantages, "old_logps": old.sum(1),
    }  # fmt: skip
    expected = trainer._compute_loss(trainer.model, inputs)
    batch = {
        **_ours(prompt_ids, completion_ids, mask), "advantages": advantages, "keep": torch.ones(ROWS),
        "old_logps": _spread(old),
    }  # fmt: skip
    loss_sum, count = PolicyGradient(cfg).loss_sum(ours_model(input_ids=batch["input_ids"]).logits, batch)
    assert float(loss_sum / count) == pytest.approx(float(expected), abs=TOL, rel=TOL)
