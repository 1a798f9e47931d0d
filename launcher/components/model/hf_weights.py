"""A Hugging Face folder's weights checked before launch, against the model its config.json builds.

safetensors files are judged by their headers alone (8 bytes of header length, then a JSON table
of every tensor's dtype, shape and byte range): a file shorter than its table says is truncated, a
byte range that does not hold its shape's bytes is corrupt, a dtype torch cannot read is named.
`pytorch_model.bin` files go through the same weights-only unpickler the load uses, memory-mapped
(`torch.load(weights_only=True, mmap=True)`): only the pickle is read, not the tensors, so the
check costs the same for 100 MB and 100 GB; a file in the pre-zip format cannot be memory-mapped
and is loaded whole when it holds at most BIN_FULL_LOAD_MAX_BYTES, else left to the rank.
The shapes are then compared with the parameters of the model built from config.json on the
meta device (no memory, no initialisation): what `from_pretrained` would refuse at load time
(a size mismatch), or fill with random values in silence (a parameter the files lack), is said
here, before any process starts.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

# safetensors' dtype names and their bytes per element (what torch can read back).
SAFETENSORS_DTYPES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
BIN_FULL_LOAD_MAX_BYTES = 1 << 30
"""A pre-zip-format .bin up to this size is loaded whole (weights only) before launch; larger ones are left to the rank."""
REFETCH = "Download or copy the folder again (an interrupted transfer leaves a short file)."

Shapes = dict[str, tuple[int, ...]]


class WeightsProblem(Exception):
    """A folder's weight file that cannot be loaded as it is; the message names the file and the fix."""


def weight_files(folder: Path) -> list[Path]:
    """The weight files a folder's model loads: the shards its index lists, or the single file."""
    for index_name, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        if (folder / single).is_file():
            return [folder / single]
        index = folder / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise WeightsProblem(
                    f"'{index}' is not a shard index (JSON with a weight_map): {err}. {REFETCH}"
                ) from None
            shards = [folder / name for name in sorted(set(weight_map.values()))]
            absent = [p.name for p in shards if not p.is_file()]
            if absent:
                raise WeightsProblem(
                    f"'{index}' lists shards the folder lacks: {', '.join(absent[:3])}. {REFETCH}"
                )
            return shards
    return []


def safetensors_shapes(path: Path) -> Shapes:
    """Every tensor's shape in a safetensors file, from its header; WeightsProblem when it cannot load."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or 8 + length > size:
            raise WeightsProblem(
                f"'{path}' is truncated: {size:,} bytes, shorter than its own header. {REFETCH}"
            )
        try:
            table = json.loads(f.read(length))
        except ValueError as err:
            raise WeightsProblem(f"'{path}' has no readable safetensors header ({err}). {REFETCH}") from None
    shapes: Shapes = {}
    data_bytes = size - 8 - length
    for name, entry in table.items():
        if name == "__metadata__":
            continue
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        if dtype not in SAFETENSORS_DTYPES:
            raise WeightsProblem(
                f"'{path}' stores {name} as {dtype}, a dtype torch cannot read. Convert the folder with a "
                f"tool that writes one of {', '.join(SAFETENSORS_DTYPES)} (e.g. F32, BF16)."
            )
        if end > data_bytes:
            raise WeightsProblem(
                f"'{path}' is truncated: its header places {name} up to byte {8 + length + end:,}, but the file "
                f"holds {size:,} bytes. {REFETCH}"
            )
        if end - begin != math.prod(shape) * SAFETENSORS_DTYPES[dtype]:
            raise WeightsProblem(
                f"'{path}' is corrupt: {name} ({dtype}, {list(shape)}) spans {end - begin} bytes."
            )
        shapes[name] = shape
    return shapes


def bin_shapes(path: Path) -> Shapes | None:
    """Every tensor's shape in a PyTorch .bin, through the weights-only unpickler; None when left to the rank."""
    import pickle

    import torch

    refused = (
        f"'{path}' is refused by weights-only loading, which is how the run reads it: it holds objects other than "
        "tensors, and unpickling them could run code. Convert it in a trusted environment to safetensors "
        "(`model.save_pretrained(DIR, safe_serialization=True)`), or use a folder with model.safetensors."
    )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        raise WeightsProblem(f"{refused} (torch: {_reason(err)})") from None
    except RuntimeError as err:
        if "mmap" not in str(err):  # not a zip archive torch can read: truncated or not a torch file
            raise WeightsProblem(f"'{path}' cannot be read ({str(err).split('. ')[0]}). {REFETCH}") from None
        if path.stat().st_size > BIN_FULL_LOAD_MAX_BYTES:
            return None  # the old format cannot be memory-mapped; the rank's own load checks it
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise WeightsProblem(f"{refused} (torch: {_reason(err)})") from None
    if not isinstance(state, dict):
        raise WeightsProblem(
            f"'{path}' holds a {type(state).__name__}, not a state dict of tensors. {REFETCH}"
        )
    return {name: tuple(t.shape) for name, t in state.items() if isinstance(t, torch.Tensor)}


def _reason(err: Exception) -> str:
    """The line of torch's weights-only refusal that says what it met (not its advice to turn the check off)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return (named or lines or ["unreadable pickle"])[0].rstrip(".")


def folder_shapes(folder: Path) -> Shapes | None:
    """Every tensor's shape across a folder's weight files; None when a .bin is left to the rank."""
    shapes: Shapes = {}
    for path in weight_files(folder):
        found = safetensors_shapes(path) if path.suffix == ".safetensors" else bin_shapes(path)
        if found is None:
            return None
        shapes.update(found)
    return shapes


def config_parameters(config: Any) -> tuple[Shapes, list[tuple[str, ...]], str]:
    """(shape per parameter name, the names of each parameter (tied ones share), the base-model prefix) of a meta build."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=torch.float32)
    model.tie_weights()
    names: dict[int, list[str]] = {}
    shapes: Shapes = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        shapes[name] = tuple(param.shape)
    return shapes, [tuple(group) for group in names.values()], getattr(model, "base_model_prefix", "")


def _layer_pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)


def shape_problems(config: Any, found: Shapes, folder: str) -> list[str]:
    """What the folder's weights and its config.json disagree on (size mismatches, parameters missing or extra).

    Per-expert tensors of a Mixture-of-Experts folder are compared as the fused tensors transformers loads them
    into (launcher.components.model.hf_experts); a conversion not read there leaves the check to the load.
    """
    from launcher.components.model.hf_experts import fused_shapes, num_experts

    if num_experts(config):
        converted = fused_shapes(found, config.model_type)
        if converted is None:
            return []
        found = converted
    expected, groups, prefix = config_parameters(config)
    found = {(name if name in expected or f"{prefix}.{name}" not in expected else f"{prefix}.{name}"): shape
             for name, shape in found.items()}  # fmt: skip
    problems = []
    mismatched = [f"{n} {list(found[n])} in the files, {list(s)} for config.json"
                  for n, s in expected.items() if n in found and found[n] != s]  # fmt: skip
    if mismatched:
        problems.append(
            f"the weights in '{folder}' do not fit the model its config.json describes ({len(mismatched)} tensors: "
            f"{'; '.join(mismatched[:3])}). Use the config.json saved with these weights."
        )
    missing = [group[0] for group in groups if not any(n in found for n in group)]
    if missing:
        problems.append(
            f"the weights in '{folder}' lack {len(missing)} parameters of the model its config.json describes "
            f"({', '.join(missing[:3])}); they would start from random values. Use the config.json saved with "
            "these weights, or the complete weight files."
        )
    layer_like = {_layer_pattern(n) for n in expected}
    extra = [n for n in found if n not in expected and _layer_pattern(n) in layer_like]
    if extra:
        problems.append(
            f"the weights in '{folder}' hold {len(extra)} tensors of layers its config.json does not describe "
            f"({', '.join(extra[:3])}). Use the config.json saved with these weights."
        )
    return problems


def folder_problems(folder: Path, config: Any) -> list[str]:
    """What keeps a folder's weights from loading into the model `config` builds: an unreadable weight file,
    or shapes, parameters missing or extra (quantized weights are packed: only their files are checked).
    The rule behind `train model.path=DIR` and `train-generate DIR` alike; raises nothing."""
    try:
        found = folder_shapes(Path(folder))
    except WeightsProblem as err:
        return [str(err)]
    if found is None or getattr(config, "quantization_config", None):
        return []
    try:
        problems = shape_problems(config, found, str(folder))
    except Exception as err:  # e.g. a family without a causal-LM head
        first = (str(err).splitlines() or [""])[0]
        problems = [f"'{folder}' does not build a causal language model ({type(err).__name__}: {first})"]
    return [problem[0].upper() + problem[1:] for problem in problems]
