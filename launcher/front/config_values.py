"""Read and set values of a composed config without touching it: what each enrichment step needs.

The steps between composing and building the spec (launcher.front.compose.build) each take the
composed config and return a new one with the values they decide; `typed` reads a group as its
schema dataclass, `with_values` copies the config with values set.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict


def typed(cfg: DictConfig, group: str) -> Any | None:
    """The group `group` of a composed config as its schema dataclass; None while it does not convert.

    A value that does not resolve or is missing is the schema's to report (launcher.spec.to_spec), so
    a step that cannot read its group leaves the config as it is.
    """
    try:
        return OmegaConf.to_object(cfg[group])
    except Exception:  # an interpolation that does not resolve, a `???`, a key the schema lacks
        return None


def with_values(cfg: DictConfig, values: Mapping[str, Any]) -> DictConfig:
    """A copy of `cfg` with each dotted key set to its value (the same config when there is nothing to set)."""
    if not values:
        return cfg
    out = copy.deepcopy(cfg)
    with open_dict(out):
        for key, value in values.items():
            OmegaConf.update(out, key, value, merge=False)
    return out
