"""The token cache holds a copy of the training data, so it is private: directories 0700, files 0600."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from launcher.components.data.tokens import build_cache, cache_root
from launcher.config.data import DataConfig
from launcher.config.tokenizer import TokenizerConfig


def _modes(root: Path) -> dict[str, int]:
    found = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        found[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return found


def _records(tmp_path: Path) -> str:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"record {i} " * 20}) + "\n" for i in range(50)))
    return str(path)


def test_a_corpus_and_the_datasets_files_are_readable_by_their_owner_only(tmp_path) -> None:
    old = os.umask(0o022)  # a common default: new files 0644
    try:
        cfg = DataConfig(kind="files", path=_records(tmp_path), cache_dir=str(tmp_path / "cache"))
        folder, built = build_cache(cfg, TokenizerConfig())
    finally:
        os.umask(old)
    assert built and (tmp_path / "cache" / "datasets").is_dir()
    modes = _modes(tmp_path / "cache")
    modes.pop(".")  # a folder named in data.cache_dir keeps its own mode
    wrong = {name: oct(mode) for name, mode in modes.items()
             if mode != (0o700 if (tmp_path / "cache" / name).is_dir() else 0o600)}  # fmt: skip
    assert len(modes) > 5 and not wrong, wrong


def test_the_default_cache_is_created_private_and_an_old_one_is_tightened(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cfg = DataConfig(kind="jsonl", path=_records(tmp_path))
    root = cache_root(cfg)
    old = root / "older-corpus"
    old.mkdir(parents=True, mode=0o755)
    (old / "train.tokens").write_bytes(b"x")
    os.chmod(old / "train.tokens", 0o644)
    for folder in (tmp_path / "xdg", tmp_path / "xdg" / "launcher", root, old):
        os.chmod(folder, 0o755)
    build_cache(cfg, TokenizerConfig())
    modes = _modes(root)
    wrong = {name: oct(mode) for name, mode in modes.items()
             if mode != (0o700 if (root / name).is_dir() else 0o600)}  # fmt: skip
    assert not wrong, wrong
