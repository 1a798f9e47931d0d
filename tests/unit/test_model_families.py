"""The model-family seam: every FAMILIES entry offers every Family verb, built models find their family, the
family's tensor-parallel plan and stage cut name modules its model has, and no code outside the family
modules and rules/ asks which model family it holds."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

import launcher
from launcher.components.model import family_gpt
from launcher.components.model.family import Family, decoder_layers, family, family_of
from launcher.config.model import FAMILIES, ModelConfig

PACKAGE = Path(launcher.__file__).parent
FAMILY_CHECK = re.compile(r'kind [!=]= "hf"|isinstance\([^)]*(HFCausalLM|GPT)\b')
TINY_GPT = ModelConfig(n_layer=2, d_model=32, n_head=2, vocab_size=64, max_seq_len=16)


def _verbs() -> list[str]:
    return [name for name, _ in inspect.getmembers(Family, inspect.isfunction) if not name.startswith("_")]


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_every_family_offers_every_verb(kind: str) -> None:
    module = family(ModelConfig(kind=kind))
    missing = [verb for verb in _verbs() if not callable(getattr(module, verb, None))]
    assert not missing, f"{FAMILIES[kind]} lacks {missing}"


def test_an_unknown_kind_names_the_families() -> None:
    with pytest.raises(ValueError, match="model.kind='llama' is not a model family: use one of gpt, hf"):
        family(ModelConfig(kind="llama"))
    with pytest.raises(ValueError, match="names no model family"):
        family_of(torch.nn.Linear(2, 2))
    assert decoder_layers(torch.nn.Linear(2, 2)) is None


def test_a_built_gpt_finds_its_family_and_its_plan_names_its_modules() -> None:
    torch.manual_seed(0)
    model = family(TINY_GPT).build(TINY_GPT)
    assert family_of(model) is family_gpt
    layers = decoder_layers(model)
    assert layers is model.blocks
    for sequence_parallel in (False, True):
        plan = family_of(model).tp_plan(model, sequence_parallel=sequence_parallel)
        for path in plan.layer:
            layers[0].get_submodule(path)
        for path in (plan.head, plan.embedding, *plan.top):
            model.get_submodule(path)
    assert family_of(model).ep_plan(model) is None


def test_a_stage_keeps_its_layers_under_their_whole_model_names() -> None:
    torch.manual_seed(0)
    model = family(TINY_GPT).build(TINY_GPT)
    whole = set(model.state_dict())
    last = family_of(model).stage(model, range(1, 2), first=False, last=True)
    keys = set(last.state_dict())
    assert keys <= whole and any(k.startswith("blocks.1.") for k in keys)
    assert not any(k.startswith(("blocks.0.", "tok_emb.")) for k in keys)
    assert family(TINY_GPT).tied_names(TINY_GPT) == ("tok_emb.weight", "lm_head.weight")


def test_only_family_modules_and_rules_ask_which_family_they_hold() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name.startswith("rules/"):
            continue
        if name.startswith("components/model/family"):
            continue
        found += [
            f"{name}:{i}"
            for i, line in enumerate(path.read_text().splitlines(), 1)
            if FAMILY_CHECK.search(line)
        ]
    assert not found, f"family checks outside the family modules: {found}"
