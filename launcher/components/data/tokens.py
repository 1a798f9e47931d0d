"""Tokenize once: records -> token ids and flags, split into train and val, kept in a cache for reuse.

A corpus is two TokenStores (train, val): 1-D token ids plus 1-D flags, TRAINED (the token is a
training target: prompts are not) and START (the first token of a document). Tokenization
streams: records are encoded in chunks (in `data.num_proc` processes) and appended to files, so
no process holds the corpus as Python objects. A cached corpus lives in
`<cache_dir>/<key>/` (key: a hash of the tokenizer's files, the source files' names, sizes and
modification times, and every option that changes the tokens); the ranks memory-map it.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from launcher.components.data.formats import encode_records
from launcher.components.data.private_files import make_private, private_dirs, private_umask
from launcher.components.data.sources import records, source_files
from launcher.components.data.split import Splitter
from launcher.components.data.tokenizer import Tokenizer, fingerprint, load_tokenizer
from launcher.components.files.token_cache import read_folder, read_meta
from launcher.config.data import DataConfig
from launcher.config.tokenizer import TokenizerConfig

if TYPE_CHECKING:  # torch only where a rank reads the corpus: tokenizing before launch needs only numpy
    import torch

TRAINED = 1
"""Flag bit: the token is a training target (its label is kept)."""
START = 2
"""Flag bit: the token begins a document."""
FORMAT_VERSION = 4
"""Bumped when the cache layout or the tokenization (or split) rules change, so old caches are not reused.

2: a data.path of fewer than split.HASH_SPLIT_MIN_DOCUMENTS documents holds out its tail, not hashed documents.
3: conversations honour per-turn training flags (weight, train, train_detail) and render reasoning traces.
4: a preference or kto record's blank response keeps no trained token (not even EOS): the pair checks see it.
"""
CHUNK_RECORDS = 256


@dataclass(frozen=True)
class TokenStore:
    """One side of the corpus: token ids and per-token flags, equally long."""

    tokens: torch.Tensor
    """1-D token ids (uint8 for the bytes tokenizer, int32 otherwise)."""
    flags: torch.Tensor
    """1-D uint8: TRAINED | START bits per token."""

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def of_stream(cls, tokens: torch.Tensor, separator: int | None = 0) -> TokenStore:
        """Every token trained; a document starts at 0 and after each `separator` (None: one document)."""
        import torch

        starts = torch.zeros(len(tokens), dtype=torch.bool)
        if len(tokens):
            starts[0] = True
        if separator is not None and len(tokens) > 1:
            starts[1:] |= tokens[:-1] == separator
        return cls(
            tokens, torch.full((len(tokens),), TRAINED, dtype=torch.uint8) | starts.to(torch.uint8) * START
        )


@dataclass(frozen=True)
class Corpus:
    """The corpus as train and held-out token stores."""

    train: TokenStore
    val: TokenStore


def uses_cache(cfg: DataConfig, tok: TokenizerConfig) -> bool:
    """Whether the corpus is tokenized once into the cache: records (jsonl, files), the standard library's
    source (the default job), a real tokenizer, or cache_dir set.

    The default job's 11 MB of stdlib source took about 0.5 s to read and encode before every run
    (1.5 s on a busy machine) against 0.05-0.12 s to memory-map from the cache, the same tokens;
    one plain text file (data.kind=text) is read again each run; prompts (data.format=prompt) are read by
    each rank as it starts (launcher.components.data.prompts).
    """
    if cfg.format == "prompt":
        return False
    return tok.reads_folder or cfg.kind in ("jsonl", "files", "stdlib") or cfg.cache_dir is not None


def cache_root(cfg: DataConfig) -> Path:
    """data.cache_dir, else $XDG_CACHE_HOME/launcher/tokens."""
    if cfg.cache_dir:
        return Path(cfg.cache_dir)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "launcher" / "tokens"


def cache_key(cfg: DataConfig, tok: TokenizerConfig) -> str:
    """A hash of everything that decides the tokens: tokenizer files, source files' stats, options."""
    digest = hashlib.sha256(f"v{FORMAT_VERSION}:{fingerprint(tok)}".encode())
    options = {
        k: v
        for k, v in asdict(cfg).items()
        if k
        not in (
            "batching",
            "max_tokens_per_batch",
            "num_workers",
            "num_proc",
            "cache_dir",
            "packing",
            "document_mask",
            "sources",  # a mixture caches each source under its own key (groups/data/mixture.py)
        )
    }
    digest.update(json.dumps(options, sort_keys=True).encode())
    for path in source_files(cfg):
        stat = path.stat()
        digest.update(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:24]


def _dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint8) if vocab_size <= 256 else np.dtype(np.int32)


class _Side:
    """Appends one side's tokens and flags to two files."""

    def __init__(self, folder: Path, name: str, dtype: np.dtype, cap: int | None) -> None:
        self.tokens_path, self.flags_path = folder / f"{name}.tokens", folder / f"{name}.flags"
        self.tokens, self.flags = self.tokens_path.open("wb"), self.flags_path.open("wb")
        self.dtype, self.cap, self.size = dtype, cap, 0

    @property
    def full(self) -> bool:
        return self.cap is not None and self.size >= self.cap

    def add(self, ids: np.ndarray, trained: np.ndarray) -> None:
        """Append one encoded document: its ids, and per token whether it is trained."""
        if len(ids):
            self._write(ids, trained.astype(np.uint8) * np.uint8(TRAINED))

    def append(self, tokens: np.ndarray, flags: np.ndarray) -> None:
        """Append a piece of a token stream whose first token begins a document."""
        self._write(tokens, flags.copy())

    def _write(self, tokens: np.ndarray, flags: np.ndarray) -> None:
        flags[0] |= START
        self.tokens.write(tokens.astype(self.dtype, copy=False).tobytes())
        self.flags.write(flags.tobytes())
        self.size += len(tokens)

    def close(self) -> None:
        self.tokens.close()
        self.flags.close()


def _budgets(cfg: DataConfig) -> tuple[int | None, int | None]:
    """(train, val) token caps that split max_bytes in proportion, val holding at least one sequence."""
    if cfg.max_bytes is None:
        return None, None
    val = max(round(cfg.max_bytes * cfg.val_fraction), min(cfg.seq_len + 1, cfg.max_bytes // 2))
    return cfg.max_bytes - val, val


_worker: dict[str, Any] = {}


def _init_worker(cfg: DataConfig, tok_cfg: TokenizerConfig) -> None:
    _worker.update(cfg=cfg, tok_cfg=tok_cfg, tokenizer=load_tokenizer(tok_cfg))


def _encode_chunk(chunk: list[tuple[str, str, Any]]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(key, ids, trained) of each record of a chunk, its texts encoded in one tokenizer call."""
    cfg, tok_cfg, tokenizer = _worker["cfg"], _worker["tok_cfg"], _worker["tokenizer"]
    encoded = encode_records([(where, record) for _, where, record in chunk], cfg, tok_cfg, tokenizer)
    return [(key, *pair) for (key, _, _), pair in zip(chunk, encoded, strict=True)]


def _chunks(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


@contextmanager
def _serial_tokenizers() -> Iterator[None]:
    """Processes forked inside run the fast tokenizer on one thread each (TOKENIZERS_PARALLELISM=false), so
    num_proc processes use num_proc cores and the tokenizer's threads, used before, are not forked."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _encoded(
    cfg: DataConfig, tok_cfg: TokenizerConfig, cache_dir: Path
) -> Iterator[tuple[str, str, np.ndarray, np.ndarray]]:
    """(side, key, ids, trained) per record: side 'train' or 'val', decided by val_path or the key's hash.

    One process encodes a chunk per tokenizer call (the fast tokenizer spreads it over the cores);
    data.num_proc > 1 hands contiguous chunks to that many single-threaded processes and takes their
    results back in order, so the output is the same for every num_proc.
    """
    sources = [("train", cfg.path)] + ([("val", cfg.val_path)] if cfg.val_path else [])
    for side, pattern in sources:
        chunks = _chunks(records(cfg, pattern, cache_dir), CHUNK_RECORDS)
        if cfg.num_proc <= 1:
            _init_worker(cfg, tok_cfg)
            encoded = map(_encode_chunk, chunks)
            yield from ((side, *item) for chunk in encoded for item in chunk)
            continue
        context = multiprocessing.get_context("fork")
        with _serial_tokenizers():
            pool = context.Pool(cfg.num_proc, _init_worker, (cfg, tok_cfg))
        with pool:
            window = cfg.num_proc * 4  # chunks in flight: bounded memory whatever the corpus size
            pending = []
            for chunk in chunks:
                pending.append(pool.apply_async(_encode_chunk, (chunk,)))
                if len(pending) >= window:
                    yield from ((side, *item) for item in pending.pop(0).get())
            for result in pending:
                yield from ((side, *item) for item in result.get())


def _ensure_val(folder: Path, sizes: dict[str, int], cfg: DataConfig, dtype: np.dtype) -> None:
    """Make val hold at least one sequence: move trailing train documents (or a tail of the last one) there."""
    one_sequence = cfg.seq_len + 1
    if sizes["val"] >= one_sequence or sizes["train"] == 0 or cfg.val_path:
        return
    need = max(one_sequence, int((sizes["train"] + sizes["val"]) * cfg.val_fraction))
    flags = np.fromfile(folder / "train.flags", dtype=np.uint8)
    tokens = np.fromfile(folder / "train.tokens", dtype=dtype)
    cut = max(len(tokens) - need, 0)
    starts = np.flatnonzero(flags[: cut + 1] & START)
    starts = starts[starts > 0]
    if len(starts):
        cut = int(starts[-1])
    else:  # one document: hold out its tail, as many tokens as the share asks (at least one sequence)
        cut = max(len(tokens) - max(need - sizes["val"], int(len(tokens) * cfg.val_fraction)), 0)
    moved_flags = flags[cut:].copy()
    moved_flags[0] |= START
    val_tokens = np.concatenate([tokens[cut:], np.fromfile(folder / "val.tokens", dtype=dtype)])
    val_flags = np.concatenate([moved_flags, np.fromfile(folder / "val.flags", dtype=np.uint8)])
    tokens[:cut].tofile(folder / "train.tokens")
    flags[:cut].tofile(folder / "train.flags")
    val_tokens.tofile(folder / "val.tokens")
    val_flags.tofile(folder / "val.flags")
    sizes.update(train=cut, val=len(val_tokens))


def _write(
    folder: Path,
    cfg: DataConfig,
    tok_cfg: TokenizerConfig,
    tokenizer: Tokenizer,
    cache_dir: Path,
    progress: Any = None,
) -> dict[str, Any]:
    """Tokenize the source into `folder`; the meta record (sizes, dtype, counts)."""
    dtype = _dtype(tokenizer.vocab_size)
    caps = dict(zip(("train", "val"), _budgets(cfg), strict=True))
    sides = {name: _Side(folder, name, dtype, caps[name]) for name in ("train", "val")}
    splitter = Splitter(sides, None if cfg.val_path else _Side(folder, "head", dtype, None), cfg.val_fraction)
    try:
        for side, key, ids, trained in _encoded(cfg, tok_cfg, cache_dir):
            if progress is not None:
                progress(len(ids))
            if not splitter.add(side, key, ids, trained):
                break
        few_documents = splitter.few_documents
        if few_documents:  # the tail of the stream is held out (split.py says why)
            splitter.split_tail(cfg.max_bytes, cfg.seq_len)
    finally:
        for s in [*sides.values(), *([splitter.head] if splitter.head else [])]:
            s.close()
    sizes = {name: s.size for name, s in sides.items()}
    for name, cap in caps.items():  # a cap cuts the last document
        if cap is not None and sizes[name] > cap and not few_documents:
            for suffix, size in (("tokens", dtype.itemsize), ("flags", 1)):
                os.truncate(folder / f"{name}.{suffix}", cap * size)
            sizes[name] = cap
    if sizes["train"] == 0 and sizes["val"] == 0:
        raise ValueError("the corpus holds no tokens: every record is empty.")
    if not few_documents:
        _ensure_val(folder, sizes, cfg, dtype)
    return {
        "dtype": dtype.str,
        "sizes": sizes,
        "num_documents": splitter.num_documents,
        "split": "val_path" if cfg.val_path else "tail" if few_documents else "hash",
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
    }


def _read(folder: Path, meta: dict[str, Any], *, mmap: bool) -> Corpus:
    import torch

    dtype = np.dtype(meta["dtype"])
    stores = {}
    for name in ("train", "val"):
        if mmap and meta["sizes"][name]:
            tokens = np.memmap(folder / f"{name}.tokens", dtype=dtype, mode="c")
            flags = np.memmap(folder / f"{name}.flags", dtype=np.uint8, mode="c")
        else:
            tokens = np.fromfile(folder / f"{name}.tokens", dtype=dtype)
            flags = np.fromfile(folder / f"{name}.flags", dtype=np.uint8)
        stores[name] = TokenStore(torch.from_numpy(tokens), torch.from_numpy(flags))
    return Corpus(train=stores["train"], val=stores["val"])


def cached_path(cfg: DataConfig, tok: TokenizerConfig) -> Path:
    """The folder the tokenized corpus of these settings lives in (whether or not it exists yet)."""
    return cache_root(cfg) / cache_key(cfg, tok)


def build_cache(
    cfg: DataConfig, tok_cfg: TokenizerConfig, progress: Any = None, *, check_contents: bool = True
) -> tuple[Path, bool]:
    """Tokenize into the cache unless it holds this corpus already; (folder, built now).

    A folder already there is checked first (launcher.components.files.token_cache; `check_contents`:
    every id and flag too, which the launching process does once): a damaged one is refused (RefusedFile).
    """
    folder = cached_path(cfg, tok_cfg)
    if (folder / "meta.json").is_file():
        read_folder(folder, contents=check_contents)
        return folder, False
    private_dirs(folder.parent)
    if not cfg.cache_dir:
        make_private(folder.parent)  # the default cache: every corpus in it (private_files)
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        with private_umask():
            meta = _write(partial, cfg, tok_cfg, load_tokenizer(tok_cfg), cache_root(cfg), progress)
            (partial / "meta.json").write_text(json.dumps(meta, indent=1))
        make_private(partial)
        make_private(folder.parent / "datasets")
        try:
            partial.rename(folder)  # atomic: a folder with meta.json is always whole
        except OSError:  # another process finished the same corpus first
            shutil.rmtree(partial, ignore_errors=True)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return folder, True


@contextmanager
def corpus_folder(cfg: DataConfig, tok_cfg: TokenizerConfig) -> Iterator[Path]:
    """A folder holding the tokenized corpus and its meta.json: the cache's, or a temporary one (the
    corpora the cache does not keep: one text file with the bytes tokenizer, fast to encode again)."""
    if uses_cache(cfg, tok_cfg):
        yield build_cache(cfg, tok_cfg)[0]
        return
    with tempfile.TemporaryDirectory(prefix="launcher-tokens-") as tmp:
        meta = _write(Path(tmp), cfg, tok_cfg, load_tokenizer(tok_cfg), cache_root(cfg))
        (Path(tmp) / "meta.json").write_text(json.dumps(meta, indent=1))
        yield Path(tmp)


def load_corpus(cfg: DataConfig, tok_cfg: TokenizerConfig | None = None) -> Corpus:
    """The tokenized corpus: memory-mapped from the cache (built if missing), or built in memory."""
    tok_cfg = tok_cfg or TokenizerConfig()
    if uses_cache(cfg, tok_cfg):
        folder, _ = build_cache(cfg, tok_cfg, check_contents=False)  # the launching process checked them
        return _read(folder, read_meta(folder), mmap=True)
    with tempfile.TemporaryDirectory(prefix="launcher-tokens-") as tmp:
        meta = _write(Path(tmp), cfg, tok_cfg, load_tokenizer(tok_cfg), cache_root(cfg))
        return _read(Path(tmp), meta, mmap=False)
