"""`train-export RUN_DIR OUT --qat-convert`: a QAT run's weights really quantized with the scheme it trained for.

A QAT checkpoint holds float weights with the plain model's keys (torchao's fake quantizers keep no
state of their own: launcher.components.qat). This consolidates them through the run's strategy, loads
them into the model prepared as the rank prepared it, and applies torchao's
`QATConfig(base, step="convert")`: the blocks' linear layers then hold IntxUnpackedToInt8Tensor
weights (int4 values, one scale per qat.group_size inputs; under int8_dynact_int4_weight the
activations are quantized per token at run time). OUT is that state dict, written with
`torch.save`; `load_converted` reads it back (torchao installed).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from launcher.components.files.safe_load import load_tensor_file
from launcher.spec import RunSpec


class ConvertError(ValueError):
    """The run cannot be converted (no QAT in its spec): bad input, exit status 2."""


def converted_model(state: dict[str, torch.Tensor], spec: RunSpec) -> nn.Module:
    """The model of `spec` holding the float `state`, fake-quant prepared then converted (eval mode)."""
    from launcher.components import qat
    from launcher.components.model.build import build_model

    if spec.qat.scheme == "none":
        raise ConvertError(
            "--qat-convert turns a QAT run's fake-quantized layers into quantized ones, but this run has "
            "qat.scheme=none. Export it without --qat-convert, or quantize it after training with train-quantize."
        )
    model = qat.prepare(build_model(spec.model), spec.qat)
    model.load_state_dict(state)
    return qat.convert(model, spec.qat).eval()


def write_converted(state: dict[str, torch.Tensor], spec: RunSpec, out: Path) -> nn.Module:
    """Convert `state` and write the quantized state dict to the file `out` (atomically); returns the model."""
    model = converted_model(state, spec)
    out.parent.mkdir(exist_ok=True)  # at most OUT's own folder (train-export's output_file_problem)
    partial = out.with_name(out.name + ".partial")
    torch.save(model.state_dict(), partial)
    partial.replace(out)
    return model


def load_converted(path: Path, spec: RunSpec) -> nn.Module:
    """The quantized model `write_converted` wrote to `path`, for the run of `spec`, in eval mode."""
    from launcher.components.model.build import build_model

    model = build_model(spec.model)
    # assign: the saved torchao tensors replace the float parameters as they are
    model.load_state_dict(load_tensor_file(path), assign=True)
    return model.eval()
