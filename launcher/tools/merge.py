"""`train-merge CHECKPOINT OUT.pt [--force]`: fold a run's LoRA adapters into plain, full-precision weights.

The run's spec.yaml rebuilds the adapted model exactly as training built it (same seed, same
quantization, the same peft adapters), the checkpoint's model state is loaded into it (consolidated by
the strategy that wrote it: for an adapter run, only the adapters, the frozen base being rebuilt), and
`launcher.components.quantization.merged_state_dict` writes a float32 state dict that loads into
`build_model(spec.model)`, the model without quantization or adapters. The command then checks
that both models give the same logits on one batch of random tokens and prints the difference.
An existing OUT.pt is replaced only with `--force`, once the new file is completely written.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from launcher.components import checkpoint, quantization
from launcher.components.adapters import load_checkpoint_state
from launcher.components.precision import train_dtype
from launcher.components.quantization import merged_state_dict
from launcher.exits import ExitStatus
from launcher.parallel.registry import strategy_module
from launcher.spec import RunSpec, load_spec
from launcher.tools.lazy_torch import no_grad
from launcher.tools.tool_args import output_file_problem, tool_parser

if TYPE_CHECKING:  # torch is imported where it is used, after the arguments are parsed
    import torch
    from torch import nn


DESCRIPTION = (
    "Fold LoRA adapters (and dequantize int8/nf4 weights) into a plain float32 state dict "
    "that loads into the model built without quantization or adapters."
)
"""`train-merge --help`'s description."""


def checkpoint_dir(path: Path) -> Path:
    """The checkpoint `path` names: a step_N directory, or a run directory's newest complete one."""
    found = checkpoint.resolve_resume(str(path), None)
    if not found:
        raise FileNotFoundError(
            f"{path} holds no complete checkpoint (a run directory or a step_N directory)."
        )
    return found[0]


def load_adapted(ckpt: Path) -> tuple[RunSpec, nn.Module]:
    """The run's spec and its model as training built it, with the checkpoint's weights, on the CPU."""
    import torch

    from launcher.components.model.build import build_model

    spec = load_spec(ckpt.parent.parent / "spec.yaml")
    torch.manual_seed(spec.train.seed)
    model = quantization.apply(
        build_model(spec.model),
        spec.quantization,
        train_dtype(spec.precision),
        strategy=spec.parallel.strategy,
    )
    state = strategy_module(spec.parallel.strategy).consolidate(ckpt)
    load_checkpoint_state(model, state)
    return spec, model.eval()


@no_grad
def max_logit_difference(spec: RunSpec, adapted: nn.Module, merged: dict[str, torch.Tensor]) -> float:
    """Largest absolute logit difference between the adapted model and the merged plain model."""
    import torch

    from launcher.components.model.build import build_model

    plain = build_model(spec.model)
    plain.load_state_dict(merged)
    plain.eval()
    seq_len = min(spec.data.seq_len, 64)
    tokens = torch.randint(0, 256, (2, seq_len), generator=torch.Generator().manual_seed(0))
    return float((plain(tokens).float() - adapted(tokens).float()).abs().max())


def merge_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], float]:
    """(plain merged state dict, max logit difference against the adapted model) for a checkpoint."""
    ckpt = checkpoint_dir(path)
    spec = load_spec(ckpt.parent.parent / "spec.yaml")
    if spec.quantization.method == "none" and spec.quantization.lora.rank == 0:
        raise ValueError(
            f"{ckpt} has nothing to merge: its run trained neither LoRA adapters nor int8/nf4 weights "
            "(quantization.method=none, quantization.lora.rank=0), so its weights are already plain. Write them "
            "with train-export RUN OUT.pt (as train-export --merge refuses this run too); nothing was written."
        )
    spec, adapted = load_adapted(ckpt)
    merged = merged_state_dict(adapted)
    return merged, max_logit_difference(spec, adapted, merged)


def main(argv: list[str] | None = None) -> int:
    """Console entry point of `train-merge`."""
    parser = tool_parser("train-merge", DESCRIPTION)
    parser.add_argument("out", type=Path, help="where to write the state dict (torch.save)")
    parser.add_argument("--force", action="store_true", help="replace an existing OUT file")
    args = parser.parse_args(argv)
    import torch  # after the arguments: --help and argument errors answer at once

    console = Console()
    try:
        problem = output_file_problem(args.out, force=args.force)
        if problem:  # before the (possibly long) merge
            raise FileExistsError(problem)
        merged, diff = merge_checkpoint(args.checkpoint)
    except (FileNotFoundError, FileExistsError, KeyError, ValueError) as err:  # ValueError: a refused file
        Console(stderr=True, soft_wrap=True).print("[red]error:[/]", escape(str(err)))
        return ExitStatus.INVALID_SPEC
    args.out.parent.mkdir(exist_ok=True)  # at most OUT's own folder (output_file_problem)
    partial = args.out.with_name(args.out.name + ".partial")
    torch.save(merged, partial)
    partial.replace(args.out)
    console.print(
        f"wrote {args.out}: {len(merged)} tensors; max |logit difference| against the adapted model {diff:.3g}"
    )
    return ExitStatus.OK


if __name__ == "__main__":
    sys.exit(main())
