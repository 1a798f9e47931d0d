"""The decoder layers a pipeline stage keeps, named as in the whole model (so state-dict keys line up)."""

from __future__ import annotations

from torch import nn


class StageLayers(nn.ModuleList):
    """The decoder layers one stage holds, registered under their index in the whole model."""

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)

    def __getitem__(self, idx: int | slice) -> nn.Module | list[nn.Module]:  # type: ignore[override]
        """Position within the stage (not the layer's index in the whole model)."""
        return list(self._modules.values())[idx]
