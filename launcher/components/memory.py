"""The memory group: techniques that trade compute or bandwidth for memory, applied to a built model.

`apply` is a pure function of (model, MemoryConfig): it checkpoints activations of the built-in
GPT's blocks (or of their attention only) with torch.utils.checkpoint, non-reentrant, by replacing
the forward of each chosen module instance. `selective` checkpoints the same blocks with an op-level
policy (torch.utils.checkpoint.create_selective_checkpoint_contexts): the outputs of matmuls (all, or
every other one) and of attention are saved, everything else (norms, activations, casts, adds) is
recomputed in backward. Module names and state-dict keys stay as they are, so
tensor-parallel plans, FSDP per-block sharding and checkpoints see the same model. Activation
offload moves tensors saved for the backward pass to CPU memory between forward and backward.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from launcher.config.memory import CUDA_ALLOC_ENV, CUDA_ALLOC_KEYS, MemoryConfig

if TYPE_CHECKING:  # torch only where a rank builds the model: the launching process never needs it
    import torch
    from torch import nn


def _alloc_value_ok(key: str, value: str) -> bool:
    """Whether `value` has the form PyTorch's allocator takes for `key`."""
    if key in ("expandable_segments", "pinned_use_cuda_host_register"):
        return value in ("True", "False")
    if key in ("max_split_size_mb", "pinned_num_register_threads"):
        return value.isdigit()
    if key == "garbage_collection_threshold":
        try:
            return 0.0 < float(value) < 1.0
        except ValueError:
            return False
    if key == "roundup_power2_divisions":
        return value.isdigit() or (value.startswith("[") and value.endswith("]") and ":" in value)
    return value in ("native", "cudaMallocAsync")


def _alloc_entries(text: str) -> list[str]:
    """The comma-separated entries of an allocator config; commas inside [...] lists stay in their entry."""
    entries, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            entries.append(current)
            current = ""
        else:
            current += char
    return [*entries, current]


def apply_cuda_alloc_conf(conf: str) -> None:
    """Give PyTorch's CUDA allocator `conf`: through the environment, read when CUDA initialises, and at
    once where CUDA is up already (an inline rank, in the process that probed the GPU before launch)."""
    os.environ.update(dict.fromkeys(CUDA_ALLOC_ENV, conf))
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        # torch >= 2.9 names it in torch._C; older releases only have the torch.cuda.memory spelling.
        apply = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        (apply or torch.cuda.memory._set_allocator_settings)(conf)


def alloc_conf_problems(text: str) -> list[str]:
    """What is wrong with a PYTORCH_CUDA_ALLOC_CONF string (comma-separated key:value), one line each."""
    problems = []
    for entry in _alloc_entries(text):
        key, sep, value = (part.strip() for part in entry.partition(":"))
        if not sep or not key or not value:
            problems.append(f"'{entry}' is not key:value")
        elif key not in CUDA_ALLOC_KEYS:
            problems.append(f"unknown allocator key '{key}' (known: {', '.join(CUDA_ALLOC_KEYS)})")
        elif not _alloc_value_ok(key, value):
            problems.append(f"{key} must be {CUDA_ALLOC_KEYS[key]}, got '{value}'")
    return problems


def _op_sets() -> tuple[set, set]:
    """(matmul ops, attention ops) of torch's dispatcher, as the selective policy sees them."""
    import torch

    aten = torch.ops.aten
    matmuls = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
    names = (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable",
    )  # fmt: skip
    attention = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    return matmuls, attention | ({flex} if flex is not None else set())


def selective_context_fn(save_matmuls: str) -> Callable[[], object]:
    """A checkpoint `context_fn` saving attention and the matmuls `save_matmuls` names (all, every_other)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    matmuls, attention = _op_sets()

    def context_fn() -> object:
        counts = {False: 0, True: 0}  # matmuls seen in forward and in recomputation, counted alike

        def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
            if op in attention:
                return CheckpointPolicy.MUST_SAVE
            if op in matmuls:
                counts[ctx.is_recompute] += 1
                if save_matmuls == "all" or counts[ctx.is_recompute] % 2 == 1:
                    return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def checkpoint_kwargs(cfg: MemoryConfig) -> dict:
    """Keyword arguments of torch.utils.checkpoint.checkpoint for the checkpointing `cfg` asks for."""
    kwargs: dict = {"use_reentrant": False}
    if cfg.activation_checkpointing == "selective":
        kwargs["context_fn"] = selective_context_fn(cfg.selective_matmuls)
    return kwargs


def checkpointed_modules(model: nn.Module, cfg: MemoryConfig) -> list[nn.Module]:
    """The modules whose activations `cfg` recomputes: decoder layers (the GPT's blocks) or their attention."""
    if cfg.activation_checkpointing == "none":
        return []
    from launcher.components.model.family import decoder_layers

    chosen = [block for i, block in enumerate(decoder_layers(model) or []) if i % cfg.checkpoint_every == 0]
    return [block.attn for block in chosen] if cfg.activation_checkpointing == "attention" else chosen


def _checkpoint_forward(module: nn.Module, options: dict) -> None:
    """Make `module` recompute its forward (or, selective, part of it) in backward instead of saving it."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    @functools.wraps(forward)
    def recomputed(*args: object, **kwargs: object) -> object:
        return checkpoint(forward, *args, **options, **kwargs)

    module.forward = recomputed


def apply_checkpointing(model: nn.Module, cfg: MemoryConfig) -> nn.Module:
    """Checkpoint the activations `cfg` asks for, in place; returns the model.

    A family with its own switch (a Hugging Face model; rules refuse `attention` for it) turns it on;
    otherwise the launcher wraps the decoder layers (or their attention) itself.
    """
    if cfg.activation_checkpointing == "none":
        return model
    from launcher.components.model.family import decoder_layers, family_of

    if family_of(model).checkpointing(model, cfg.checkpoint_every, checkpoint_kwargs(cfg)):
        return model
    if decoder_layers(model) is None:
        raise ValueError(
            f"memory.activation_checkpointing={cfg.activation_checkpointing}: {type(model).__name__} has no "
            "decoder layers and its family no checkpointing switch."
        )
    for module in checkpointed_modules(model, cfg):
        _checkpoint_forward(module, checkpoint_kwargs(cfg))
    return model


def apply_offload(model: nn.Module, cfg: MemoryConfig) -> nn.Module:
    """Move tensors saved for backward to CPU during the model's forward (pinned memory on CUDA)."""
    if not cfg.offload_activations:
        return model
    import torch

    active: list[torch.autograd.graph.save_on_cpu] = []

    def enter(module: nn.Module, args: object) -> None:
        if torch.is_grad_enabled():
            on_cuda = any(p.is_cuda for p in module.parameters())
            active.append(torch.autograd.graph.save_on_cpu(pin_memory=on_cuda))
            active[-1].__enter__()

    def leave(module: nn.Module, args: object, output: object) -> None:
        if active:
            active.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)  # also when forward raises (e.g. OOM)
    return model


def apply(model: nn.Module, cfg: MemoryConfig) -> nn.Module:
    """Apply the memory techniques of `cfg` to a built model (before compile and the strategy)."""
    return apply_offload(apply_checkpointing(model, cfg), cfg)


def empty_cache_hook(cfg: MemoryConfig, device_type: str) -> Callable[[int], None] | None:
    """A per-step hook that empties the CUDA caching allocator every N steps; None where it does nothing.

    On CPU there is no caching allocator to empty (freed memory goes back to the C allocator), so
    `memory.empty_cache_steps` is accepted and does nothing there.
    """
    every = cfg.empty_cache_steps
    if not every or device_type != "cuda":
        return None
    import torch

    def hook(step: int) -> None:
        if step % every == 0:
            torch.cuda.empty_cache()

    return hook
