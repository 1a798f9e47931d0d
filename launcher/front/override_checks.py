"""Checks of command-line overrides against the schema before composing: every unknown group, option
or key and every value of the wrong type at once (Hydra would stop at the first, and lets
`+key=value` bypass the schema), and the Hydra settings `train` does not honour (its launcher and
sweeper plugins, hydra.run.dir), refused with what to use instead. After composing: switches a
config file sets to a non-bool, and optimizer keys set on purpose that the chosen optimizer ignores.
"""

from __future__ import annotations

import dataclasses
import typing

from omegaconf import DictConfig, OmegaConf

from launcher.spec import (
    RunSpec,
    SpecError,
    did_you_mean,
    entry_schema,
    schema_fields,
    schema_node,
    unknown_key_error,
)


def field_type(path: str) -> tuple[type | None, list[str]]:
    """The schema type at a dotted path, or (None, known keys at the first unknown step)."""
    schema: typing.Any = RunSpec
    for part in path.split("."):
        if not dataclasses.is_dataclass(schema):
            return None, []
        fields = schema_fields(schema)
        if part not in fields:
            return None, list(fields)
        schema = fields[part]
    return schema, []


def check(
    overrides: list[str], *, groups: dict[str, list[str]], shipped: dict[str, list[str]]
) -> list[SpecError]:
    """Unknown groups, options and keys, and values of the wrong type, among command-line overrides.

    `groups`: every config group and its options (the user's directories included); `shipped`: conf/'s own.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    errors: list[SpecError] = []
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as err:  # Hydra's grammar error names the bad override
        return [parse_error(err, overrides)]
    scratch = schema_node()
    optuna = OPTUNA in overrides
    for override in parsed:
        key = override.key_or_group
        if key.partition("/")[0].partition(".")[0] == "hydra":
            errors.extend(_check_hydra(key, override.get_value_element_as_str(), optuna=optuna))
            continue
        if override.is_delete():
            continue
        if key in groups:
            errors.extend(_check_option(key, override, groups[key], shipped))
            continue
        schema, known = field_type(key)
        if schema is None and known:
            errors.append(unknown_key_error(key, known))
            continue
        if not override.is_sweep_override():
            entry_errors = _check_entries(key, schema, override.value())
            errors.extend(entry_errors or _check_value(scratch, key, override))
    return errors


def parse_error(err: Exception, overrides: list[str]) -> SpecError:
    """One paragraph for an override Hydra's grammar refuses, with how to quote a value it cannot read bare."""
    reason = " ".join(str(err).split("See https://")[0].split())
    odd = [o for o in overrides if not o.isascii() or any(c in o.partition("=")[2] for c in " ()[]{}',:\\")]
    hint = ""
    if odd:
        key, _, value = odd[0].partition("=")
        hint = (
            f" Values with spaces, non-ASCII letters or characters such as ()[]{{}},: must be quoted inside the "
            f"override: '{key}=\"{value}\"' (the outer quotes are for the shell)."
        )
    return SpecError(("command line",), f"an override does not parse ({reason}).{hint}")


PLUGIN_HINT = (
    "`train` composes, starts and sweeps runs itself, so Hydra's launcher and sweeper plugins are not used. "
    "Where runs go: launcher=inline|local|slurm (launcher.nproc, launcher.slurm.*); sweeps: "
    "`train -m key=a,b` (also range(...) and choice(...)), one run per combination, each point validated first; "
    "Bayesian sweeps: `train -m hydra/sweeper=optuna hydra.sweeper.n_trials=N 'key=interval(a,b)'`."
)
OPTUNA = "hydra/sweeper=optuna"
"""The one sweeper plugin `train` honours: Hydra's Optuna sweeper, driven by launcher.front.optuna_sweep."""
OPTUNA_KEYS = ("n_trials", "n_jobs", "direction", "storage", "study_name", "sampler", "params")
"""The keys of hydra.sweeper (with the Optuna sweeper) that `train` honours."""


RUN_DIR_HINT = (
    "hydra.run.dir is not where a run writes: `train` never changes into Hydra's run directory. Set "
    "run_dir=PATH instead (checkpoints, logs, spec.yaml; default runs/<name>-<time>); a sweep's points go to "
    "hydra.sweep.dir/hydra.sweep.subdir, which are honoured."
)


def _check_optuna(key: str, value: str) -> list[SpecError]:
    """The Optuna sweeper's settings `train` does not honour (code to import, the old search_space form)."""
    if key in ("hydra/sweeper", "hydra/sweeper/sampler"):
        return [] if key == "hydra/sweeper/sampler" or value == "optuna" else _check_hydra(key, value)
    name = key.removeprefix("hydra.sweeper.").partition(".")[0]
    if key.startswith("hydra.sweeper.") and name in OPTUNA_KEYS and not key.endswith("_target_"):
        return []
    return [
        SpecError(
            (key,),
            f"{key} is not a setting `train` honours with the Optuna sweeper: give the search space as "
            "sweep overrides ('optimizer.lr=tag(log, interval(1e-5, 1e-2))', 'key=choice(a,b)', or in "
            f"hydra.sweeper.params) and set only hydra.sweeper.{{{','.join(OPTUNA_KEYS)}}}. Remove {key}.",
        )
    ]


def _check_hydra(key: str, value: str = "", *, optuna: bool = False) -> list[SpecError]:
    """Hydra settings `train` does not honour: its launcher/sweeper plugins (Optuna's aside) and its run directory."""
    if optuna and (key.startswith(("hydra/sweeper", "hydra.sweeper"))):
        return _check_optuna(key, value)
    if key in ("hydra/launcher", "hydra/sweeper") or key.startswith(("hydra.launcher", "hydra.sweeper")):
        return [
            SpecError((key,), f"{key} is not supported: {PLUGIN_HINT} Remove {key} from the command line.")
        ]
    if key in ("hydra.run", "hydra.run.dir"):
        return [SpecError((key,), RUN_DIR_HINT)]
    return []


def check_hydra_node(cfg: DictConfig) -> list[SpecError]:
    """The same Hydra settings when a config file (an experiment, say) set them rather than the command line."""
    choices = cfg.hydra.runtime.choices
    optuna = OPTUNA in (OmegaConf.select(cfg, "hydra.overrides.hydra") or [])  # the command line chose it
    errors = [
        SpecError(
            (group,), f"{group}={choices[group]} is not supported: {PLUGIN_HINT} Remove it from your config."
        )
        for group in ("hydra/launcher", "hydra/sweeper")
        if choices.get(group) not in (None, "basic") and not (optuna and group == "hydra/sweeper")
    ]
    if OmegaConf.select(cfg, "hydra.run.dir") != ".":
        errors.append(SpecError(("hydra.run.dir",), RUN_DIR_HINT))
    return errors


def check_file_bools(cfg: DictConfig) -> list[SpecError]:
    """A switch a config file sets to something other than true or false (`bias: 2`, `bias: "yes"`), which
    composing would read as true; the command line's are refused in `_check_value`."""
    from launcher.front.provenance import chosen_files

    errors = []
    for source, values in chosen_files(cfg):
        for key, value in values.items():
            if value is None or isinstance(value, bool) or (isinstance(value, str) and "${" in value):
                continue
            if _is_bool(field_type(key)[0]):
                errors.append(
                    SpecError(
                        (key,),
                        f"takes true or false, but {source} sets it to {value!r}, which composing would silently "
                        f"turn into a bool. Write true or false in that file (or {key}=... on the command line).",
                    )
                )
    return errors


def check_unread_optimizer_keys(cfg: DictConfig, optimizer: str, found: list[SpecError]) -> list[SpecError]:
    """Optimizer keys someone set (command line, recipe, chosen option file) that `optimizer` would ignore;
    a key another rule already named (`found`) is left to that rule's more specific message."""
    from launcher.front.provenance import explicit
    from launcher.rules.optimizer import unread_keys

    named = {key for error in found for key in error.keys}
    return [error for error in unread_keys(optimizer, explicit(cfg)) if error.keys[0] not in named]


def _check_option(
    group: str, override: typing.Any, options: list[str], shipped: dict[str, list[str]]
) -> list[SpecError]:
    """An option that its group lacks, or a user's own group selected without the `+` Hydra needs."""
    if group not in shipped and not override.is_add():
        value = override.get_value_element_as_str()
        return [
            SpecError(
                (group,),
                f"{group} is a group of your config directory that train.yaml's defaults list does not select: "
                f"add it with +{group}={value} (Hydra's `+` appends a group that has no default).",
            )
        ]
    values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
    values = [v for value in values for v in (value if isinstance(value, list) else [value])]  # logger=[a,b]
    errors = []
    for value in values:
        if value is not None and str(value) not in options:
            errors.append(
                SpecError(
                    (group,),
                    f"no option '{value}' in group {group}.{did_you_mean(str(value), options)} "
                    f"Options: {', '.join(options)}.",
                )
            )
    return errors


def _check_entries(key: str, schema: typing.Any, value: typing.Any) -> list[SpecError]:
    """Unknown keys inside the entries of a list-of-entries key (data.sources=[{path: a, weight: 1}, ...])."""
    entry = entry_schema(schema)
    if entry is None or not isinstance(value, list):
        return []
    fields = schema_fields(entry)
    return [
        unknown_key_error(f"{key}[{index}].{name}", fields)
        for index, item in enumerate(value)
        if isinstance(item, dict)
        for name in item
        if name not in fields
    ]


def _is_bool(schema: typing.Any) -> bool:
    """Whether a schema type is bool or bool | None."""
    return schema is bool or (set(typing.get_args(schema)) == {bool, type(None)})


def _check_value(scratch: DictConfig, key: str, override: typing.Any) -> list[SpecError]:
    value = override.value()
    interpolated = isinstance(value, str) and "${" in value  # resolved later, judged by the schema then
    if (
        _is_bool(field_type(key)[0])
        and value is not None
        and not isinstance(value, bool)
        and not interpolated
    ):
        return [  # the schema would read 2, "yes" or "on" as true
            SpecError(
                (key,), f"wrong type: takes true or false, got {value!r}. Write {key}=true or {key}=false."
            )
        ]
    try:
        OmegaConf.update(scratch, key, override.value(), merge=True)
    except Exception as err:
        reason = str(err).splitlines()[0]
        return [
            SpecError(
                (key,), f"wrong type: {reason}. Give a value of the key's type (see `train --cfg job`)."
            )
        ]
    return []
