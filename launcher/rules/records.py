"""Rules that read a little data before anything starts: the tokenizer folder, its size, and a sample of records.

Records are sampled (the first SAMPLE_RECORDS over the files, and at least the first of every
file) and encoded exactly as tokenization will, so a wrong layout, type or role is named with
its file and record here, with exit status 2, instead of failing inside a rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from launcher.components.data.formats import encode_record
from launcher.components.data.layouts import find_registry
from launcher.components.data.saved import saved_folder
from launcher.components.data.sources import BUILDERS, RecordError, matching_files, sample_records
from launcher.components.data.tokenizer import load_problem, load_tokenizer, tokenizer_size
from launcher.components.data.tokenizer_folder import is_byte_export, is_tiktoken_file
from launcher.components.model.hf_files import local_dir, local_vocab_size
from launcher.config.tokenizer import TOKENIZER_KINDS
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule, choice
from launcher.spec import RunSpec, SpecError

SAMPLE_RECORDS = 1000
"""Records read before launch; a bad record after them stops tokenization (before any rank starts)."""


def _tokenizer(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    tok, m = spec.tokenizer, spec.model
    yield from choice("tokenizer.kind", tok.kind, TOKENIZER_KINDS, "tokenizer")
    if tok.kind == "bytes":
        if tok.add_bos:
            yield SpecError(
                ("tokenizer.add_bos",), "the bytes tokenizer has no bos token; drop tokenizer.add_bos."
            )
        if tok.path is not None:
            yield SpecError(
                ("tokenizer.path", "tokenizer.kind"),
                "tokenizer.path is read by `tokenizer=hf` (and `tokenizer=auto`) only.",
            )
    elif tok.kind == "hf":
        problem = load_problem(tok)
        if problem:
            yield SpecError(("tokenizer.path",), f"{problem}.")
            return
    else:
        return
    size = tokenizer_size(tok)
    folder = local_dir(m)
    if folder is not None:
        rows = local_vocab_size(folder)
        if rows is None:
            return  # the model rules say what is wrong with the directory
        if tok.kind == "bytes" and m.path and rows > size and not is_byte_export(Path(folder)):
            yield SpecError(
                ("tokenizer.kind", "model.path"),
                f"tokenizer=bytes feeds the pretrained model in '{folder}' byte ids 0..255, but it was trained on "
                f"its own tokenizer's {rows} ids: fine-tuning it on bytes throws its vocabulary away. Use "
                "`tokenizer=auto` (the folder's own tokenizer), or `tokenizer=hf tokenizer.path=DIR` with the "
                "tokenizer it was trained with.",
            )
        elif size > rows and not m.resize_embeddings:
            yield SpecError(
                ("model.path" if m.path else "model.hf_config", "tokenizer.kind"),
                f"the tokenizer ({tok.kind}) produces {size} token ids but the model in '{folder}' embeds {rows}. Use the "
                "model's own tokenizer, or add `model.resize_embeddings=true` to grow its embedding (new rows "
                "start untrained).",
            )
    elif m.vocab_size is not None and size > m.vocab_size:
        yield SpecError(
            ("model.vocab_size", "tokenizer.kind"),
            f"the tokenizer ({tok.kind}) produces {size} token ids but model.vocab_size is {m.vocab_size}. Leave "
            "model.vocab_size at null (the tokenizer's size, padded to a multiple of 64) or raise it.",
        )


def _eos(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    """A tokenizer folder without an eos token, where documents would get one (tokenizer.add_eos)."""
    tok, d = spec.tokenizer, spec.data
    if tok.kind != "hf" or not tok.add_eos or d.format in ("chat", "sharegpt") or load_problem(tok):
        return  # chat templates write their own end of turn; a folder that does not load is named above
    if load_tokenizer(tok).eos_id is not None:
        return
    model = Path(str(tok.path)) / "tokenizer.model"
    tiktoken = not (model.parent / "tokenizer.json").is_file() and model.is_file() and is_tiktoken_file(model)
    why = (
        " Its tokenizer.model is a tiktoken BPE file (Llama 3's original/ folder), which holds no special tokens: "
        "Llama 3's <|begin_of_text|>, <|end_of_text|> and <|eot_id|> are added by the code that reads it."
        if tiktoken
        else ""
    )
    yield SpecError(
        ("tokenizer.path", "tokenizer.add_eos"),
        f"the tokenizer in '{tok.path}' has no eos token, so with tokenizer.add_eos=true each document would run "
        f"into the next with nothing between them.{why} Name it in the folder's tokenizer_config.json (e.g. "
        '`{"eos_token": "<|end_of_text|>", "bos_token": "<|begin_of_text|>"}`: tokens the vocabulary lacks are '
        "added after it, so a pretrained model then needs model.resize_embeddings=true), or use the tokenizer "
        "folder transformers saves (tokenizer.json with tokenizer_config.json); or add tokenizer.add_eos=false "
        "to train without an end-of-document token.",
    )


def _sample(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    d = spec.data
    if d.kind not in ("jsonl", "files") or (d.kind == "jsonl" and saved_folder(d.path)):
        return  # a save_to_disk folder under data=jsonl: the data rules name it
    try:
        files = [
            path for _, path in matching_files(d.path, suffixes=tuple(BUILDERS) if d.kind == "files" else ())
        ]
        if d.val_path:
            files += [path for _, path in matching_files(d.val_path, key="data.val_path")]
    except FileNotFoundError:
        return  # the data rules name the path
    if find_registry(files) is not None:
        return  # the data rules name the registry and the files it lists
    tok = spec.tokenizer
    if tok.kind not in TOKENIZER_KINDS or load_problem(tok):
        return  # the tokenizer rule says why
    tokenizer = load_tokenizer(tok)
    budget = SAMPLE_RECORDS
    for path in files:
        count = 0
        try:
            reader = sample_records(path, max(budget, 1), jsonl=d.kind == "jsonl")
            for where, record in reader:
                encode_record(record, d, tok, tokenizer, where)
                count += 1
        except RecordError as err:
            yield SpecError(("data.path", "data.format", "data.field"), str(err))
            return
        if count == 0:
            yield SpecError(
                ("data.path",),
                f"{path} holds no records (an empty file): remove it or leave it out of data.path.",
            )
            return
        budget -= count


RULES: tuple[Rule, ...] = (_tokenizer, _eos, _sample)
"""This module's rules, in the order they report."""
