"""The data group: a byte-level corpus, packed into fixed-length sequences, and a resumable sampler.

Tokens are bytes (0..255); documents are joined with a 0 byte. Which documents are held out
depends only on a stable key per document, so the split never changes with file order, glob
spelling, max_bytes or the number of ranks.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

SEPARATOR = b"\0"
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the training text comes from and how it is cut into sequences."""

    kind: str = "stdlib"
    """Source: stdlib (this interpreter's standard library source), text (files) or jsonl (records)."""
    path: str | None = None
    """A file or glob of text files (text) or of .jsonl files (jsonl); unused for stdlib."""
    field: str = "text"
    """The JSONL field holding a record's document text."""
    seq_len: int = 128
    """Tokens per training sequence."""
    val_fraction: float = 0.02
    """Share of documents held out for evaluation."""
    max_bytes: int | None = None
    """Cap on corpus bytes read, split between train and val in proportion; null reads everything."""
    packing: bool = True
    """Pack documents back to back into full sequences; false: one document per sequence, padded (labels -100)."""
    batching: str = "fixed"
    """Unpacked batches: fixed (micro_batch_size random documents), group_by_length or token_budget."""
    max_tokens_per_batch: int | None = None
    """token_budget: padded tokens (sequences x longest) per micro batch per rank."""


@dataclass(frozen=True, kw_only=True)
class Corpus:
    """The corpus as two byte-token streams."""

    train: torch.Tensor
    """Training tokens, 1-D uint8."""
    val: torch.Tensor
    """Held-out tokens, 1-D uint8 (never shorter than one sequence when the corpus allows it)."""


def stdlib_root() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> list[tuple[str, Path]]:
    """(relative path, path) of the standard library's .py files, tests and third-party code left out."""
    root = stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS and d != "__pycache__"]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def _matching_files(pattern: str | None, kind: str) -> list[tuple[str, Path]]:
    """(key, path) of the files a path or glob names, sorted; keys are relative to their common folder."""
    if not pattern:
        raise ValueError(f"data.kind={kind} reads files: set data.path to a file or a glob.")
    paths = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not paths:
        raise FileNotFoundError(f"data.path: no file matches '{pattern}'.")
    base = Path(os.path.commonpath([p.parent.resolve() for p in paths]))
    return [(p.resolve().relative_to(base).as_posix(), p) for p in paths]


def _read(path: Path, limit: int | None) -> bytes:
    """A file's bytes, at most `limit` of them."""
    with path.open("rb") as f:
        return f.read() if limit is None else f.read(limit)


def _jsonl_documents(cfg: DataConfig) -> Iterator[tuple[str, bytes]]:
    """(file:line, text) per record of the JSONL files; blank lines are skipped, malformed ones refused."""
    for key, path in _matching_files(cfg.path, cfg.kind):
        with path.open("rb") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg}).") from err
                if not isinstance(record, dict) or not isinstance(record.get(cfg.field), str):
                    raise ValueError(
                        f"{path}:{lineno}: no string field '{cfg.field}' (set data.field to the field "
                        "that holds the text)."
                    )
                yield f"{key}:{lineno}", record[cfg.field].encode("utf-8")


def _documents(cfg: DataConfig) -> Iterator[tuple[str, bytes]]:
    """(stable key, bytes) of every document of the configured source, in a fixed order."""
    if cfg.kind == "jsonl":
        yield from _jsonl_documents(cfg)
        return
    if cfg.kind == "stdlib":
        files = _stdlib_files()
    elif cfg.kind == "text":
        files = _matching_files(cfg.path, cfg.kind)
    else:
        raise ValueError(f"unknown data.kind {cfg.kind!r}; known: stdlib, text, jsonl.")
    for key, path in files:
        yield key, _read(path, cfg.max_bytes)


def is_val_document(key: str, val_fraction: float) -> bool:
    """Whether the document with this key is held out (a hash of the key, so stable everywhere)."""
    return zlib.crc32(key.encode("utf-8")) % 10_000 < val_fraction * 10_000


def _budgets(cfg: DataConfig) -> tuple[int | None, int | None]:
    """(train, val) byte caps that split max_bytes in proportion, val holding at least one sequence."""
    if cfg.max_bytes is None:
        return None, None
    val = max(round(cfg.max_bytes * cfg.val_fraction), min(cfg.seq_len + 1, cfg.max_bytes // 2))
    return cfg.max_bytes - val, val


def _split_documents(cfg: DataConfig) -> tuple[list[bytes], list[bytes]]:
    """Read documents into (train, val) by key until both byte caps are met."""
    caps = _budgets(cfg)
    sides: tuple[list[bytes], list[bytes]] = ([], [])
    sizes = [0, 0]
    for key, doc in _documents(cfg):
        side = int(is_val_document(key, cfg.val_fraction))
        cap = caps[side]
        if cap is not None and sizes[side] >= cap:
            if all(c is not None and s >= c for c, s in zip(caps, sizes, strict=True)):
                break
            continue
        sides[side].append(doc)
        sizes[side] += len(doc) + len(SEPARATOR)
    return sides


def _ensure_val(train: list[bytes], val: list[bytes], cfg: DataConfig) -> None:
    """Make val hold at least one sequence: move trailing train documents, or split a lone one."""
    one_sequence = cfg.seq_len + 1
    if _joined_size(val) >= one_sequence or not train:
        return
    need = max(one_sequence, int((_joined_size(train) + _joined_size(val)) * cfg.val_fraction))
    while len(train) > 1 and _joined_size(val) < need:
        val.insert(0, train.pop())
    if _joined_size(val) < one_sequence and len(train) == 1:
        doc = train.pop()
        cut = max(len(doc) - max(need - _joined_size(val), int(len(doc) * cfg.val_fraction)), 0)
        train.append(doc[:cut])
        val.insert(0, doc[cut:])


def _joined_size(docs: list[bytes]) -> int:
    """Length of the documents joined with separators."""
    return sum(map(len, docs)) + len(SEPARATOR) * max(len(docs) - 1, 0)


def _join(docs: list[bytes]) -> bytes:
    """The documents as one byte stream, separated by SEPARATOR."""
    return SEPARATOR.join(docs)


def _to_tensor(data: bytes, limit: int | None) -> torch.Tensor:
    """Bytes (truncated to `limit`) as a 1-D uint8 tensor that owns its memory."""
    data = data if limit is None else data[:limit]
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def load_corpus(cfg: DataConfig) -> Corpus:
    """Read the configured source and split it into train and val byte tokens, deterministically."""
    train, val = _split_documents(cfg)
    if not train and not val:
        raise ValueError(f"the corpus ({describe(cfg)}) holds no documents.")
    _ensure_val(train, val, cfg)
    train_cap, val_cap = _budgets(cfg)
    return Corpus(train=_to_tensor(_join(train), train_cap), val=_to_tensor(_join(val), val_cap))


def describe(cfg: DataConfig) -> str:
    """One line naming the data source, for logs."""
    if cfg.kind == "stdlib":
        source = f"stdlib: Python standard library source in {stdlib_root()}"
    elif cfg.kind == "jsonl":
        source = f"jsonl: field '{cfg.field}' of {cfg.path}"
    else:
        source = f"{cfg.kind}: {cfg.path}"
    cap = f", first {cfg.max_bytes:,} bytes" if cfg.max_bytes is not None else ""
    return f"{source} (byte tokens, seq_len {cfg.seq_len}, {cfg.val_fraction:.0%} held out{cap})"


class PackedSequences:
    """A token stream cut into back-to-back sequences of seq_len inputs (+1 token for the last label)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}.")
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}.")
        self.tokens = tokens
        self.seq_len = seq_len
        self._offsets = torch.arange(seq_len + 1)

    def __len__(self) -> int:
        return max((len(self.tokens) - 1) // self.seq_len, 0)

    def batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sequences `indices` as input_ids and next-token labels, both int64 [B, seq_len]."""
        positions = indices.reshape(-1, 1).long() * self.seq_len + self._offsets
        window = self.tokens[positions].long()
        return {"input_ids": window[:, :-1], "labels": window[:, 1:]}


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed from (seed, epoch), so that no two pairs share an order."""
    digest = hashlib.sha256(f"{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class BatchStream:
    """Seeded, rank-aware, resumable sampler of training micro batches.

    Each epoch is a seeded permutation of all sequences. A call of `next_batch` consumes the next
    global micro batch (micro_batch_size * world_size indices) and returns this rank's slice, so
    W ranks see together exactly what one process with micro batch B * W sees. An epoch ends when
    fewer indices remain than one optimizer step needs (grad_accum_steps global micro batches), so
    accumulating k micro batches of B also sees exactly the sequences of one micro batch of k * B.
    The position is rank-independent: one state dict resumes every rank.
    """

    def __init__(
        self,
        dataset: PackedSequences,
        *,
        micro_batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        grad_accum_steps: int = 1,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}.")
        if micro_batch_size <= 0 or grad_accum_steps <= 0:
            raise ValueError("micro_batch_size and grad_accum_steps must be positive.")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.global_micro_batch = micro_batch_size * world_size
        self.step_size = self.global_micro_batch * grad_accum_steps
        if len(dataset) < self.step_size:
            raise ValueError(
                f"the training data holds {len(dataset)} sequences of {dataset.seq_len} tokens, fewer than one "
                f"optimizer step needs ({micro_batch_size} per micro batch x {world_size} ranks x "
                f"{grad_accum_steps} accumulated). Lower train.micro_batch_size or data.seq_len, or use more data."
            )
        self._epoch = 0
        self._offset = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
        return torch.randperm(len(self.dataset), generator=generator)

    @property
    def epoch(self) -> int:
        """Epochs begun so far, counting from 0."""
        return self._epoch

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's part of the next global micro batch (input_ids and labels, int64 [B, T])."""
        at_step_start = self._offset % self.step_size == 0
        if at_step_start and self._offset + self.step_size > len(self._order):
            self._epoch += 1
            self._offset = 0
            self._order = self._permutation(self._epoch)
        start = self._offset + self.rank * self.micro_batch_size
        indices = self._order[start : start + self.micro_batch_size]
        self._offset += self.global_micro_batch
        return self.dataset.batch(indices)

    def state_dict(self) -> dict[str, int]:
        """The position in the data, identical on every rank."""
        return {"epoch": self._epoch, "offset": self._offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a position `state_dict` returned."""
        self._epoch, self._offset = int(state["epoch"]), int(state["offset"])
        self._order = self._permutation(self._epoch)


def val_batches(
    dataset: PackedSequences, *, micro_batch_size: int, max_batches: int, rank: int = 0, world_size: int = 1
) -> Iterator[dict[str, torch.Tensor]]:
    """Up to max_batches held-out micro batches in order, sharded over ranks like BatchStream.

    Every rank yields the same number of equally shaped batches (collective strategies need
    that); when the data holds fewer sequences than one global micro batch, batches shrink.
    """
    batch_size = min(micro_batch_size, len(dataset) // world_size)
    if batch_size == 0:
        raise ValueError(
            f"the held-out data holds {len(dataset)} sequences of {dataset.seq_len} tokens, fewer than the "
            f"{world_size} ranks. Raise data.val_fraction or lower data.seq_len."
        )
    num_batches = min(max_batches, len(dataset) // (batch_size * world_size))
    for j in range(num_batches):
        start = (j * world_size + rank) * batch_size
        yield dataset.batch(torch.arange(start, start + batch_size))
