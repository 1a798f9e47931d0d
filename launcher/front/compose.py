"""From command-line overrides to a validated spec: group discovery, pre-checks, composition (Hydra's
compose API, the only place a run's config is composed), enrichment and validation.

Hydra decides between `group=option` and `+group=option` by whether the group has a default; every
group here has one, so `+group=option` is rewritten to the bare form (launcher.front.command_line)
and both spellings work.
Overrides are checked against the schema before composing, so every typo, unknown option and wrong
type is reported at once (Hydra would stop at the first, and lets `+key=value` bypass the schema).
Composing sets no global state: Hydra's singletons are released when `compose` returns.

A user's own config directories (`--config-dir DIR`, `hydra.searchpath=[file://DIR]`) join the
shipped conf/: their options of existing groups and their own groups (an `experiment` group of
`# @package _global_` overrides, selected with `+experiment=NAME`) are checked and composed
like the shipped ones, and the result is validated by the same schema and rules.
Hydra's launcher and sweeper plugins and `hydra.run.dir` are refused with what to use instead:
`train` starts and sweeps runs itself (launcher=..., -m) and writes to `run_dir`.

`build` takes the composed config through pure steps that write what the launcher decides into it
(a DeepSpeed file's values, the backend, the tokenizer and vocabulary, the data format, a fitted
warmup, a folder model's shape), then builds the frozen spec from it once and runs the rules once.
spec.yaml is that spec's dump, secrets redacted against the config it was built from.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from launcher.front import override_checks
from launcher.front.config_values import typed, with_values
from launcher.front.provenance import CONFIG_MODULE, config_dir
from launcher.spec import (
    InvalidSpec,
    RunSpec,
    SpecError,
    missing_values,
    schema_node,
    spec_text,
    to_spec,
    unknown_keys,
)

PRIMARY = "train"


@functools.cache
def register_schemas() -> None:
    """Register the RunSpec schema with Hydra (`_run_spec` in the primary config's defaults), once."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="_run_spec", node=schema_node())


@dataclass(frozen=True, kw_only=True)
class ConfigSource:
    """Where the primary config comes from: the shipped conf/, or a directory (`--config-path`, spec.yaml)."""

    config_path: str | None = None
    """A directory holding the primary config; None: the shipped conf/ (launcher.conf)."""
    config_name: str = "train"
    """The primary config's name (spec, to reproduce a run from its spec.yaml)."""
    config_dir: str | None = None
    """An extra directory searched for config groups (`--config-dir`)."""

    @property
    def shipped(self) -> bool:
        """Whether the primary config is the shipped one (whose groups the pre-checks know)."""
        return self.config_path is None


@functools.cache
def group_options(user_dirs: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Config group -> its option names, from conf/<group>/*.yaml and the same layout in each user directory."""
    groups: dict[str, set[str]] = {}
    for root in (config_dir(), *map(Path, user_dirs)):
        subs = (
            [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))]
            if root.is_dir()
            else []
        )
        for sub in subs:
            options = {f.stem for f in sub.glob("*.yaml")}
            if options and sub.name != "hydra":  # hydra/<group> options are Hydra's own (see _check_hydra)
                groups.setdefault(sub.name, set()).update(options)
    return {group: sorted(options) for group, options in sorted(groups.items())}


def search_entries(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the entries of a `hydra.searchpath=[...]` override, the other overrides)."""
    entries: list[str] = []
    rest: list[str] = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.lstrip("+") == "hydra.searchpath":
            value = value.replace("\\:", ":")  # a sweep point writes file\:// (Hydra's escaping)
            entries += [e.strip().strip("'\"") for e in value.strip().strip("[]").split(",") if e.strip()]
        else:
            rest.append(override)
    return entries, rest


def user_dirs(overrides: list[str], source: ConfigSource) -> tuple[str, ...]:
    """The user's config directories: each `hydra.searchpath` entry (file:// or pkg://), then `--config-dir`."""
    dirs = []
    for entry in search_entries(overrides)[0]:
        scheme, sep, where = entry.partition("://")
        if sep and scheme == "pkg":
            dirs.append(str(resources.files(where.replace("/", "."))))
        else:
            dirs.append(str(Path(where if sep else entry).resolve()))
    if source.config_dir:
        dirs.append(str(Path(source.config_dir).resolve()))
    return tuple(dirs)


def check_overrides(overrides: list[str], dirs: tuple[str, ...] = ()) -> list[SpecError]:
    """Unknown groups, options and keys, and values of the wrong type, among command-line overrides."""
    return override_checks.check(overrides, groups=group_options(dirs), shipped=group_options())


def compose(overrides: list[str], source: ConfigSource | None = None) -> DictConfig:
    """Compose the config Hydra would build for these overrides, with the hydra node attached."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir, initialize_config_module

    register_schemas()
    source = source or ConfigSource()
    init = (
        initialize_config_dir(config_dir=str(Path(source.config_path).resolve()), version_base="1.3")
        if source.config_path
        else initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3")
    )
    dirs = user_dirs(overrides, source)
    if dirs:  # one searchpath: --config-dir joins the user's own entries instead of replacing them
        overrides = [
            *search_entries(overrides)[1],
            f"hydra.searchpath=[{','.join('file://' + d for d in dirs)}]",
        ]
    with init:
        return hydra_compose(config_name=source.config_name, overrides=overrides, return_hydra_config=True)


def compose_checked(overrides: list[str], source: ConfigSource) -> tuple[DictConfig | None, list[SpecError]]:
    """Check the overrides against the schema, then compose: the config, or every problem found."""
    dirs = user_dirs(overrides, source)
    missing = [d for d in dirs if not Path(d).is_dir()]
    if missing:
        return None, [
            SpecError(
                ("hydra.searchpath",),
                f"config directory {missing[0]} does not exist. Give --config-dir (or hydra.searchpath) "
                "a directory laid out like conf/: <group>/<option>.yaml, experiment/<name>.yaml.",
            )
        ]
    errors = check_overrides(overrides, dirs) if source.shipped else []
    if errors:
        return None, errors
    try:
        cfg = compose(overrides, source)
    except Exception as err:  # Hydra's composition errors: a missing option file, a bad interpolation, ...
        return None, [composition_error(err)]
    errors = (
        override_checks.check_hydra_node(cfg) + override_checks.check_file_bools(cfg)
        if source.shipped
        else []
    )
    return (None, errors) if errors else (cfg, [])


def schema_problems(cfg: DictConfig) -> list[SpecError]:
    """Keys the schema does not define and mandatory values nobody set (before anything reads the config)."""
    return unknown_keys(cfg) + missing_values(cfg)


def strip_hydra(cfg: DictConfig) -> DictConfig:
    """The run's own config, without Hydra's node."""
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg
    return cfg


@dataclass(frozen=True, kw_only=True)
class Built:
    """A composed config with every value the launcher decides written in, and the spec built from it once."""

    config: DictConfig
    """The composed config, enriched (Hydra's node kept: the dry run reads where each value came from)."""
    spec: RunSpec | None
    """The validated spec; None when `errors` holds problems."""
    errors: tuple[SpecError, ...] = ()
    """Every problem found: nothing may start."""

    def written(self, run_dir: Path) -> tuple[RunSpec, str]:
        """The spec as a rank reads it from `run_dir`, and the text of its spec.yaml (secrets redacted)."""
        assert self.spec is not None, "only a valid spec is written"
        spec = dataclasses.replace(self.spec, run_dir=str(run_dir))
        raw = with_values(strip_hydra(self.config), {"run_dir": str(run_dir)})
        return spec, spec_text(spec, run_dir / "spec.yaml", raw)


def enrich(cfg: DictConfig) -> tuple[DictConfig, list[SpecError]]:
    """The composed config with what the launcher decides written in, one pure step after another; or a step's problems.

    The launch backend (auto), the tokenizer (auto), add_bos and model.vocab_size, data.format (auto), a default
    warmup that does not fit the run, the reward files' digests and a folder model's real shape: spec.yaml then
    holds every decision.
    """
    from launcher.front.data_format import fill_format
    from launcher.front.model_dims import fill_folder_dims
    from launcher.front.reward_files import fill_digests
    from launcher.front.vocab import fill_vocab
    from launcher.front.warmup import fill_warmup_ratio, fit_warmup

    cfg = fill_backend(cfg)  # `auto` is decided here, once, before the rules
    cfg, errors = fill_vocab(cfg)
    if errors:
        return cfg, errors
    cfg, errors = fill_format(cfg)  # data.format=auto -> the first record's layout
    if errors:
        return cfg, errors
    cfg, errors = fill_warmup_ratio(cfg)  # scheduler.warmup_ratio -> its warmup_steps
    if errors:
        return cfg, errors
    cfg, errors = fill_digests(cfg)  # reward.functions -> each file's sha256, checked against a recorded one
    if errors:
        return cfg, errors
    return fill_folder_dims(fit_warmup(cfg)), []  # dims before the rules: they judge the model that trains


def fill_backend(cfg: DictConfig) -> DictConfig:
    """The config with launcher.backend=auto decided: inline for one rank without restarts, local otherwise."""
    from launcher.config.launcher import resolve_backend

    launcher = typed(cfg, "launcher")
    if launcher is None or launcher.backend != "auto":
        return cfg
    return with_values(cfg, {"launcher.backend": resolve_backend(launcher)})


def build(cfg: DictConfig) -> Built:
    """From a composed config to the validated spec: enrich the config, then build and check the spec once."""
    from launcher.front.deepspeed_file import adopt
    from launcher.rules import check, detect_hardware

    code = code_references(cfg) + resolvers(cfg)
    if code:
        return Built(config=cfg, spec=None, errors=tuple(code))
    cfg, conflicts = adopt(cfg)  # a user's DeepSpeed/accelerate file decides the keys nobody set
    errors = schema_problems(strip_hydra(cfg))
    if errors:
        return Built(config=cfg, spec=None, errors=tuple(conflicts + errors))
    cfg, errors = enrich(cfg)
    if errors:
        return Built(config=cfg, spec=None, errors=tuple(errors))
    try:
        spec = to_spec(strip_hydra(cfg))
    except InvalidSpec as err:
        return Built(config=cfg, spec=None, errors=tuple(conflicts + err.errors))
    errors = conflicts + check(spec, detect_hardware(spec)) + run_dir_held(spec)
    errors += override_checks.check_unread_optimizer_keys(cfg, spec.optimizer.name, errors)
    return Built(config=cfg, spec=None if errors else spec, errors=tuple(errors))


def run_dir_held(spec: RunSpec) -> list[SpecError]:
    """A live run holding the spec's run directory (its lock file, launch.run_lock), refused with the rules' problems.

    It reads the filesystem (and may ask the holder's scheduler), so it is judged here and not in the pure rules;
    another node of a multi-node job joins node 0's run, which holds the directory.
    """
    from launcher.launch import run_lock

    if spec.launcher.node_rank > 0 or spec.run_dir is None or not spec.run_dir.strip():
        return []
    reason = run_lock.conflict(Path(spec.run_dir))
    return [SpecError(("run_dir",), reason)] if reason is not None else []


def validate(cfg: DictConfig) -> tuple[RunSpec | None, list[SpecError]]:
    """Schema and cross-field rules on a composed config: the spec, or every violation found."""
    built = build(cfg)
    return built.spec, list(built.errors)


# Code the composed config may name: Hydra's own basic launcher and sweeper, which Hydra puts there, and the
# Optuna sweeper with its samplers (`train -m hydra/sweeper=optuna`, launcher.front.optuna_sweep).
ALLOWED_TARGETS = {
    "hydra.launcher._target_": ("hydra._internal.core_plugins.basic_launcher.BasicLauncher",),
    "hydra.sweeper._target_": (
        "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
        "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper",
    ),
    "hydra.sweeper.sampler._target_": tuple(
        f"optuna.samplers.{name}"
        for name in (
            "TPESampler",
            "RandomSampler",
            "CmaEsSampler",
            "NSGAIISampler",
            "MOTPESampler",
            "GridSampler",
        )
    ),
}
CODE_KEYS = ("_target_", "()")
"""Keys that make Hydra (`_target_`) or Python's logging config (`()`) import and call code."""


def code_references(cfg: DictConfig) -> list[SpecError]:
    """Every key anywhere in the composed config (the hydra node included) that would name code to run."""
    found: list[SpecError] = []

    def walk(node: typing.Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                child = f"{path}.{key}" if path else str(key)
                if key in CODE_KEYS and value not in ALLOWED_TARGETS.get(child, ()):
                    found.append(
                        SpecError(
                            (child,),
                            f"configs may not name code to import or call ({key}={value!r}): the launcher builds "
                            "every component from registered names, and Hydra callbacks and logging factories "
                            "are not run. Remove the key (from the command line or the config file's hydra: section).",
                        )
                    )
                walk(value, child)
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return found


ALLOWED_RESOLVERS = ("oc.env", "now")
"""Resolvers a run's values may call: an environment variable (secrets stay `${oc.env:VAR}` in spec.yaml), the time."""
_RESOLVER = re.compile(r"\$\{\s*([^${}:\s]+)\s*:")


def resolvers(cfg: DictConfig) -> list[SpecError]:
    """Every value of the run (the hydra node aside) that calls a resolver other than oc.env and now.

    `${oc.decode:...}`, `${oc.create:...}` and the like would build values past the schema's types, and
    an unknown one (`${python:...}`) names nothing that exists: both are refused, naming the key.
    References to other keys (`${data.seq_len}`) stay allowed.
    """
    found: list[SpecError] = []

    def walk(node: typing.Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if path or key != "hydra":
                    walk(value, f"{path}.{key}" if path else str(key))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")
        elif isinstance(node, str):
            called = sorted({name for name in _RESOLVER.findall(node) if name not in ALLOWED_RESOLVERS})
            if called:
                found.append(
                    SpecError(
                        (path,),
                        f"{node!r} calls the resolver {', '.join(called)}, which a run's values may not: only "
                        "${oc.env:VAR} (an environment variable, kept unresolved in spec.yaml), ${now:FORMAT} and "
                        "references to other keys (${data.seq_len}) are resolved. Give the value itself.",
                    )
                )

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return found


def composition_error(err: Exception) -> SpecError:
    """One paragraph from a Hydra composition error and its causes (Hydra's reason), naming the key when given."""
    chain: list[str] = []
    cause: BaseException | None = err
    while cause is not None and len(chain) < 5:
        if str(cause) and not any(str(cause) in earlier for earlier in chain):
            chain.append(str(cause))
        cause = cause.__cause__ or cause.__context__
    text = ":\n".join(chain)
    keys = [line.split("full_key:", 1)[1].strip() for line in text.splitlines() if "full_key:" in line]
    lines = [line.strip() for line in text.splitlines() if line.strip() and "full_key" not in line]
    message = " ".join(line for line in lines if not line.startswith(("reference_type", "object_type")))
    if "Error merging override ~" in text:
        message += (
            ". Every key of the schema stays in the spec, so none can be deleted: set it to another value "
            "(key=null where its type allows) instead of ~key."
        )
    elif re.search(r"In '([^/']+)/[^']*'.*Key '\1' not in", message):  # an experiment without its header
        message += ". A file of overrides (an experiment) sets top-level keys: put `# @package _global_` on its first line."
    return SpecError(tuple(keys[:1]) or ("config",), message)
