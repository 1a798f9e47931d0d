"""Reading back a token-cache folder defensively: meta.json, the token and flag files, the reference log-probs.

A cached corpus (launcher.components.data.tokens) is a folder holding meta.json and, per side (train,
val), `<side>.tokens` (ids, meta's dtype) and `<side>.flags` (one byte per token). Before a folder is
reused, its meta.json must hold every field with its type and a non-negative size, each file must be
there and exactly as long as its size says, every flag byte may hold only the two flag bits, and every
id must lie below meta's vocab_size. A folder that fails is refused with DamagedFile (a RefusedFile) naming the file
and the fix (delete the folder: the next run tokenizes again); nothing of it is used. The checks read
the files once, memory-mapped, in the launching process (250 MB of ids and flags in 0.07 s from the page
cache on a 2-core machine; a cold disk reads at its own speed); ranks check the sizes only.

The reference log-probs kept beside the corpus (`ref_logps-<key>.pt`) are read weights-only and must
be one float32 tensor [pairs, sides] of finite values.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from launcher.components.files.records import DamagedFile, count, read_json_object, text
from launcher.components.files.safe_load import RefusedFile, load_tensor_file

if TYPE_CHECKING:
    import torch

DTYPES = {"|u1": np.dtype(np.uint8), "<i4": np.dtype(np.int32)}
"""The token dtypes the cache writes (meta.json's dtype): bytes tokenizer ids, and every other tokenizer's."""
SPLITS = ("val_path", "tail", "hash")
"""How the held-out side was made (meta.json's split)."""
FLAG_BITS = 15
"""TRAINED | START | REJECTED | UNDESIRABLE (launcher.components.data.tokens and .pairs): the only bits a
flag byte may hold (the last two only in preference and kto caches)."""
CHUNK_TOKENS = 1 << 24
"""Tokens checked per slice, so the check holds at most this many ids in memory."""
SIDES = ("train", "val")
TAMPERED = (
    "The launcher never writes such a file, so it was changed or replaced after it was written; it is left where "
    "it is. Find out who changed it before anything else reads it."
)


def rebuild_advice(folder: Path) -> str:
    """What to do with a damaged cache folder."""
    return (
        f"The token cache is damaged or was written by another version. Delete the folder {folder} "
        "(rm -r it): the next run tokenizes the data again into it."
    )


def read_meta(folder: Path) -> dict[str, Any]:
    """A cache folder's meta.json with every field checked: dtype, sizes, num_documents, split, vocab_size."""
    path = Path(folder) / "meta.json"
    advice = rebuild_advice(folder)
    meta = read_json_object(path, advice)
    if meta.get("dtype") not in DTYPES:
        raise DamagedFile(
            path, f"dtype is {meta.get('dtype')!r}, not one of {', '.join(DTYPES)}", False, advice
        )
    for field in ("sizes", "num_documents"):
        if not isinstance(meta.get(field), dict):
            raise DamagedFile(path, f"{field} is not an object with train and val", False, advice)
        for side in SIDES:
            value = meta[field].get(side)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise DamagedFile(
                    path, f"{field}.{side} is {value!r}, not a count of 0 or more", False, advice
                )
    if meta.get("split") not in SPLITS:
        raise DamagedFile(
            path, f"split is {meta.get('split')!r}, not one of {', '.join(SPLITS)}", False, advice
        )
    count(meta, "vocab_size", path, advice, minimum=1)
    text(meta, "tokenizer", path, advice)
    if DTYPES[meta["dtype"]] == np.uint8 and meta["vocab_size"] > 256:
        raise DamagedFile(path, f"dtype |u1 cannot hold vocab_size {meta['vocab_size']}", False, advice)
    return meta


def check_files(folder: Path, meta: dict[str, Any], *, contents: bool = True) -> None:
    """Each side's token and flag files there and as long as meta's sizes say; with `contents`, every flag
    byte and token id in range too (DamagedFile naming the first file that is not)."""
    folder = Path(folder)
    dtype, advice = DTYPES[meta["dtype"]], rebuild_advice(folder)
    for side in SIDES:
        size = meta["sizes"][side]
        for path, itemsize in ((folder / f"{side}.tokens", dtype.itemsize), (folder / f"{side}.flags", 1)):
            if not path.is_file():
                raise DamagedFile(path, "it is missing (meta.json lists it)", False, advice)
            found = path.stat().st_size
            if found != size * itemsize:
                raise DamagedFile(
                    path,
                    f"it holds {found:,} bytes where meta.json's size of {size:,} tokens makes {size * itemsize:,}",
                    False,
                    advice,
                )
        if contents and size:
            _check_contents(folder, side, size, dtype, meta["vocab_size"], advice)


def _check_contents(folder: Path, side: str, size: int, dtype: np.dtype, vocab: int, advice: str) -> None:
    """Flag bytes within FLAG_BITS, the first one a document start; ids in [0, vocab)."""
    flags_path, tokens_path = folder / f"{side}.flags", folder / f"{side}.tokens"
    flags = np.memmap(flags_path, dtype=np.uint8, mode="r")
    tokens = np.memmap(tokens_path, dtype=dtype, mode="r")
    if not flags[0] & 2:
        raise DamagedFile(flags_path, "its first token does not begin a document", False, advice)
    for start in range(0, size, CHUNK_TOKENS):
        piece = slice(start, start + CHUNK_TOKENS)
        if int(flags[piece].max()) > FLAG_BITS:
            raise DamagedFile(flags_path, "it holds bytes other than the token flags", False, advice)
        ids = tokens[piece]
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise DamagedFile(
                tokens_path, f"it holds token id {high if high >= vocab else low}, outside the vocabulary of "
                f"{vocab} ids", False, advice,
            )  # fmt: skip
    del flags, tokens


def read_folder(folder: Path, *, contents: bool = True) -> dict[str, Any]:
    """A cache folder's meta, once the meta and its files are checked (DamagedFile otherwise)."""
    meta = read_meta(folder)
    check_files(folder, meta, contents=contents)
    return meta


def read_ref_logps(path: Path, rows: int, sides: int) -> torch.Tensor:
    """The reference log-probs in `path`: a float32 tensor [rows, sides] of finite values (DamagedFile otherwise)."""
    import torch

    advice = f"Delete {path}: the next run computes the reference log-probs again (objective.reference=precompute)."
    try:
        with warnings.catch_warnings():  # torch's note on a pickle protocol: the refusal below says more
            warnings.simplefilter("ignore", UserWarning)
            value = load_tensor_file(path)
    except RefusedFile as err:
        if err.names_code:  # evidence: left in place, named, and the run stops
            raise RefusedFile(path, err.reason, True, advice=TAMPERED) from None
        raise DamagedFile(path, err.reason, False, advice) from None
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, ValueError) as err:
        reason = (str(err).splitlines() or [type(err).__name__])[0]
        raise DamagedFile(path, f"it does not load as a torch file ({reason})", False, advice) from None
    if not isinstance(value, torch.Tensor):
        raise DamagedFile(path, f"it holds a {type(value).__name__}, not a tensor", False, advice)
    if value.dtype != torch.float32 or tuple(value.shape) != (rows, sides):
        raise DamagedFile(
            path, f"it holds a {value.dtype} tensor {list(value.shape)}, not float32 [{rows}, {sides}] "
            "(one row per training pair of this corpus)", False, advice,
        )  # fmt: skip
    if not bool(torch.isfinite(value).all()):
        raise DamagedFile(path, "it holds NaN or infinite log-probs", False, advice)
    return value
