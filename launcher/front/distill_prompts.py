"""On-policy distillation's prompts, judged on the tokenized corpus before launch: some exist, and each leaves
room in data.seq_len for distill.max_new_tokens sampled tokens (the ranks read the same prompts)."""

from __future__ import annotations

from launcher.components.data.corpus_prompts import prompt_spans
from launcher.components.data.tokens import TokenStore
from launcher.front.pair_data import train_arrays
from launcher.spec import RunSpec, SpecError

KEYS = ("distill.mode", "data.path")


def distill_prompt_errors(spec: RunSpec) -> list[SpecError]:
    """Why the corpus gives on-policy distillation no prompt, or prompts too long for data.seq_len; [] when fine."""
    d = spec.distill
    if not d.on_policy or spec.data.sources:  # a mixture is refused by launcher.rules.distill
        return []
    tokens, flags = train_arrays(spec, spec.data)
    prompts = prompt_spans(
        TokenStore(tokens, flags), prompt_tokens=d.prompt_tokens, max_new_tokens=d.max_new_tokens
    )
    if not len(prompts):
        return [
            SpecError(
                KEYS,
                f"the training data gives no prompt: no record has a prompt part before its trained tokens, and no "
                f"text document holds distill.prompt_tokens + distill.max_new_tokens = "
                f"{d.prompt_tokens + d.max_new_tokens} tokens. Use instruction or chat records, or lower those keys.",
            )
        ]
    room = spec.data.seq_len - d.max_new_tokens
    lengths = prompts.splits - prompts.starts
    if int(lengths.max()) > room:
        return [
            SpecError(
                (*KEYS, "data.seq_len", "distill.max_new_tokens"),
                f"{int((lengths > room).sum()):,} of {len(prompts):,} prompts are longer than data.seq_len - "
                f"distill.max_new_tokens = {spec.data.seq_len} - {d.max_new_tokens} = {room} tokens (the longest: "
                f"{int(lengths.max())}), so their completions would not fit a row. Raise data.seq_len to at least "
                f"{int(lengths.max()) + d.max_new_tokens}, lower distill.max_new_tokens, or shorten those prompts.",
            )
        ]
    return []
