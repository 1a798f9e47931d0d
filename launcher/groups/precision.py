"""The precision group: autocast dtype, loss scaling for fp16, TF32 switches, eval precision."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where a rank trains: the launching process never needs it
    import torch

DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes eval_dtype may name (torch's own names)."""


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """How numbers are represented during training and evaluation."""

    bf16: bool = False
    """Run forward and loss under bf16 autocast (weights and optimizer state stay fp32)."""
    fp16: bool = False
    """Run forward and loss under fp16 autocast with dynamic loss scaling."""
    tf32: bool = False
    """Allow TF32 tensor-core matmuls and convolutions for fp32 work (NVIDIA Ampere or newer)."""
    eval_dtype: str | None = None
    """Autocast dtype for evaluation (float32, bfloat16, float16); null: the training dtype."""
    loss_scale_init: float = 65536.0
    """Initial loss scale for fp16."""
    loss_scale_growth_interval: int = 2000
    """Steps without overflow before the fp16 loss scale doubles."""


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


def apply_backend_flags(cfg: PrecisionConfig, device_type: str) -> None:
    """Switch TF32 matmuls on or off for this process (a CUDA-wide flag)."""
    if device_type == "cuda":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
