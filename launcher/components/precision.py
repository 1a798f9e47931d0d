"""The precision group: autocast dtype, stored dtype (pure bf16), loss scaling for fp16, TF32, eval precision."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from launcher.config.precision import PrecisionConfig

if TYPE_CHECKING:  # torch only where a rank trains: the launching process never needs it
    import torch


def train_dtype(cfg: PrecisionConfig) -> torch.dtype:
    """The autocast dtype of training steps (float32 means no autocast)."""
    import torch

    if cfg.bf16:
        return torch.bfloat16
    if cfg.fp16:
        return torch.float16
    return torch.float32


def eval_dtype(cfg: PrecisionConfig) -> torch.dtype:
    """The autocast dtype of evaluation, which may differ from training's."""
    import torch

    return getattr(torch, cfg.eval_dtype) if cfg.eval_dtype else train_dtype(cfg)


def stored_dtype(cfg: PrecisionConfig) -> torch.dtype:
    """The dtype weights, gradients and optimizer state are stored in (precision.param_dtype)."""
    import torch

    return torch.bfloat16 if cfg.param_dtype == "bf16" else torch.float32


def cast_parameters(model: torch.nn.Module, cfg: PrecisionConfig) -> torch.nn.Module:
    """With precision.param_dtype=bf16: the model's floating-point parameters stored in bf16, before any wrap.

    Buffers keep their dtype (rotary tables, masks): autocast casts what meets a bf16 weight, as it
    does for the fp32-master run, so only the stored weights (and with them gradients and optimizer
    state, created like the weights) differ between the two.
    """
    dtype = stored_dtype(cfg)
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


@contextlib.contextmanager
def cast_weights(model: torch.nn.Module, dtype: torch.dtype, enabled: bool) -> Iterator[None]:
    """With precision.eval_cast: the model's parameters replaced by copies in `dtype` while the block runs.

    The parameter objects stay (the optimizer and DDP hold them); only their `.data` points at the cast
    copy, and afterwards at the very tensor it pointed at before, so training weights never pass through
    the eval dtype (fp32 -> bf16 -> fp32 would lose 16 bits of every weight).
    """
    if not enabled:
        yield
        return
    kept = [(p, p.data) for p in model.parameters() if p.is_floating_point() and p.dtype != dtype]
    try:
        for param, data in kept:
            param.data = data.to(dtype)
        yield
    finally:
        for param, data in kept:
            param.data = data


@contextlib.contextmanager
def autocast(dtype: torch.dtype, device_type: str) -> Iterator[None]:
    """Autocast to `dtype` on `device_type`, or nothing at all for float32."""
    import torch

    if dtype == torch.float32:
        yield
        return
    with torch.autocast(device_type=device_type, dtype=dtype):
        yield


def make_grad_scaler(cfg: PrecisionConfig, device_type: str) -> torch.amp.GradScaler | None:
    """A dynamic loss scaler for fp16 (which overflows without one); None otherwise."""
    if not cfg.fp16:
        return None
    import torch

    return torch.amp.GradScaler(
        device_type,
        init_scale=cfg.loss_scale_init,
        growth_interval=cfg.loss_scale_growth_interval,
    )


def fp8_linear(module: torch.nn.Module, fqn: str) -> bool:
    """Whether a layer becomes a float8 layer: a linear whose dims are multiples of 16 (the fp8 GEMM's
    requirement), not the output head (the logits stay in bf16, as torchtitan keeps its output layer)."""
    from torch import nn

    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] == "lm_head":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_fp8(model: torch.nn.Module, cfg: PrecisionConfig) -> torch.nn.Module:
    """With precision.fp8: torchao's Float8Linear in place of the eligible linear layers (see `fp8_linear`).

    Applied after the model is built and quantized, before tensor parallelism, compile and the data-parallel
    wrap (launcher.rank.build), so FSDP2 shards the float8 layers' weights and compile fuses their casts.
    """
    if not cfg.fp8:
        return model
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(cfg.fp8_recipe)
    return convert_to_float8_training(model, config=config, module_filter_fn=fp8_linear)


def apply_backend_flags(cfg: PrecisionConfig, device_type: str) -> None:
    """Switch TF32 matmuls on or off for this process (a CUDA-wide flag)."""
    if device_type == "cuda":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
