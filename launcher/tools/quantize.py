"""`train-quantize SOURCE OUT --scheme S [--spec SPEC]`: post-training quantization with torchao.

SOURCE is a run directory (its newest complete checkpoint), a `checkpoints/step_N` directory, or a
local Hugging Face model folder (config.json + weights). A run's weights are consolidated the way
`train-export` does it (launcher.tools.export: whatever the strategy, LoRA/int8/nf4 runs merged
first), so the model quantized is the plain float32 model at world size 1, on the CPU.

The schemes are torchao 0.18 configs given to `torchao.quantization.quantize_`, applied to every
`nn.Linear` except an output head tied to the token embedding (quantizing it would untie it and
store the matrix twice):

- `int8_weight_only`: `Int8WeightOnlyConfig()`, int8 weights with a scale per output channel;
- `int4_weight_only`: `IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))`,
  int4 values with a scale per group of 32 inputs. This is the int4 weight-only config that runs on
  a CPU in torchao 0.18 (`Int4WeightOnlyConfig` needs CUDA or the mslk kernels); it keeps each int4
  value in an int8 byte, so on disk it is no smaller than int8;
- `int8_dynamic`: `Int8DynamicActivationInt8WeightConfig()`, int8 weights and per-token int8
  activations quantized at run time.

OUT is a folder: `model.pt` (the quantized state dict, torch tensor subclasses that
`torch.load(weights_only=True)` reads back), `quantize.json` (scheme, source, measured numbers) and
what rebuilds the model (`spec.yaml` of a run, `config.json` of an HF folder); `load_quantized(OUT)`
returns the quantized model. Sizes are the bytes of `torch.save` of each state dict (the same
serializer before and after). Eval loss and perplexity are measured, in float32, on the held-out
split the engine's `evaluate` reads (`spec.data`, `spec.tokenizer`, `train.micro_batch_size`,
`train.eval_batches`): the run's own spec, or for an HF folder the spec given with `--spec`; an HF
folder without `--spec` gets sizes only.
"""

from __future__ import annotations

import io
import json
import math
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.components.files.safe_load import load_tensor_file
from launcher.exits import ExitStatus
from launcher.spec import RunSpec, load_spec
from launcher.tools.hf_folder import ExportError, refuse_existing
from launcher.tools.lazy_torch import no_grad
from launcher.tools.tool_args import tool_parser

if TYPE_CHECKING:  # torch is imported where it is used, after the arguments are parsed
    import torch
    from torch import nn


DESCRIPTION = (
    "Post-training quantization (torchao) of a run's newest checkpoint or a local Hugging Face "
    "folder, on the CPU; prints size on disk and held-out eval loss/perplexity before and after, and "
    "writes OUT/model.pt (load it back with launcher.tools.quantize.load_quantized(OUT)). Exit status 2: "
    "bad input."
)
"""`train-quantize --help`'s description."""


SCHEMES = {
    "int8_weight_only": "Int8WeightOnlyConfig()",
    "int4_weight_only": "IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))",
    "int8_dynamic": "Int8DynamicActivationInt8WeightConfig()",
}
"""Scheme name -> the torchao 0.18 config it applies."""


def torchao_config(scheme: str) -> Any:
    """The torchao config object of `scheme` (torchao imported only here)."""
    import torch
    from torchao.quantization import (
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
    )
    from torchao.quantization.granularity import PerGroup

    if scheme == "int8_weight_only":
        return Int8WeightOnlyConfig()
    if scheme == "int4_weight_only":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))
    if scheme == "int8_dynamic":
        return Int8DynamicActivationInt8WeightConfig()
    raise ExportError(f"unknown --scheme {scheme!r}: choose one of {', '.join(SCHEMES)}.")


def quantize_model(model: nn.Module, scheme: str) -> nn.Module:
    """Quantize `model`'s linear layers in place with `scheme` (a head tied to an embedding stays float)."""
    from torch import nn
    from torchao.quantization import quantize_

    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}

    def quantizable(module: nn.Module, _fqn: str) -> bool:
        return isinstance(module, nn.Linear) and id(module.weight) not in tied

    quantize_(model, torchao_config(scheme), filter_fn=quantizable)
    return model


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes `torch.save` writes for `state` (shared storages once)."""
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.tell()


def _is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and not (path / "spec.yaml").is_file()


def load_source(source: Path) -> tuple[nn.Module, RunSpec | None, dict[str, Any]]:
    """(float32 model, the run's spec or None, what was read) for a run, step_N or HF folder."""
    if not source.is_dir():
        raise ExportError(
            f"{source} is not a directory. Give a run directory, a checkpoints/step_N directory, or a local "
            "Hugging Face model folder (config.json + weights)."
        )
    if _is_hf_folder(source):
        from launcher.components.model.hf import build_hf_model
        from launcher.config.model import ModelConfig

        model = build_hf_model(ModelConfig(kind="hf", path=str(source)), announce=False)
        return model.eval(), None, {"kind": "hf", "source": str(source)}
    from launcher.components.model.build import build_model
    from launcher.tools.export import is_adapted, locate, model_state

    step_dir, run_dir = locate(source)
    if not (run_dir / "spec.yaml").is_file():
        raise ExportError(
            f"{run_dir / 'spec.yaml'} is missing: the model and its data are read from the run's spec."
        )
    spec = load_spec(run_dir / "spec.yaml")
    state = model_state(step_dir, spec, merge=is_adapted(spec), fmt="pt")
    model = build_model(spec.model)
    model.load_state_dict(state)
    return model.eval(), spec, {"kind": "run", "source": str(run_dir), "checkpoint": str(step_dir)}


@no_grad
def evaluate(model: nn.Module, spec: RunSpec) -> dict[str, float]:
    """Token-mean float32 loss and perplexity on the held-out batches the engine's evaluate reads (one process)."""
    from launcher.components.data.sequences import PackedSequences, val_batches
    from launcher.components.data.tokens import load_corpus
    from launcher.components.model.loss import lm_loss, model_inputs

    d = spec.data
    val = PackedSequences(
        load_corpus(d, spec.tokenizer).val, d.seq_len, document_mask=d.packing and d.document_mask
    )
    total, count = 0.0, 0
    batches = val_batches(
        val, micro_batch_size=spec.train.micro_batch_size, max_batches=spec.train.eval_batches
    )
    for batch in batches:
        loss_sum, n = lm_loss(model(**model_inputs(batch)), batch["labels"])
        total, count = total + float(loss_sum), count + int(n)
    loss = total / max(count, 1)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}


def measure(model: nn.Module, spec: RunSpec | None) -> dict[str, Any]:
    """Size of the state dict in bytes, and eval loss/perplexity where a spec names the data."""
    return {"bytes": state_bytes(model.state_dict()), **(evaluate(model, spec) if spec is not None else {})}


def _data_spec(spec: RunSpec | None, spec_path: Path | None) -> RunSpec | None:
    """The spec whose data is evaluated: --spec if given (a spec.yaml or a run directory), else the run's."""
    if spec_path is None:
        return spec
    path = spec_path / "spec.yaml" if spec_path.is_dir() else spec_path
    if not path.is_file():
        raise ExportError(
            f"--spec {spec_path}: no spec.yaml there. Give a run's spec.yaml or its run directory."
        )
    return load_spec(path)


def quantize(source: Path, out: Path, *, scheme: str, spec_path: Path | None = None) -> dict[str, Any]:
    """Quantize `source` with `scheme` into the folder `out`; returns the record written to quantize.json."""
    import torch

    if scheme not in SCHEMES:
        raise ExportError(f"unknown --scheme {scheme!r}: choose one of {', '.join(SCHEMES)}.")
    refuse_existing(out, force=False)
    model, spec, info = load_source(source)
    data_spec = _data_spec(spec, spec_path)
    before = measure(model, data_spec)
    quantize_model(model, scheme)
    after = measure(model, data_spec)
    record = {**info, "scheme": scheme, "torchao_config": SCHEMES[scheme], "before": before, "after": after}
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    torch.save(model.state_dict(), partial / "model.pt")
    if info["kind"] == "run":
        shutil.copy(Path(info["source"]) / "spec.yaml", partial / "spec.yaml")
    else:
        shutil.copy(source / "config.json", partial / "config.json")
    (partial / "quantize.json").write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():
        out.rmdir()  # refuse_existing let only an empty folder through
    partial.replace(out)
    return record


def load_quantized(out: Path) -> nn.Module:
    """The quantized model `train-quantize` wrote to the folder `out`, in eval mode."""

    record = json.loads((out / "quantize.json").read_text())
    if record["kind"] == "run":
        from launcher.components.model.build import build_model

        model = build_model(load_spec(out / "spec.yaml").model)
    else:
        from launcher.components.model.hf import build_hf_model
        from launcher.config.model import ModelConfig

        model = build_hf_model(ModelConfig(kind="hf", hf_config=str(out)), announce=False)
    # assign: the saved tensors (torchao subclasses) replace the float parameters as they are
    model.load_state_dict(load_tensor_file(out / "model.pt"), assign=True)
    return model.eval()


def table(record: dict[str, Any]) -> str:
    """The before/after table printed by the command."""
    rows = [("", "size (bytes)", "eval loss", "eval ppl")]
    for name, m in (("before (float32)", record["before"]), (f"after ({record['scheme']})", record["after"])):
        loss = f"{m['eval_loss']:.4f}" if "eval_loss" in m else "-"
        ppl = f"{m['eval_ppl']:.3f}" if "eval_ppl" in m else "-"
        rows.append((name, f"{m['bytes']:,}", loss, ppl))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    ratio = record["before"]["bytes"] / max(record["after"]["bytes"], 1)
    lines.append(f"size ratio {ratio:.2f}x ({record['torchao_config']})")
    if "eval_loss" not in record["after"]:
        lines.append(
            "no eval: an HF folder has no data of its own; add --spec RUN_DIR/spec.yaml to measure loss"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Console entry point of `train-quantize`."""
    parser = tool_parser(
        "train-quantize",
        DESCRIPTION,
        folders=True,
        epilog="schemes: " + "; ".join(f"{name} = torchao {cfg}" for name, cfg in SCHEMES.items()),
    )
    parser.add_argument("out", type=Path, help="the folder to write (must not exist, or be empty)")
    parser.add_argument("--scheme", required=True, help=f"one of {', '.join(SCHEMES)}")
    parser.add_argument(
        "--spec",
        type=Path,
        default=None,
        help="a spec.yaml (or run directory) whose data evaluates an HF folder",
    )
    args = parser.parse_args(argv)
    try:
        record = quantize(args.source, args.out, scheme=args.scheme, spec_path=args.spec)
    except (ExportError, KeyError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return ExitStatus.INVALID_SPEC
    print(table(record))
    print(f"quantized {record.get('checkpoint', record['source'])} -> {args.out}")
    return ExitStatus.OK


if __name__ == "__main__":
    sys.exit(main())
