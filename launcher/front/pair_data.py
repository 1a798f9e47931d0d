"""Data that would train nothing, found before launch: pairs that cannot train, one-class kto data, empty sources.

Runs on the tokenized corpus (front/tokenize.py), so it sees what the ranks will read:

- preference pairs (kto examples) that train nothing at data.seq_len (pair_checks: a blank side,
  identical sides, a prompt that leaves no response token inside seq_len + 1 tokens). Up to
  DROP_SHARE of them are dropped (the ranks leave the same ones out) with a console line naming the
  counts; more is refused with the counts and the fix, since the run would be mostly ln 2 at zero rewards;
- kto data whose kept examples hold one label only (KTO weighs desirable against undesirable);
- a source (data.path, or a mixture's entry) whose records hold no token but BOS/EOS.
"""

from __future__ import annotations

import json

import numpy as np
from rich.console import Console

from launcher.components.data.mixture import resolve, single_configs
from launcher.components.data.pair_checks import DEFECTS, DROP_SHARE, judge, prompt_length
from launcher.components.data.pairs import PAIR_FORMATS, UNDESIRABLE
from launcher.components.data.tokens import START, build_cache, cached_path, uses_cache
from launcher.config.data import DataConfig
from launcher.spec import RunSpec, SpecError

WHY = {
    "empty": "a blank {sides}",
    "identical": "the same chosen and rejected text",
    "prompt": "a prompt that leaves no response token within data.seq_len={seq_len} (the longest such prompt: "
    "{longest:,} tokens)",
}
FIX = {
    "empty": "fill or drop the records with a blank {sides}",
    "identical": "drop the records whose chosen and rejected are the same",
    "prompt": "raise data.seq_len (and model.max_seq_len) above the prompts, or shorten them",
}


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}{'s' * (number != 1)}"


def _name(spec: RunSpec, data: DataConfig) -> str:
    """How a message names the source: data.path, or the mixture entry's name."""
    if not spec.data.sources:
        return f"data.path {data.path}"
    names = [s.name for s in resolve(spec.data) if s.data == data]
    return f"source '{names[0] if names else data.path}' ({data.path})"


def _empty_source(spec: RunSpec, data: DataConfig, arrays: tuple[np.ndarray, np.ndarray]) -> SpecError | None:
    """A source whose records hold no token but BOS and EOS (empty strings), or none at all."""
    tokens, flags = arrays
    documents = int(np.count_nonzero(flags & START))
    if (
        len(tokens) > 2 * documents
    ):  # more than BOS + EOS per document: text is there (the common, cheap case)
        return None
    from launcher.components.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(spec.tokenizer)
    special = [i for i in (tokenizer.bos_id, tokenizer.eos_id) if i is not None]
    if np.any(~np.isin(tokens, special)):
        return None
    return SpecError(
        ("data.sources",) if spec.data.sources else ("data.path", "data.field"),
        f"{_name(spec, data)} holds no text: its {_count(documents, 'training document')} tokenize to nothing but "
        f"begin/end-of-text tokens (empty strings, or data.field={data.field} names an empty field). Nothing "
        "was started. Point it at records with text, or set data.field (data.format) to the field that holds it.",
    )


_COUNTED: dict[tuple[str, int, bool], dict[str, int]] = {}
"""_pair_counts by (cache folder, seq_len, kto): the size check asks again for the same counts."""


def _pair_counts(spec: RunSpec, data: DataConfig, arrays: tuple[np.ndarray, np.ndarray]) -> dict[str, int]:
    """Pairs (kto examples), each defect's count, the longest prompt among `prompt` defects, kto labels kept."""
    kto = data.format == "kto"
    key = (str(cached_path(data, spec.tokenizer)), data.seq_len, kto)
    if key in _COUNTED:
        return _COUNTED[key]
    tokens, flags = arrays
    judged = judge(tokens, flags, data.seq_len, kto=kto)
    counts = {"pairs": len(judged.cuts)}
    for code, why in enumerate(DEFECTS, start=1):
        counts[why] = int(np.count_nonzero(judged.defect == code))
    long_prompts = judged.cuts[judged.defect == 1 + DEFECTS.index("prompt")]
    counts["longest"] = max((prompt_length(flags, cut) for cut in long_prompts[:1000]), default=0)
    if kto:
        undesirable = (flags[judged.kept()[:, 0]] & UNDESIRABLE) != 0
        counts["undesirable"] = int(np.count_nonzero(undesirable))
        counts["desirable"] = len(undesirable) - counts["undesirable"]
    _COUNTED[key] = counts
    return counts


def _pair_problems(
    spec: RunSpec, data: DataConfig, counts: dict[str, int], console: Console
) -> list[SpecError]:
    """Refuse (or drop with a line) pairs that cannot train; refuse one-class kto data."""
    kto = data.format == "kto"
    noun, sides = ("kto example", "completion") if kto else ("pair", "chosen or rejected side")
    total = counts.get("pairs", 0)
    bad = {why: counts[why] for why in WHY if counts.get(why)}
    num_bad = sum(bad.values())
    keys = ("data.path", "data.seq_len") if not spec.data.sources else ("data.sources", "data.seq_len")
    fields = {"sides": sides, "seq_len": data.seq_len, "longest": counts.get("longest", 0)}
    listed = "; ".join(f"{n:,} with {WHY[why].format(**fields)}" for why, n in bad.items())
    if num_bad and num_bad > DROP_SHARE * total:
        fixes = "; ".join(FIX[why].format(**fields) for why in bad)
        return [
            SpecError(
                keys,
                f"{num_bad:,} of {_count(total, noun)} in {_name(spec, data)} would train nothing ({listed}): "
                f"more than the {DROP_SHARE:.0%} the launcher drops on its own, so the run would sit at loss ln 2 "
                f"with zero rewards. Nothing was started. To fix: {fixes}.",
            )
        ]
    if num_bad:
        console.print(
            f"data: leaving out {num_bad:,} of {_count(total, noun)} in {_name(spec, data)}: {listed} "
            f"(up to {DROP_SHARE:.0%} are dropped; more is refused)",
            markup=False,
            highlight=False,
        )
    if kto and total > num_bad and not (counts.get("desirable") and counts.get("undesirable")):
        label = "true (desirable)" if counts.get("desirable") else "false (undesirable)"
        return [
            SpecError(
                keys[:1] + ("objective.name",),
                f"all {_count(total - num_bad, 'kto example')} in {_name(spec, data)} are labelled {label}: KTO "
                "weighs desirable against undesirable completions, so one class alone gives it nothing to "
                "contrast. Nothing was started. Add examples of the other label, or train the desirable "
                "completions alone with objective=sft.",
            )
        ]
    return []


def train_arrays(spec: RunSpec, data: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    """The training side's token ids and flags, read from the cache (numpy only: no torch before launch)."""
    folder = build_cache(data, spec.tokenizer)[0]
    meta = json.loads((folder / "meta.json").read_text())
    if not meta["sizes"]["train"]:
        return np.zeros(0, np.dtype(meta["dtype"])), np.zeros(0, np.uint8)
    tokens = np.memmap(folder / "train.tokens", dtype=np.dtype(meta["dtype"]), mode="r")
    return tokens, np.memmap(folder / "train.flags", dtype=np.uint8, mode="r")


def usable_pairs(spec: RunSpec) -> int:
    """The pairs (kto examples) of a single-source spec that the ranks keep: every one that can train."""
    data = spec.data
    counts = _pair_counts(spec, data, train_arrays(spec, data))
    return counts.get("pairs", 0) - sum(counts.get(why, 0) for why in WHY)


def pair_data_errors(spec: RunSpec, console: Console) -> list[SpecError]:
    """Every cached source's empty-text problem, and the pair problems of preference or kto data (dropping a few)."""
    errors: list[SpecError] = []
    for data in single_configs(spec.data):
        if not uses_cache(data, spec.tokenizer):  # one text file: data_sizes refuses it empty
            continue
        arrays = train_arrays(spec, data)
        empty = _empty_source(spec, data, arrays)
        if empty is not None:
            errors.append(empty)
        elif data.format in PAIR_FORMATS:
            counts = _pair_counts(spec, data, arrays)
            errors += _pair_problems(spec, data, counts, console)
    return errors
