"""Every code fence of README.md and docs/*.md is closed: one missing ``` turns the rest of a page into code.

Fences pair as CommonMark pairs them: a block opened by N backticks (or tildes) is closed by a line of
at least N of the same character and nothing else. A line that looks like an opening fence with a
language (```bash) inside an open block is reported too: it is almost always a block whose closing
fence went missing, so the two blocks render as one and the commands of the second as text.
"""

from __future__ import annotations

import re

import pytest
from doc_commands import REPO, doc_files

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def fence_problems(text: str) -> list[str]:
    """`line N: ...` for each fence that does not pair (an unclosed block, or an opening fence inside one)."""
    problems = []
    open_at, open_ticks = 0, ""
    for number, line in enumerate(text.splitlines(), start=1):
        match = FENCE.match(line)
        if not match:
            continue
        ticks, info = match.group(1), match.group(2).strip()
        if not open_ticks:
            open_at, open_ticks = number, ticks
        elif ticks[0] == open_ticks[0] and len(ticks) >= len(open_ticks) and not info:
            open_ticks = ""
        elif ticks[0] == open_ticks[0] and re.fullmatch(r"[\w-]+", info):
            problems.append(
                f"line {number}: {ticks}{info} opens a block inside the block opened at line {open_at}: "
                f"close that one with {open_ticks} first"
            )
    if open_ticks:
        problems.append(f"line {open_at}: the block opened here is never closed (add {open_ticks})")
    return problems


def test_fence_check_finds_an_unclosed_block_and_a_block_inside_a_block() -> None:
    assert fence_problems("a\n```bash\nls\n```\nb\n") == []
    assert fence_problems("````\n```\nshown\n```\n````\n") == []  # a fence shown inside a longer one
    assert fence_problems("```\nx\n```\n\n```\ny\n") == [
        "line 5: the block opened here is never closed (add ```)"
    ]
    assert fence_problems("```\nerror: ...\n\n```bash\nls\n```\n")[0].startswith(
        "line 4: ```bash opens a block"
    )


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_doc_code_fences_are_balanced(page) -> None:
    assert fence_problems(page.read_text()) == [], page
