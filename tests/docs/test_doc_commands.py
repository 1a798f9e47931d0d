"""The shell commands of README.md and docs/*.md run as written (tests/docs/doc_commands.py: marks and rules).

Two tiers:
- default suite: every `train` command of every block not marked skip is composed and validated in
  this process (`cli.precheck`, what `train` does before it starts anything), next to the tiny
  Hugging Face assets, so a wrong key, option or refused combination in a doc fails here in seconds;
- every block not marked skip runs for real under the substitution rules, a page's blocks in order in
  one temporary directory: the quick pages (QUICK_PAGES) in the default suite, the rest under `-m docs`
  (deselected by default: about 18 minutes on 2 cores).
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import os
import re
import stat
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from doc_commands import REPO, Block, all_blocks, blocks, quick_argv, train_commands
from rich.console import Console

from launcher.front import command_line, recipe_auto
from launcher.front.cli import precheck

BLOCKS = all_blocks()
BIN = Path(sys.executable).parent
# The guard matters: ranks started with multiprocessing's spawn import this file again as __mp_main__.
WRAPPER = """#!{python}
import sys
if __name__ == "__main__":
    sys.path.insert(0, {here!r})
    from doc_commands import quick_argv
    sys.argv = quick_argv(sys.argv)
    from {main} import main
    main()
"""


def _param(block: Block) -> object:
    marks = [pytest.mark.skip(reason=block.skip)] if block.skip else []
    return pytest.param(block, id=block.name, marks=marks)


def _make_assets(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`scripts/make_tiny_hf_assets OUT`, in this process: the tiny Llama folder and records of docs/hf_models.md."""
    loader = importlib.machinery.SourceFileLoader(
        "make_tiny_hf_assets", str(REPO / "scripts" / "make_tiny_hf_assets")
    )
    script = types.ModuleType(loader.name)
    loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", ["make_tiny_hf_assets", str(folder)])
    script.main()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Iterator[Path]:
    """A directory like a fresh clone's user would run from: scripts/ and tests/ reachable, the tiny assets in tiny/."""
    root = tmp_path_factory.mktemp("docs")
    for name in ("scripts", "tests"):
        (root / name).symlink_to(REPO / name)
    with pytest.MonkeyPatch.context() as monkeypatch:
        _make_assets(root / "tiny", monkeypatch)
    yield root


def problems(block: Block) -> list[str]:
    """Each problem `train` would report (exit 2) for the block's statically known `train` commands.

    A command that reads what an earlier command of the block makes (a run directory for
    `distill.teacher=`, a file written with `>`) is left to the run tier: it exists once that ran.
    """
    found, made, checked = [], set(), train_commands(block)
    for command in block.commands():
        args = command.argv()[1:]
        if command in checked and not {a.split("=", 1)[1] for a in args if "=" in a} & made:
            argv = recipe_auto.resolve(command_line.parse(args), console=Console(quiet=True))
            found += [f"{block.path}:{command.line}: {command.text}\n  {e}" for e in precheck(argv)]
        made |= {a.split("=", 1)[1] for a in args if a.startswith("run_dir=")}
        made |= set(re.findall(r">\s*([^\s;&|]+)", command.text))
    return found


def test_extractor_reads_blocks_marks_and_continuations() -> None:
    md = (
        "text\n```bash\ntrain a=1 \\\n  b=2   # comment\n# only a comment\ntrain-export R O\n```\n"
        "<!-- docs-test: skip (needs a GPU) -->\n```sh\ntrain launcher.device=cuda\n```\n"
        "```console\n$ train x=1\nsome output # not a command\n```\n```python\nprint('no')\n```\n"
        "<!-- docs-test: skip -->\n```bash\ntrain 'data.path=a b#c'\n```\n"
    )
    found = blocks(md, "doc.md")
    assert [(b.line, b.lang, b.skip) for b in found] == [
        (2, "bash", None), (9, "sh", "needs a GPU"), (12, "console", None), (20, "bash", "marked skip"),
    ]  # fmt: skip
    assert [(c.line, c.text) for c in found[0].commands()] == [(3, "train a=1 b=2"), (6, "train-export R O")]
    assert found[2].script() == "train x=1\n"
    assert found[3].commands()[0].argv() == ["train", "data.path=a b#c"]


def test_quick_argv_stops_early_unless_the_run_is_short_or_special() -> None:
    quick = ["log.progress=false", "train.stop_after=3"]
    assert quick_argv(["train", "model.n_layer=2"]) == ["train", "model.n_layer=2", *quick]
    assert quick_argv(["torchrun", "--nproc_per_node=2", "-m", "launcher", "a=1"])[-3:] == ["a=1", *quick]
    assert quick_argv(["train", "train.max_steps=50"])[-1] == "log.progress=false"
    assert quick_argv(["train", "train.max_steps=1000"])[-1] == "train.stop_after=3"
    assert quick_argv(["train", "verify_resume=true", "train.max_steps=40"])[-1] == "log.progress=false"
    assert quick_argv(["train", "dry_run=true"])[-1] == "log.progress=false"
    assert quick_argv(["train", "--cfg", "job"]) == ["train", "--cfg", "job"]


def test_a_broken_doc_command_is_reported_with_its_line() -> None:
    md = (
        "```bash\ntrain optimizer.lr=1e-3 run_dir=runs/t\ntrain train.max_stepz=10   # a typo\ntrain $ARGS\n"
        "train distill=kd distill.teacher=runs/t\necho {} > ds.json\ntrain parallel=zero2 parallel.deepspeed_config=ds.json\n```\n"
    )
    (block,) = blocks(md, "doc.md")
    lines = [c.line for c in train_commands(block)]
    assert lines == [2, 3, 5, 7]  # `$ARGS` is known only to a shell: the run tier covers it
    (problem,) = problems(block)
    assert problem.startswith("doc.md:3: train train.max_stepz=10") and "Did you mean max_steps?" in problem


def test_the_docs_have_shell_blocks() -> None:
    assert len(BLOCKS) >= 30 and all(b.skip != "marked skip" for b in BLOCKS)  # each skip says why


def test_doc_programs_exist() -> None:
    """Each `train*` program a block runs is a console script, each `scripts/...` a file of the repository."""
    scripts = importlib.metadata.entry_points(group="console_scripts").names
    missing = [
        f"{b.name}: {word}"
        for b in BLOCKS
        if not b.skip
        for c in b.commands()
        for word in c.argv()[:1]
        if (word.startswith("train") and word not in scripts)
        or (word.startswith("scripts/") and not (REPO / word).is_file())
    ]
    assert not missing, f"documented programs that do not exist: {missing}"


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS if train_commands(b)])
def test_doc_train_commands_validate(block: Block, workdir: Path, monkeypatch) -> None:
    monkeypatch.chdir(workdir)
    found = problems(block)
    assert not found, "a documented command is refused:\n" + "\n".join(found)


def _wrappers(folder: Path) -> Path:
    """A bin/ folder whose `train` and `torchrun ... -m launcher` apply the quick rules."""
    folder.mkdir(exist_ok=True)
    for name, main in (("train", "launcher.front.entry"), ("torchrun", "torch.distributed.run")):
        wrapper = folder / name
        wrapper.write_text(WRAPPER.format(python=sys.executable, here=str(Path(__file__).parent), main=main))
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return folder


PAGES = sorted({b.path for b in BLOCKS if not b.skip})
QUICK_PAGES = ("README.md", "docs/memory.md", "docs/monitoring.md")
"""Pages whose blocks run in seconds (10-15 s each on 2 cores): they run for real in the default suite too."""


def _page(page: str) -> object:
    marks = [] if page in QUICK_PAGES else [pytest.mark.docs, pytest.mark.slow]
    return pytest.param(page, id=page, marks=marks)


@pytest.mark.parametrize("page", [_page(p) for p in PAGES])
def test_doc_page_runs(page: str, workdir: Path, tmp_path: Path) -> None:
    """A page's blocks, in order, in one directory (a later block may use what an earlier one made)."""
    for item in workdir.iterdir():  # the fresh-clone directory: scripts/, tests/, tiny/
        (tmp_path / item.name).symlink_to(item)
    env = {**os.environ, "PATH": f"{_wrappers(tmp_path / '.bin')}:{BIN}:{os.environ['PATH']}"}
    for block in (b for b in BLOCKS if b.path == page and not b.skip):
        result = subprocess.run(
            ["bash", "-e", "-x", "-c", block.script()],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        assert result.returncode == 0, f"{block.name} failed:\n{result.stderr[-6000:]}"
