"""The data group's schema: where records come from, their format, and how they become sequences."""

from __future__ import annotations

from dataclasses import dataclass

DATA_KINDS = ("stdlib", "text", "jsonl", "files")
FORMATS = ("text", "instruction", "chat", "sharegpt", "pretokenized", "preference", "kto", "prompt", "auto")
TRAIN_ON = ("completion", "all")
TRAIN_REASONING = ("auto", "true", "false")
BATCHING = ("fixed", "group_by_length", "token_budget")


@dataclass(frozen=True, kw_only=True)
class SourceConfig:
    """One source of a mixture (`data.sources`): its files, how its records read, and its share of the draws."""

    path: str | None = None
    """A file, glob or directory, as data.path (unused with kind=stdlib)."""
    weight: float = 1.0
    """Relative share of the training sequences drawn from this source (positive; normalized over the sources)."""
    name: str | None = None
    """Name in metrics (`eval_loss/<name>`) and checkpoints; null: the file stem of path (stdlib: stdlib)."""
    kind: str | None = None
    """As data.kind; null: data.kind, or when that is stdlib (the default): jsonl for .jsonl paths, files otherwise."""
    format: str | None = None
    """As data.format; null: data.format."""
    field: str | None = None
    """As data.field; null: data.field."""
    template: str | None = None
    """As data.template; null: data.template."""
    train_on: str | None = None
    """As data.train_on; null: data.train_on."""
    val_path: str | None = None
    """Held-out records of this source from these files instead of a data.val_fraction share of path."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the training records come from, how they are rendered, and how they are cut into sequences."""

    kind: str = "stdlib"
    """Source: stdlib (this interpreter's standard library source), text (files), jsonl (records), files (via `datasets`)."""
    path: str | None = None
    """A file, glob or directory: text files (text), .jsonl (jsonl), .jsonl/.json/.parquet/.csv/.txt (files)."""
    val_path: str | None = None
    """Held-out records from these files instead of a data.val_fraction share of data.path."""
    format: str = "text"
    """Record layout: text (data.field), instruction (alpaca), chat (messages), sharegpt (conversations), pretokenized (input_ids), preference (prompt, chosen, rejected), kto (prompt, completion, label), prompt (prompt or messages, for grpo/rloo), auto (chosen from the first record)."""
    field: str = "text"
    """The record field holding the text (text), the conversation (chat, sharegpt) or the token ids (pretokenized)."""
    template: str | None = None
    """instruction: the prompt template with {instruction} and {input}; null: the alpaca template (docs/data.md)."""
    train_on: str = "completion"
    """instruction, chat, sharegpt: completion (prompt tokens get label -100) or all (every token is trained)."""
    train_reasoning: str = "auto"
    """Reasoning traces (reasoning_content, <think> blocks): auto trains those the chat template renders, true also
    refuses a record whose reasoning the template drops, false keeps them in the text but untrained."""
    system_prompt_merge: bool = False
    """chat, sharegpt: fold a leading system turn into the first user turn, for chat templates with no system role."""
    seq_len: int = 128
    """Tokens per training sequence."""
    val_fraction: float = 0.02
    """Share of documents held out for evaluation (unused with data.val_path)."""
    max_bytes: int | None = None
    """Cap on corpus tokens read (bytes with the bytes tokenizer), split between train and val in proportion."""
    packing: bool = True
    """Pack documents back to back into full sequences; false: one document per sequence, padded (labels -100)."""
    document_mask: bool = True
    """Packed sequences: positions restart at each document and attention stays inside it; false: plain causal."""
    batching: str = "fixed"
    """Unpacked batches: fixed (micro_batch_size random documents), group_by_length or token_budget."""
    max_tokens_per_batch: int | None = None
    """token_budget: padded tokens (sequences x longest) per micro batch per rank."""
    streaming: bool = False
    """files: read the files as a stream while tokenizing (no Arrow copy of the corpus), for corpora larger than memory."""
    num_proc: int = 1
    """Processes that tokenize in parallel (before the ranks start)."""
    cache_dir: str | None = None
    """Where tokenized corpora are kept for reuse; null: $XDG_CACHE_HOME/launcher/tokens (~/.cache/...)."""
    num_workers: int = 0
    """Loader processes per rank that prepare the next micro batches while the rank computes (0: in the loop)."""
    sources: tuple[SourceConfig, ...] = ()
    """A mixture: sources tokenized and cached one by one, their sequences interleaved by weight (docs/data.md);
    replaces data.path. Each entry: path, weight, name, kind, format, field, template, train_on, val_path."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "sources", tuple(self.sources)
        )  # OmegaConf builds lists; the spec keeps tuples
