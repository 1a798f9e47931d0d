"""Rules of Hugging Face models (`model.kind=hf`), checked before anything starts, without building one."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

from launcher.groups.model.hf import PRESETS, is_preset, read_local_config
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError


def _hf_model(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    m = spec.model
    if m.kind != "hf":
        if m.hf_config is not None:
            yield SpecError(
                ("model.hf_config", "model.kind"),
                f"model.hf_config is read only for model.kind=hf, but model.kind={m.kind}. Use a Hugging Face "
                "model option (e.g. `model=hf_llama_tiny`), or drop model.hf_config.",
            )
        return
    if importlib.util.find_spec("transformers") is None:
        yield SpecError(
            ("model.kind",),
            "model.kind=hf needs transformers, which is not installed. Install it with "
            "`pip install -e '.[hf]'` (or `pip install transformers`).",
        )
    if m.hf_config is None:
        yield SpecError(
            ("model.hf_config",),
            f"model.kind=hf needs model.hf_config: a preset ({', '.join(PRESETS)}) or a local directory "
            "holding config.json, e.g. `model=hf_llama_tiny`.",
        )
        return
    if not is_preset(m.hf_config):
        yield from _local_config(spec)


def _local_config(spec: RunSpec) -> Iterator[SpecError]:
    path = spec.model.hf_config
    if not (Path(path) / "config.json").is_file():
        yield SpecError(
            ("model.hf_config",),
            f"'{path}' is neither a preset ({', '.join(PRESETS)}) nor a directory with a config.json. "
            "Nothing is downloaded: give a local model directory, or a preset.",
        )
        return
    config = read_local_config(path)
    positions = config.get("max_position_embeddings", config.get("n_positions"))
    if isinstance(positions, int) and spec.data.seq_len > positions:
        yield SpecError(
            ("data.seq_len", "model.hf_config"),
            f"sequences of {spec.data.seq_len} tokens exceed the context of the model in '{path}' "
            f"({positions} positions). Lower data.seq_len to {positions} or less.",
        )


RULES: tuple[Rule, ...] = (_hf_model,)
"""This module's rules, in the order they report."""
