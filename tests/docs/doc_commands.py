"""The shell command blocks of README.md and docs/*.md, and the few rules that make them quick to run.

A block is a fenced ```bash, ```sh or ```console block (in a console block only the lines that start
with `$ ` are commands). An HTML comment on the line before the fence, invisible on a rendered page,
keeps the tests from running it and says why (docs/architecture.md, "Commands in the docs"):

    <!-- docs-test: skip (needs a GPU) -->

Substitution rules, the only differences between a block as a reader runs it and as a test runs it:

1. `train` (and `torchrun ... -m launcher`) is a wrapper (`quick_argv`) that appends
   `log.progress=false` and `train.stop_after=3`: the run is the one written (its whole schedule,
   warmup, checkpoint and eval cadence are validated as written) and ends after 3 steps with a
   checkpoint. Commands that are quick already (`train.max_steps` of 50 or less), `verify_resume`
   or `dry_run` get `log.progress=false` alone, and those that only print (`--help`, `--cfg`) nothing.
2. A page's blocks run in order with `bash -e` in one temporary directory (relative run directories
   land there), which holds links to the repository's `scripts/` and `tests/` and the tiny Hugging
   Face assets of docs/hf_models.md in `tiny/` (`scripts/make_tiny_hf_assets tiny`, made once).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHELL_LANGS = ("bash", "sh", "console", "shell")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w-]*)")
MARK = re.compile(r"<!--\s*docs-test:\s*skip\s*(?:\((.*?)\))?\s*-->")
PRINT_FLAGS = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i")
STOP_AFTER = 3
"""Steps a doc's training command runs in a test before it stops with a checkpoint."""
SHORT_RUN = 50
"""A command that sets train.max_steps to this or less is already a quick try: it runs as written."""


@dataclass(frozen=True)
class Command:
    """One logical command: continuation lines joined, comments dropped."""

    line: int
    """1-based line of the command's first line in its file."""
    text: str
    """The command as the shell reads it."""

    def argv(self) -> list[str]:
        """The command's words as the shell splits them (without expanding variables)."""
        return shlex.split(self.text, comments=True)


@dataclass(frozen=True)
class Block:
    """A fenced shell block of a markdown file and its docs-test mark."""

    path: str
    """The file, relative to the repository."""
    line: int
    """1-based line of the opening fence."""
    lang: str
    body: str
    skip: str | None = None
    """Why the tests do not run it (its docs-test skip mark), or None."""

    @property
    def name(self) -> str:
        """`file:line`, the block's test id."""
        return f"{self.path}:{self.line}"

    def commands(self) -> list[Command]:
        """The block's commands, in order."""
        out: list[Command] = []
        pending, first = "", 0
        for offset, raw in enumerate(self.body.splitlines(), start=self.line + 1):
            line = raw.strip()
            if self.lang == "console" and not pending:
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not pending:
                first = offset
            if line.endswith("\\"):
                pending += line[:-1].rstrip() + " "
                continue
            text = _without_comment(pending + line).strip()
            pending = ""
            if text:
                out.append(Command(first, text))
        return out

    def script(self) -> str:
        """The block as a bash script (a console block: its commands only)."""
        if self.lang != "console":
            return self.body
        return "\n".join(c.text for c in self.commands()) + "\n"


def _without_comment(text: str) -> str:
    """`text` without a trailing shell comment (a `#` that starts a word, outside quotes)."""
    quote = ""
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i]
    return text


def blocks(text: str, path: str = "<string>") -> list[Block]:
    """Every fenced shell block of markdown `text`, with the mark on the line before its fence."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, ticks, lang = fence.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks), len(lines))
        if lang in SHELL_LANGS:
            mark = MARK.search(lines[i - 1]) if i else None
            body = "\n".join(line.removeprefix(indent) for line in lines[i + 1 : end]) + "\n"
            out.append(Block(path, i + 1, lang, body, (mark.group(1) or "marked skip") if mark else None))
        i = end + 1
    return out


def doc_files() -> list[Path]:
    """README.md and every docs/*.md page."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def all_blocks() -> list[Block]:
    """The shell blocks of every documentation page."""
    return [b for f in doc_files() for b in blocks(f.read_text(), str(f.relative_to(REPO)))]


def _key(arg: str) -> str:
    return arg.lstrip("+~").split("=", 1)[0]


def quick_argv(argv: list[str]) -> list[str]:
    """`sys.argv` of `train ARGS` or `torchrun ... -m launcher ARGS` under rule 1 of the module docstring."""
    if "launcher" in argv and argv[argv.index("launcher") - 1] == "-m":
        cut = argv.index("launcher") + 1
        return [*argv[:cut], *_quick(argv[cut:])]
    if Path(argv[0]).name == "torchrun":
        return argv
    return [argv[0], *_quick(argv[1:])]


def _quick(argv: list[str]) -> list[str]:
    """`train`'s own arguments under rule 1."""
    values = {_key(a): a.split("=", 1)[1] for a in argv if "=" in a and not a.startswith("-")}
    quiet = [*argv, "log.progress=false"]
    if any(a.split("=", 1)[0] in PRINT_FLAGS for a in argv):
        return argv
    if values.get("verify_resume", "false") != "false" or values.get("dry_run", "false") != "false":
        return quiet
    steps = values.get("train.max_steps")
    if steps is not None and steps.isdigit() and int(steps) <= SHORT_RUN:
        return quiet
    return [*quiet, f"train.stop_after={STOP_AFTER}"]


def train_commands(block: Block) -> list[Command]:
    """The block's `train` commands whose words are known without running the shell (no `$`, loops, pipes)."""
    return [
        c
        for c in block.commands()
        if c.argv()[:1] == ["train"] and not re.search(r"[$`|;&<>]|\.\.\.", c.text)
    ]
