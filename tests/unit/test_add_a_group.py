"""docs/architecture.md's recipe "A config group", followed on a copy of the package: a throwaway group
`foo` added through the recipe's extension points (its schema module, the RunSpec field, conf/ options
and the defaults line, a rules area, a planner term) composes, is judged by its rule and priced by the
planner, with no other file touched. When the recipe misses a step, the copy fails here.
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
from package_copy import REPO, copy_package, edit, recipe_paths, run_python

RECIPE_HEADING = "**A config group**"

SCHEMA = '''
"""Schema of the foo group: a throwaway group that reserves a buffer."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("a", "b")


@dataclass(frozen=True, kw_only=True)
class FooConfig:
    """A throwaway group."""

    mode: str = "a"
    """a or b."""
    buffer_mb: int = 1
    """MiB each rank reserves (at least 1)."""
'''

RULES = '''
"""Rules of the foo group."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.config.foo import MODES
from launcher.rules.hardware import Hardware
from launcher.spec import RunSpec, SpecError


def _buffer(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    if spec.foo.buffer_mb < 1:
        yield SpecError(("foo.buffer_mb",), f"must be at least 1, got {spec.foo.buffer_mb}. Use foo.buffer_mb=1.")
    if spec.foo.mode not in MODES:
        yield SpecError(("foo.mode",), f"must be a or b, got {spec.foo.mode!r}.")


RULES = (_buffer,)
'''

TERM = '''

def foo_buffer(spec: RunSpec) -> tuple[int, str] | None:
    """The foo group's reserved buffer."""
    return spec.foo.buffer_mb * 2**20, f"foo buffer: {spec.foo.buffer_mb} MiB"


TERMS = (*TERMS, foo_buffer)
'''


def _follow_the_recipe(root: Path) -> set[str]:
    """Add group `foo` to the package copy at `root`; the repository paths the recipe touched."""
    pkg = root / "launcher"
    (pkg / "config" / "foo.py").write_text(SCHEMA)
    edit(
        pkg / "spec.py",
        "from launcher.config.distill import DistillConfig\n",
        "from launcher.config.foo import FooConfig\n",
    )
    edit(pkg / "spec.py", "    launcher: LauncherConfig = field(default_factory=LauncherConfig)\n",
          "    foo: FooConfig = field(default_factory=FooConfig)\n")  # fmt: skip
    (pkg / "conf" / "foo").mkdir()
    (pkg / "conf" / "foo" / "a.yaml").write_text("mode: a\nbuffer_mb: 1\n")
    (pkg / "conf" / "foo" / "b.yaml").write_text("mode: b\nbuffer_mb: 64\n")
    edit(pkg / "conf" / "train.yaml", '  - compile: "off"\n', "  - foo: a\n")
    (pkg / "rules" / "foo.py").write_text(RULES)
    edit(
        pkg / "rules" / "__init__.py",
        "from launcher.rules import compile as compiling\n",
        "from launcher.rules import foo\n",
    )
    edit(pkg / "rules" / "__init__.py", "AREAS = (\n", "    foo,\n")  # fmt: skip
    compression = pkg / "plan" / "compression.py"
    compression.write_text(compression.read_text() + TERM)
    return {
        "launcher/config/foo.py", "launcher/spec.py", "conf/foo/a.yaml", "conf/train.yaml",
        "launcher/rules/foo.py", "launcher/rules/__init__.py", "launcher/plan/compression.py",
    }  # fmt: skip


def _recipe_paths() -> set[str]:
    """The files docs/architecture.md's recipe names (with `foo` for the group and `a` for an option)."""
    return recipe_paths(RECIPE_HEADING, {"<option>": "a"})


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[str]]:
    root = copy_package(tmp_path_factory.mktemp("add_a_group"))
    return root, _follow_the_recipe(root)


def _train(root: Path, *args: str) -> subprocess.CompletedProcess:
    return run_python(root, "-m", "launcher", *args, timeout=240)


def test_the_recipe_names_every_file_it_takes(package_copy: tuple[Path, set[str]]) -> None:
    _, touched = package_copy
    missing = touched - _recipe_paths()
    assert not missing, f"docs/architecture.md's recipe does not name {sorted(missing)}"


def test_a_group_added_by_the_recipe_composes_and_is_planned(package_copy: tuple[Path, set[str]]) -> None:
    root, _ = package_copy
    out = _train(root, "foo=b", "dry_run=true")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "foo buffer: 64 MiB" in out.stdout, out.stdout


def test_a_group_added_by_the_recipe_is_judged_by_its_rule(package_copy: tuple[Path, set[str]]) -> None:
    root, _ = package_copy
    out = _train(root, "foo.buffer_mb=0", "dry_run=true")
    assert out.returncode == 2, out.stdout + out.stderr
    said = " ".join((out.stdout + out.stderr).split())
    assert "foo.buffer_mb" in said and "must be at least 1, got 0" in said, said
    unknown = _train(root, "foo=c", "dry_run=true")
    assert unknown.returncode == 2 and "foo" in unknown.stdout + unknown.stderr


def test_the_copy_is_the_package_itself() -> None:
    """The recipe's anchors exist in the real files (so the copy above follows today's code)."""
    assert "AREAS = (\n" in (REPO / "launcher" / "rules" / "__init__.py").read_text()
    assert "TERMS = (" in (REPO / "launcher" / "plan" / "compression.py").read_text()
    assert textwrap.dedent('  - compile: "off"\n') in (REPO / "conf" / "train.yaml").read_text()
