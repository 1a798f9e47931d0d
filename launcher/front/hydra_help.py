"""Hydra's `--help`, answered without copying the config repository once per config group.

Hydra's help lists every config group with its options, and for each group (two listings per
group, recursively) it deep-copies the whole config repository, our registered schemas included:
about 230 copies, some 2 s on 2 cores, for a listing that reads the same repository every time.
Inside `one_repository_copy()` a config loader makes that copy once per (config name, overrides)
and every listing reads it. The text printed is Hydra's own, with one addition: the recipe group
lists `auto` (launcher.front.recipe_auto), which picks a recipe rather than being a file of conf/recipe.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from launcher.front.recipe_auto import AUTO

PICKED_OPTIONS = {"recipe": (AUTO,)}
"""Options a group takes that no file of conf/ holds: they are resolved before Hydra composes."""


@contextlib.contextmanager
def one_repository_copy() -> Iterator[None]:
    """While inside, `ConfigLoaderImpl.get_group_options` reuses one repository copy per loader and arguments."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.object_type import ObjectType

    original = ConfigLoaderImpl.get_group_options
    copies: dict[tuple[int, str | None, tuple[str, ...]], Any] = {}

    def get_group_options(
        self: ConfigLoaderImpl,
        group_name: str,
        results_filter: ObjectType | None = ObjectType.CONFIG,
        config_name: str | None = None,
        overrides: list[str] | None = None,
    ) -> list[str]:
        key = (id(self), config_name, tuple(overrides or ()))
        if key not in copies:
            copies[key] = self._parse_overrides_and_create_caching_repo(config_name, list(key[2]))[1]
        options = copies[key].get_group_options(group_name, results_filter)
        if results_filter != ObjectType.CONFIG:
            return options
        return sorted({*options, *PICKED_OPTIONS.get(group_name, ())})

    ConfigLoaderImpl.get_group_options = get_group_options
    try:
        yield
    finally:
        ConfigLoaderImpl.get_group_options = original
