"""Rules of Hugging Face models (`model.kind=hf`), checked before anything starts, without building one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from launcher.components.model.hf_experts import MOE_FAMILIES, num_experts, router_aux_coef
from launcher.components.model.hf_files import (
    NO_REMOTE_CODE,
    PRESETS,
    WEIGHT_FILES,
    custom_code_problem,
    has_weights,
    hf_config,
    is_preset,
    read_local_config,
)
from launcher.components.model.hf_weights import WeightsProblem, folder_shapes, shape_problems
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, installed, missing
from launcher.spec import RunSpec, SpecError


def _hf_model(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    m = spec.model
    if m.kind != "hf":
        for key in ("hf_config", "path"):
            if getattr(m, key) is not None:
                yield SpecError(
                    (f"model.{key}", "model.kind"),
                    f"model.{key} is read only for model.kind=hf, but model.kind={m.kind}. Use a Hugging Face "
                    f"model option (e.g. `model=hf model.path=DIR`), or drop model.{key}.",
                )
        return
    yield from missing(
        "transformers",
        ("model.kind",),
        "model.kind=hf needs transformers, which is not installed. Install it with "
        "`pip install -e '.[hf]'` (or `pip install transformers`).",
    )
    if m.path is not None:
        if m.hf_config is not None:
            yield SpecError(
                ("model.path", "model.hf_config"),
                f"model.path ({m.path}: start from its weights) and model.hf_config ({m.hf_config}: random "
                "weights) both name the model. Keep model.path to fine-tune, or set model.path=null.",
            )
        folder_errors = list(_pretrained_folder(m.path))
        yield from folder_errors
        yield from _local_config(spec, m.path, "model.path")
        if not folder_errors and not custom_code_problem(m.path):  # _local_config names the code it needs
            family = _known_family(m.path, "model.path") or _experts(m.path, "model.path")
            yield from family or [
                *_weights(spec, m.path),
                *_attention_path(spec),
                *_router_loss(spec, m.path),
            ]
        return
    if m.hf_config is None:
        yield SpecError(
            ("model.path", "model.hf_config"),
            f"model.kind=hf needs model.path (a local Hugging Face model folder to fine-tune) or model.hf_config "
            f"(a preset: {', '.join(PRESETS)}, or a folder's config.json, random weights), e.g. "
            "`model=hf model.path=/models/my-llama`.",
        )
        return
    if not is_preset(m.hf_config):
        if not (Path(m.hf_config) / "config.json").is_file():
            yield SpecError(
                ("model.hf_config",),
                f"'{m.hf_config}' is neither a preset ({', '.join(PRESETS)}) nor a directory with a config.json. "
                "Nothing is downloaded: give a local model directory, or a preset.",
            )
            return
        yield from _local_config(spec, m.hf_config, "model.hf_config")
        family = _known_family(m.hf_config, "model.hf_config") or _experts(m.hf_config, "model.hf_config")
        yield from family or [*_attention_path(spec), *_router_loss(spec, m.hf_config)]
        return
    yield from _attention_path(spec)


def _pretrained_folder(path: str) -> Iterator[SpecError]:
    folder = Path(path)
    missing = [name for name in ("config.json",) if not (folder / name).is_file()]
    if not folder.is_dir():
        yield SpecError(
            ("model.path",),
            f"'{path}' is not a directory. model.path takes a local Hugging Face model folder (config.json and "
            "model.safetensors, as `save_pretrained` writes it); nothing is downloaded.",
        )
    elif missing or not has_weights(path):
        what = "config.json" if missing else f"weights ({', '.join(WEIGHT_FILES)})"
        yield SpecError(
            ("model.path",),
            f"'{path}' holds no {what}. model.path takes a folder as `save_pretrained` writes it (config.json and "
            "model.safetensors, or sharded files with their index); for random weights of a config use "
            "model.hf_config instead.",
        )


def _local_config(spec: RunSpec, path: str, key: str) -> Iterator[SpecError]:
    if not (Path(path) / "config.json").is_file():
        return
    try:
        config = read_local_config(path)
    except ValueError as err:
        yield SpecError((key,), f"'{path}/config.json' is not valid JSON ({err}).")
        return
    problem = custom_code_problem(path)
    if problem:
        yield SpecError((key,), f"{Path(path) / 'config.json'} was refused: {problem}. {NO_REMOTE_CODE}")
        return
    positions = config.get("max_position_embeddings", config.get("n_positions"))
    if isinstance(positions, int) and spec.data.seq_len > positions:
        yield SpecError(
            ("data.seq_len", key),
            f"sequences of {spec.data.seq_len} tokens exceed the context of the model in '{path}' "
            f"({positions} positions). Lower data.seq_len to {positions} or less.",
        )


def _known_family(path: str, key: str) -> list[SpecError]:
    """An error when config.json names a model family transformers does not hold (custom code is never run)."""
    if not installed("transformers"):
        return []  # said above
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    try:
        config = read_local_config(path)
    except ValueError:
        return []  # _local_config says so
    family = config.get("model_type")
    if family in CONFIG_MAPPING_NAMES:
        return []
    code = (
        " Its auto_map points at the folder's own Python code, which is never run."
        if "auto_map" in config
        else ""
    )
    return [
        SpecError(
            (key,),
            f"'{path}/config.json' names model_type {family!r}, a family this transformers release does not "
            f"hold.{code} Use a folder of a family transformers ships (llama, qwen2, mistral, gpt2, ...), or "
            "convert the model to one, or upgrade transformers if the family is newer than it.",
        )
    ]


def _weights(spec: RunSpec, path: str) -> Iterator[SpecError]:
    """Each weight file readable and every tensor's shape that of the model config.json builds."""
    try:
        found = folder_shapes(Path(path))
    except WeightsProblem as err:
        yield SpecError(("model.path",), str(err))
        return
    try:
        quantized = "quantization_config" in read_local_config(path)
    except ValueError:
        return  # _local_config says so
    if found is None or quantized:
        return  # quantized weights are packed: their shapes are not the model's
    try:
        problems = shape_problems(hf_config(spec.model), found, path)
    except Exception as err:  # e.g. a family without a causal-LM head; the rules never raise
        first = (str(err).splitlines() or [""])[0]
        problems = [f"'{path}' does not build a causal language model ({type(err).__name__}: {first})"]
    for problem in problems:
        yield SpecError(("model.path",), problem[0].upper() + problem[1:])


def _experts(path: str, key: str) -> list[SpecError]:
    """An error when config.json describes a Mixture-of-Experts family the launcher does not train (MOE_FAMILIES)."""
    try:
        config = read_local_config(path)
    except ValueError:
        return []  # _local_config says so
    experts, family = num_experts(config), config.get("model_type")
    if not experts or family in MOE_FAMILIES:
        return []
    return [
        SpecError(
            (key,),
            f"'{path}/config.json' describes a Mixture-of-Experts model (model_type {family!r}, {experts} experts), "
            f"a family whose expert layers the launcher does not load and train yet; it does for "
            f"{', '.join(sorted(MOE_FAMILIES))}. It is not the folder that is wrong: use one of those families, or a "
            "dense one (llama, qwen2, qwen3, mistral, gemma2, ...).",
        )
    ]


def _router_loss(spec: RunSpec, path: str) -> list[SpecError]:
    """The router's load-balancing loss needs the whole model's forward, which pipeline stages do not run."""
    try:
        config = read_local_config(path)
    except ValueError:
        return []  # _local_config says so
    if not (num_experts(config) and router_aux_coef(config)) or spec.parallel.pp_size == 1:
        return []
    return [
        SpecError(
            ("parallel.pp_size", "model.path"),
            f"'{path}/config.json' turns on the router's load-balancing loss (output_router_logits, "
            f"router_aux_loss_coef={router_aux_coef(config)}), which is collected over the whole model's forward; "
            f"pipeline stages (parallel.pp_size={spec.parallel.pp_size}) each run a part of it, so the loss would "
            "be left out. Set output_router_logits to false in config.json, or train without pipeline stages "
            "(e.g. `parallel=fsdp`).",
        )
    ]


def _attention_path(spec: RunSpec) -> Iterator[SpecError]:
    """model.attention=varlen or flex only where that path computes what transformers computes for the family."""
    choice = spec.model.attention
    if choice not in ("varlen", "flex"):
        return  # auto steps around what a family lacks; sdpa is transformers' own masks
    from launcher.components.model.hf_family import family_attention

    try:
        family = family_attention(hf_config(spec.model))
    except Exception:  # noqa: BLE001 - an unreadable config is reported by the rules above
        return
    problem = family.varlen_problem if choice == "varlen" else None
    if choice == "flex" and not family.flex:
        problem = f"transformers has no FlexAttention for {family.model_type}"
    if problem:
        yield SpecError(
            ("model.attention", "model.path", "model.hf_config"),
            f"model.attention={choice}: {problem}, so packed documents would not attend as transformers "
            f"computes them. Use model.attention=auto (it takes a path that reproduces the family) or "
            "model.attention=sdpa (transformers' own masks, sliding windows and softcaps included).",
        )


RULES: tuple[Rule, ...] = (_hf_model,)
"""This module's rules, in the order they report."""
