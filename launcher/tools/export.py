"""`train-export SOURCE OUT [--format pt|hf] [--merge | --adapter | --qat-convert] [--best] [--force]`: a run's weights outside the launcher.

SOURCE is a `checkpoints/step_N` directory or a run directory (its newest complete checkpoint is
used; with `--best`, the one checkpoints/best names: the best value of `checkpoint.keep_best`). The run's spec.yaml names the strategy; that strategy's module (the registry entry's)
provides `consolidate(directory)`, which gathers sharded or engine-specific files offline in this
one process. With `--merge`, `launcher.tools.merge.merge_checkpoint` folds LoRA adapters (and
dequantizes int8/nf4 weights) instead. Either way the result loads at world size 1 into
`launcher.components.model.build.build_model(spec.model)`.

- `--format pt` (the default): that state dict, written with `torch.save` to the file OUT. An
  existing OUT file is replaced only with `--force` (the same for an OUT folder that is not empty).
- `--format hf`: a Hugging Face folder OUT that `AutoModelForCausalLM.from_pretrained(OUT)` loads
  (`launcher.components.model.hf_export` converts the weights; `launcher.tools.hf_folder` writes the
  folder, tokenizer files included). Its logits are compared with the launcher's model before the
  folder is renamed into place.
- `--adapter`: the LoRA/DoRA adapters alone, as a PEFT folder (adapter_config.json +
  adapter_model.safetensors) that `PeftModel.from_pretrained(base_model, OUT)` loads
  (launcher.tools.adapter_folder).
- `--qat-convert`: a QAT run's model converted by torchao to the quantized scheme it trained for,
  as a .pt state dict (launcher.tools.qat_export).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.components import checkpoint
from launcher.exits import ExitStatus
from launcher.parallel.registry import strategy_module
from launcher.spec import RunSpec, load_spec
from launcher.tools.hf_folder import ExportError, load_tokenizer, special_ids, write_folder
from launcher.tools.lazy_torch import no_grad
from launcher.tools.tool_args import output_file_problem, tool_parser

if TYPE_CHECKING:  # torch is imported where it is used, after the arguments are parsed
    import torch


DESCRIPTION = (
    "Write a run's weights: a full state dict that loads at world size 1 (pt), or a Hugging "
    "Face folder that AutoModelForCausalLM.from_pretrained loads (hf). Exit status 2: bad input."
)
"""`train-export --help`'s description."""


FORMATS = ("pt", "hf")
LOGIT_TOLERANCE = 1e-4
"""Largest |logit difference| (fp32) between the launcher's model and the exported one; measured ~1e-6."""


class MismatchError(RuntimeError):
    """The exported model does not reproduce the launcher's logits (a conversion bug, not bad input)."""


__all__ = ["ExportError", "MismatchError", "best_checkpoint", "consolidate", "export", "locate", "main"]


def locate(path: Path) -> tuple[Path, Path]:
    """(checkpoint directory, run directory) for a step_N directory or a run directory (the head of its `latest` line)."""
    path = Path(path)
    if path.name.startswith("step_"):
        reason = checkpoint.problem(path)
        if reason is not None:
            raise ExportError(f"{path} is not a complete checkpoint: {reason}.")
        return path, path.parent.parent
    good = (
        checkpoint.resolve_resume(str(path), None) if path.is_dir() else []
    )  # latest's line, as resume=auto
    if not good:
        raise ExportError(
            f"{path} holds no complete checkpoint (expected a run directory with checkpoints/step_N, "
            "or a step_N directory)."
        )
    return good[0], path


def best_checkpoint(run_dir: Path) -> Path:
    """The complete checkpoint a run directory's checkpoints/best names (`--best`); ExportError naming the fix."""
    from launcher.components.checkpoint_best import named

    run_dir = Path(run_dir)
    if run_dir.name.startswith("step_") or not (run_dir / "spec.yaml").is_file():
        raise ExportError(f"--best reads a run directory (with spec.yaml and checkpoints/), not {run_dir}.")
    best = named(checkpoint.root(run_dir))
    if best is None:
        raise ExportError(
            f"{run_dir} has no best checkpoint ({checkpoint.root(run_dir)}/best is missing or names no checkpoint): "
            "the run did not set checkpoint.keep_best=<metric>, or no evaluation was checkpointed yet. Export a "
            "step directory, or the newest checkpoint without --best."
        )
    if (reason := checkpoint.problem(best)) is not None:
        raise ExportError(f"the best checkpoint {best} is not complete: {reason}.")
    return best


def consolidate(step_dir: Path, spec: RunSpec) -> dict[str, torch.Tensor]:
    """The full model state dict of `step_dir`, through its strategy's `consolidate`."""
    return strategy_module(spec.parallel.strategy).consolidate(step_dir)


def is_adapted(spec: RunSpec) -> bool:
    """Whether the run trained adapters or stores quantized weights (its state needs a merge)."""
    return spec.quantization.method != "none" or spec.quantization.lora.rank > 0


def model_state(step_dir: Path, spec: RunSpec, *, merge: bool, fmt: str) -> dict[str, torch.Tensor]:
    """The plain float32 state dict of `step_dir`: consolidated, or merged when `merge`."""
    if merge and not is_adapted(spec):
        raise ExportError(
            "--merge folds LoRA adapters and dequantizes int8/nf4 weights, but this run has neither "
            "(quantization.method=none, quantization.lora.rank=0): its weights are already plain. "
            "Export without --merge."
        )
    if merge:
        from launcher.tools.merge import merge_checkpoint

        state, diff = merge_checkpoint(step_dir)
        print(f"merged adapters: max |logit difference| against the adapted model {diff:.3g}")
        return state
    if is_adapted(spec):
        other = " or, for a PEFT adapter folder beside the base model, --adapter" if fmt == "hf" else ""
        raise ExportError(
            f"{step_dir} holds LoRA adapters or quantized weights "
            f"(quantization.method={spec.quantization.method}, quantization.lora.rank="
            f"{spec.quantization.lora.rank}), which a plain model cannot load. Add --merge to fold them "
            f"into full-precision weights{other}."
        )
    state = consolidate(step_dir, spec)
    # The zeros are in the weights: dropping the masks makes the pruning permanent.
    if spec.prune.method != "none":
        from launcher.components.prune import without_masks

        state = without_masks(state)
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


@no_grad
def max_logit_difference(spec: RunSpec, state: dict[str, torch.Tensor], exported: Any, num_ids: int) -> float:
    """Largest |logit difference| between the launcher's model holding `state` and the exported model."""
    import torch

    from launcher.components.model.build import build_model

    plain = build_model(spec.model)
    plain.load_state_dict(state)
    seq_len = min(spec.model.max_seq_len, 32)
    tokens = torch.randint(0, num_ids, (2, seq_len), generator=torch.Generator().manual_seed(0))
    return float((plain.eval()(tokens) - exported(input_ids=tokens).logits).abs().max())


def write_hf(spec: RunSpec, state: dict[str, torch.Tensor], out: Path, *, force: bool) -> float:
    """Convert `state` to a transformers model, check its logits, write the folder; returns the difference."""
    from launcher.components.model.hf_export import to_transformers

    tokenizer = load_tokenizer(spec.tokenizer)
    tokenizer.model_max_length = spec.model.max_seq_len
    exported = to_transformers(state, spec.model)
    rows = exported.get_input_embeddings().num_embeddings
    diff = max_logit_difference(spec, state, exported, min(rows, len(tokenizer)))
    if not diff <= LOGIT_TOLERANCE:
        raise MismatchError(
            f"the exported model's logits differ from the launcher's by {diff:.3g} (> {LOGIT_TOLERANCE}); "
            "nothing was written. This is a conversion bug: please report it with the run's spec.yaml."
        )
    write_folder(exported, tokenizer, out, special_ids(spec.tokenizer, tokenizer), force=force)
    return diff


def export(
    source: Path,
    out: Path,
    *,
    fmt: str = "pt",
    merge: bool = False,
    force: bool = False,
    qat_convert: bool = False,
) -> Path:
    """Write `source`'s weights (a checkpoint or run directory) to `out` in `fmt`; returns the checkpoint used.

    `qat_convert`: a QAT run's weights really quantized (launcher.tools.qat_export), as a pt file.
    """
    import torch

    step_dir, run_dir = locate(source)
    spec_path = run_dir / "spec.yaml"
    if not spec_path.is_file():
        raise ExportError(f"{spec_path} is missing: the export reads the run's spec to find its strategy.")
    spec = load_spec(spec_path)
    if fmt == "hf":
        from launcher.components.model.hf_export import hf_export_problem
        from launcher.tools.hf_folder import refuse_existing

        if problem := hf_export_problem(spec.model):  # before the (possibly long) consolidation or merge
            raise ExportError(problem)
        refuse_existing(out, force=force)
    elif problem := output_file_problem(out, force=force):
        raise ExportError(problem)
    if qat_convert and (fmt != "pt" or merge):
        raise ExportError(
            "--qat-convert writes a quantized torch state dict: use it with --format pt and without --merge."
        )
    state = model_state(step_dir, spec, merge=merge, fmt=fmt)
    if qat_convert:
        from launcher.tools.qat_export import write_converted

        write_converted(state, spec, out)
        return step_dir
    if fmt == "hf":
        diff = write_hf(spec, state, out, force=force)
        print(f"logits of the Hugging Face model vs the launcher's: max |difference| {diff:.3g}")
        return step_dir
    from launcher.components.model.build import build_model

    build_model(spec.model).load_state_dict(state)  # proves it loads at world size 1 before writing
    out.parent.mkdir(exist_ok=True)  # at most OUT's own folder (output_file_problem)
    partial = out.with_name(out.name + ".partial")
    torch.save(state, partial)
    partial.replace(out)
    return step_dir


def export_adapter(source: Path, out: Path, *, merge: bool, force: bool) -> Path:
    """Write `source`'s adapters as a PEFT adapter folder `out`; returns `out`."""
    from launcher.tools.adapter_folder import write_adapter_folder
    from launcher.tools.hf_folder import refuse_existing

    if merge:
        raise ExportError(
            "--adapter writes the adapters alone (they stay separate from the base model) and --merge folds "
            "them into the weights: choose one."
        )
    step_dir, _ = locate(source)
    refuse_existing(out, force=force)
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    write_adapter_folder(step_dir, partial)
    if out.exists():
        shutil.rmtree(out)  # only --force gets here with content; the new folder is complete
    partial.replace(out)
    return step_dir


SWITCHES = {
    "--merge": "fold LoRA adapters and dequantize int8/nf4 weights first",
    "--adapter": "write the LoRA/DoRA adapters alone as a PEFT folder (PeftModel.from_pretrained(base, OUT))",
    "--force": "replace an existing OUT file or non-empty OUT folder",
    "--qat-convert": "a QAT run: write the really quantized model (torchao convert of its qat.scheme) as a .pt state dict",
    "--best": "export the checkpoint checkpoints/best names (the best value of the run's checkpoint.keep_best)",
}
"""train-export's on/off options and their help, in the order --help lists them."""


def main(argv: list[str] | None = None) -> int:
    """Console entry point of `train-export`."""
    parser = tool_parser("train-export", DESCRIPTION)
    parser.add_argument(
        "out", type=Path, help="the .pt file (--format pt) or the folder (--format hf) to write"
    )
    parser.add_argument("--format", choices=FORMATS, default="pt", dest="fmt", help="pt (default) or hf")
    for flag, text in SWITCHES.items():
        parser.add_argument(flag, action="store_true", help=text)
    args = parser.parse_args(argv)
    try:
        if args.best:
            args.checkpoint = best_checkpoint(args.checkpoint)
        if args.adapter:
            used = export_adapter(args.checkpoint, args.out, merge=args.merge, force=args.force)
        else:
            used = export(
                args.checkpoint,
                args.out,
                fmt=args.fmt,
                merge=args.merge,
                force=args.force,
                qat_convert=args.qat_convert,
            )
    except (ExportError, KeyError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return ExitStatus.INVALID_SPEC
    except MismatchError as err:
        print(f"error: {err}", file=sys.stderr)
        return ExitStatus.FAILED
    print(f"exported {used} -> {args.out}")
    return ExitStatus.OK


if __name__ == "__main__":
    sys.exit(main())
