"""`train`'s command line, parsed once: Hydra's flags with their values, the overrides, and what they ask for.

One pass over the arguments splits the flags from the overrides and rewrites what Hydra would read
otherwise: `+group=option` / `+key=value` for known groups and keys become the bare form Hydra
needs (every group here has a default, see launcher.front.compose), and a relative `--config-path`
becomes absolute (Hydra would look for it beside its own module), and `--verbose` becomes the override
`log.verbose=true` (other libraries' chatter shown, launcher.components.quiet). Everything after that (the
pre-checks, recipe=auto, the sweep, the run) reads the one `CommandLine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from launcher.config.aliases import alias_hint
from launcher.front import override_checks
from launcher.front.compose import PRIMARY, ConfigSource, group_options
from launcher.spec import SpecError

VALUE_FLAGS = (
    "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
    "--cfg", "-c", "--package", "-p", "--info", "-i", "--experimental-rerun",
)  # fmt: skip
"""Hydra flags followed by a value that is not an override."""
MULTIRUN_FLAGS = ("--multirun", "-m")
CONFIG_FLAGS = VALUE_FLAGS[:6]
"""Where the primary config comes from: --config-path, --config-name, --config-dir (with their short forms)."""
RUN_FLAGS = (*MULTIRUN_FLAGS, "--run", "-r", *CONFIG_FLAGS)
"""Flags `train` itself runs with."""
PRINT_FLAGS = (
    "--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc", "--version",
)  # fmt: skip
"""Flags after which Hydra prints something and runs nothing: Hydra's own app handles them."""
CFG_FLAGS = ("--cfg", "-c")
VERBOSE_FLAG = "--verbose"
VERBOSE = "log.verbose=true"
"""The override `--verbose` stands for."""


@dataclass(frozen=True, kw_only=True)
class Flag:
    """One Hydra flag as given."""

    name: str
    """The flag, e.g. --config-path."""
    value: str | None
    """Its value (`--flag value` or `--flag=value`); None for a flag without one."""
    tokens: tuple[str, ...]
    """The arguments it took, as Hydra's app reads them."""


@dataclass(frozen=True, kw_only=True)
class CommandLine:
    """A parsed, normalized command line of `train`."""

    argv: tuple[str, ...]
    """Every argument in order, normalized: what Hydra's app is given."""
    flags: tuple[Flag, ...]
    """Hydra's flags, in order."""
    overrides: tuple[str, ...]
    """The key=value and group=option overrides, in order."""

    def flag(self, *names: str) -> str | None:
        """The value of the first of `names` given with a value."""
        return next((f.value for f in self.flags if f.name in names and f.value is not None), None)

    def has(self, names: Sequence[str]) -> bool:
        """Whether any of these flags was given."""
        return any(f.name in names for f in self.flags)

    @property
    def source(self) -> ConfigSource:
        """Where the primary config comes from (--config-path / --config-name / --config-dir)."""
        return ConfigSource(
            config_path=self.flag("--config-path", "-cp"),
            config_name=self.flag("--config-name", "-cn") or PRIMARY,
            config_dir=self.flag("--config-dir", "-cd"),
        )

    @property
    def multirun(self) -> bool:
        """Whether this is a sweep (--multirun / -m)."""
        return self.has(MULTIRUN_FLAGS)

    def unknown_flags(self) -> list[SpecError]:
        """Flags that `train` does not run with (the printing ones are handed to Hydra before this)."""
        return [_unknown_flag(f.name) for f in self.flags if f.name not in RUN_FLAGS]

    @property
    def verbose(self) -> bool:
        """Whether the command line asks for other libraries' chatter (`--verbose`, `log.verbose=true`)."""
        values = [
            o.partition("=")[2] for o in self.overrides if o.lstrip("+~").partition("=")[0] == "log.verbose"
        ]
        return bool(values) and values[-1].strip().lower() in ("true", "yes", "on", "1")

    def without_print_flags(self) -> CommandLine:
        """The command line a run would see: the printing flags (and their values) removed."""
        return _assemble([f for f in self.flags if f.name not in PRINT_FLAGS], self.overrides)

    def with_overrides(self, overrides: Sequence[str]) -> CommandLine:
        """The same flags with these overrides instead."""
        return _assemble(list(self.flags), overrides)


def parse(argv: Sequence[str]) -> CommandLine:
    """Split and normalize `train`'s arguments, in one pass."""
    flags: list[Flag] = []
    overrides: list[str] = []
    out: list[str] = []
    pending: Flag | None = None  # a value flag waiting for its value
    for arg in argv:
        if pending is not None:
            arg = _config_path(pending.name, arg)
            flags.append(Flag(name=pending.name, value=arg, tokens=(*pending.tokens, arg)))
            pending = None
        elif arg == VERBOSE_FLAG:
            arg = VERBOSE
            overrides.append(arg)
        elif arg.startswith("-"):
            name, sep, value = arg.partition("=")
            if sep:
                arg = f"{name}={_config_path(name, value)}"
                flags.append(Flag(name=name, value=arg.partition("=")[2], tokens=(arg,)))
            elif arg in VALUE_FLAGS:
                pending = Flag(name=arg, value=None, tokens=(arg,))
            else:
                flags.append(Flag(name=arg, value=None, tokens=(arg,)))
        else:
            arg = _bare(arg)
            overrides.append(arg)
        out.append(arg)
    if pending is not None:
        flags.append(pending)
    return CommandLine(argv=tuple(out), flags=tuple(flags), overrides=tuple(overrides))


def of(argv: CommandLine | Sequence[str]) -> CommandLine:
    """A command line as given, or parsed from its arguments."""
    return argv if isinstance(argv, CommandLine) else parse(argv)


def normalize(argv: Sequence[str]) -> list[str]:
    """The arguments as Hydra's app is given them (see `parse`)."""
    return list(parse(argv).argv)


def _assemble(flags: list[Flag], overrides: Sequence[str]) -> CommandLine:
    """A command line of these flags, then these overrides."""
    tokens = [token for f in flags for token in f.tokens]
    return CommandLine(argv=(*tokens, *overrides), flags=tuple(flags), overrides=tuple(overrides))


def _config_path(flag: str, value: str) -> str:
    """A relative --config-path made absolute: Hydra reads a relative one from its own package."""
    if flag in ("--config-path", "-cp") and "://" not in value:
        return str(Path(value).resolve())
    return value


def _bare(arg: str) -> str:
    """`+group=option` / `+key=value` as `group=option` when the group or key exists (Hydra needs the bare form)."""
    key, sep, value = arg.partition("=")
    plain = key[1:]
    if not sep or not key.startswith("+") or key.startswith("++"):
        return arg
    known = plain in group_options() or override_checks.field_type(plain)[0] is not None
    return f"{plain}={value}" if known else arg


def _unknown_flag(name: str) -> SpecError:
    """The problem of a flag `train` does not run with, naming our key where it is another tool's flag."""
    hint = alias_hint(name)
    foreign = f" `{name}` is another tool's flag: {hint}." if hint else ""
    return SpecError(
        ("command line",),
        f"{name} is not a flag `train` runs with.{foreign} Flags: --multirun/-m, --config-path, "
        "--config-name, --config-dir, --verbose, and the ones that only print (--help, --cfg job, --info); "
        "settings are key=value overrides; see `train --help`.",
    )
