"""Secrets kept out of what a run writes: a value an `${oc.env:VAR}` interpolation resolved to is written in its
raw form (spec.yaml, the dry run's table, the run's name, a sweep's rows), never resolved.
"""

from __future__ import annotations

import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf


def redacted_container(cfg: DictConfig) -> dict[str, Any]:
    """The config resolved, except values that come from environment variables, kept as `${oc.env:..}`.

    Any value that contains a resolved environment variable is written in its raw form, so that
    secrets passed as `${oc.env:VAR}` never reach spec.yaml, the console or logs.
    """
    resolved = OmegaConf.to_container(cfg, resolve=True)
    raw = OmegaConf.to_container(cfg, resolve=False)
    return _redact(raw, resolved, _secrets(raw, resolved))


def redacted(data: dict[str, Any], raw: DictConfig) -> dict[str, Any]:
    """`data` (built from `raw`), where each value holding what an `${oc.env:VAR}` of `raw` resolved to is written
    as `raw` writes it."""
    raw_data = OmegaConf.to_container(raw, resolve=False)
    return _redact(raw_data, data, _secrets(raw_data, OmegaConf.to_container(raw, resolve=True)))


def _secrets(raw: Any, resolved: Any) -> list[str]:
    """The values environment variables gave a config (`raw` and `resolved` are its two containers)."""
    return [str(v) for r, v in _pairs(raw, resolved) if isinstance(r, str) and "oc.env" in r and v]


def _pairs(raw: Any, resolved: Any) -> typing.Iterator[tuple[Any, Any]]:
    if isinstance(raw, dict):
        for key in raw:
            yield from _pairs(raw[key], resolved[key])
    elif isinstance(raw, list):
        for r, v in zip(raw, resolved, strict=True):
            yield from _pairs(r, v)
    else:
        yield raw, resolved


def _redact(raw: Any, resolved: Any, secrets: list[str]) -> Any:
    """`resolved`, where each string holding a secret is replaced by `raw`'s value at the same place."""
    if isinstance(resolved, dict):
        raw = raw if isinstance(raw, dict) else {}
        return {k: _redact(raw.get(k), v, secrets) for k, v in resolved.items()}
    if isinstance(resolved, list):
        raw = raw if isinstance(raw, list) and len(raw) == len(resolved) else [None] * len(resolved)
        return [_redact(r, v, secrets) for r, v in zip(raw, resolved, strict=True)]
    if isinstance(resolved, str) and raw is not None and any(s in resolved for s in secrets):
        return raw
    return resolved
