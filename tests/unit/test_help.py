"""`train --help` and the README tell the same story: every exit status and `recipe=auto`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from launcher.exits import ExitStatus
from launcher.front import cli, compose

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
    statuses = {int(status) for status in ExitStatus}
    assert statuses <= _numbers(helptext.split("Exit status:", 1)[1])
    readme = README.read_text()
    table = readme.split("Exit status (one table", 1)[1].split("\n- ", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.strip().startswith("| ")]
    assert statuses <= _numbers(" ".join(rows))
    assert "`recipe=auto`" in readme
