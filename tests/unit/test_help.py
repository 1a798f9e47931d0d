"""`train --help` and the README tell the same story: every exit status and `recipe=auto`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.exits import ExitStatus
from launcher.front import cli, compose, help_cache

README = Path(__file__).parents[2] / "README.md"


def _numbers(text: str) -> set[int]:
    return {int(n) for n in re.findall(r"(?<![\w.])(\d+)(?![\w.])", text)}


def test_help_and_readme_list_every_exit_status_and_recipe_auto(capsys) -> None:
    compose.register_schemas()
    with pytest.raises(SystemExit) as stopped:
        cli._hydra_print(["--help"])
    assert stopped.value.code == 0
    helptext = capsys.readouterr().out
    assert "train recipe=auto" in helptext
    listing = next(line for line in helptext.splitlines() if line.startswith("recipe: "))
    assert listing.split(": ", 1)[1].split(", ")[0] == "auto"  # recipe=auto picks one: listed too
    statuses = {int(status) for status in ExitStatus}
    assert statuses <= _numbers(helptext.split("Exit status:", 1)[1])
    readme = README.read_text()
    table = readme.split("Exit status (one table", 1)[1].split("\n- ", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.strip().startswith("| ")]
    assert statuses <= _numbers(" ".join(rows))
    assert "`recipe=auto`" in readme


_AFTER_HELP = """
import sys
sys.argv = ["train", "--help"]
from launcher.front.entry import main
try:
    main()
except SystemExit as stop:
    sys.stderr.write(f"exit={stop.code} hydra={'hydra' in sys.modules} spec={'launcher.spec' in sys.modules}\\n")
"""


def test_a_second_help_comes_from_the_cache_without_hydra(tmp_path) -> None:
    """The first `train --help` is Hydra's; the next prints the same text importing neither Hydra nor the schemas."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    runs = [
        subprocess.run([sys.executable, "-c", _AFTER_HELP], env=env, capture_output=True, text=True)
        for _ in "ab"
    ]
    first, second = runs
    assert first.stderr.strip().endswith("exit=0 hydra=True spec=True"), first.stderr[-2000:]
    assert second.stderr.strip().endswith("exit=0 hydra=False spec=False"), second.stderr[-2000:]
    assert second.stdout == first.stdout and "Exit status:" in second.stdout
    assert len(list((tmp_path / "torch-launcher" / "help").iterdir())) == 1
    assert not help_cache.cacheable(["--help", "--config-dir", "my_conf"])  # user files are not in the key
