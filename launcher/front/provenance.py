"""Where each config value came from: train.yaml, a group option, a recipe, the command line.

The dry run prints it next to each key ("where each came from"), and the keys a person set on
purpose (`explicit`) are the ones a user's DeepSpeed or accelerate file may not override: a value
that came only from the schema, from train.yaml or from a group option nobody picked is a default,
and an explicit value in such a file wins over it (launcher.front.deepspeed_file).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.components.loggers.records import flatten

CONFIG_MODULE = "launcher.conf"
"""The package holding the shipped conf/ (and recipes/ as its `recipe` group)."""


def config_dir() -> Path:
    """Where the shipped conf/ lives (inside the installed package, or the checkout)."""
    return Path(str(resources.files(CONFIG_MODULE)))


def _yaml_values(path: Path, package: str) -> dict[str, Any]:
    """Leaf values a config file sets, under its package (a recipe's package is global)."""
    if not path.is_file():
        return {}
    text = path.read_text()
    data = OmegaConf.to_container(OmegaConf.create(text), resolve=False) or {}
    data = {k: v for k, v in data.items() if k not in ("defaults", "hydra")}
    if "@package _global_" not in text and package:
        data = {package: data}
    return flatten(data)


def _option_file(roots: list[Path], group: str, option: str) -> Path:
    """The file of `group=option`: in the user's config directories first, then the shipped conf/."""
    for root in roots:
        if (root / group / f"{option}.yaml").is_file():
            return root / group / f"{option}.yaml"
    return roots[-1] / group / f"{option}.yaml"


def provenance(
    choices: dict[str, str | None], task_overrides: list[str], user_dirs: tuple[Path, ...] = ()
) -> dict[str, str]:
    """Dotted key -> the source that set it last: train.yaml, a group option (the user's own directories
    included), a recipe or experiment, the command line."""
    root = config_dir()
    roots = [*user_dirs, root]
    sources: dict[str, str] = dict.fromkeys(_yaml_values(root / "train.yaml", ""), "train.yaml")
    late = ("recipe", "experiment")  # files of overrides, applied after the groups they override
    ordered = sorted(choices.items(), key=lambda item: item[0] in late)
    for group, option in ordered:
        if option is None or group.startswith("hydra"):
            continue
        for key in _yaml_values(_option_file(roots, group, option), group):
            sources[key] = f"{group}={option}"
    for override in task_overrides:
        key, sep, value = override.lstrip("+~").partition("=")
        if sep and value.startswith("[") and (root / key).is_dir():  # logger=[a,b]
            for option in (o.strip() for o in value.strip("[]").split(",")):
                for leaf in _yaml_values(_option_file(roots, key, option), key):
                    sources[leaf] = f"{key}={option}"
        elif sep and key not in choices:
            sources[key] = "command line"
    return sources


def chosen_files(cfg: DictConfig) -> list[tuple[str, dict[str, Any]]]:
    """(group=option, the leaf values its file sets, unconverted) for every option the composed config chose."""
    if "hydra" not in cfg:
        return []
    roots = [*user_dirs(cfg), config_dir()]
    return [
        (f"{group}={option}", _yaml_values(_option_file(roots, group, str(option)), group))
        for group, option in dict(cfg.hydra.runtime.choices).items()
        if option is not None and not group.startswith("hydra")
    ]


def user_dirs(cfg: DictConfig) -> tuple[Path, ...]:
    """The file config directories Hydra searched besides the shipped conf/ (--config-dir, hydra.searchpath)."""
    if "hydra" not in cfg:
        return ()
    shipped = config_dir().resolve()
    dirs = [
        Path(source.path).resolve()
        for source in cfg.hydra.runtime.get("config_sources", [])
        if source.get("schema") == "file" and source.get("path")
    ]
    return tuple(d for d in dirs if d != shipped)


def default_choices() -> dict[str, str | None]:
    """The option train.yaml's defaults list picks for each group (what a command line that names no group gets)."""
    data = OmegaConf.to_container(OmegaConf.load(config_dir() / "train.yaml"), resolve=False) or {}
    choices: dict[str, str | None] = {}
    for entry in data.get("defaults", []):
        if isinstance(entry, dict):
            for group, option in entry.items():
                choices[str(group)] = None if option is None else str(option)
    return choices


def explicit(cfg: DictConfig) -> dict[str, str]:
    """Dotted key -> its source, for the keys a person set: on the command line, in a recipe or experiment,
    in a user's config directory, or in a group option chosen on purpose (not train.yaml's default pick)."""
    if "hydra" not in cfg:
        return {}
    choices = dict(cfg.hydra.runtime.choices)
    overrides = [str(o) for o in OmegaConf.to_container(cfg.hydra.overrides.task, resolve=False)]
    typed = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    defaults = default_choices()
    sources = provenance(choices, overrides, user_dirs(cfg))

    def chosen(source: str) -> bool:
        if source == "command line":
            return True
        group, sep, option = source.partition("=")
        return bool(sep) and (group in typed or defaults.get(group, "") != option)

    return {key: source for key, source in sources.items() if chosen(source)}
