"""Tokenize once, before any rank starts: build (or reuse) the cached corpus, with a progress bar.

A record that the sample checks did not reach and that cannot be used stops here, named with its
file and index, with exit status 2: no rank has started and no checkpoint is touched. So does a
cache folder that does not read back as written (launcher.components.files.token_cache). So does data
too small for the run (front/data_sizes.py): fewer sequences than one optimizer step, or held-out
data that cannot give every rank a batch; and so does data that would train nothing
(front/pair_data.py): pairs that cannot train, one-class kto data, a source with no text.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from launcher.components.data.mixture import single_configs
from launcher.components.data.sources import RecordError
from launcher.components.files.safe_load import RefusedFile
from launcher.front.data_sizes import size_errors
from launcher.front.distill_prompts import distill_prompt_errors
from launcher.front.pair_data import pair_data_errors
from launcher.spec import RunSpec, SpecError


def prepare_data(spec: RunSpec, console: Console | None = None) -> list[SpecError]:
    """Make sure the tokenized corpus of `spec` is in the cache and enough for the run; the problems that stop it."""
    if spec.data.format == "prompt":  # online RL's prompts: read whole, no token cache
        from launcher.front.prompt_data import prompt_errors

        return prompt_errors(spec)
    from launcher.components.data.tokens import (  # numpy: only a run that starts needs it
        build_cache,
        uses_cache,
    )

    configs = [
        cfg for cfg in single_configs(spec.data) if uses_cache(cfg, spec.tokenizer)
    ]  # a mixture: each source
    if not configs:
        return _sizes(spec)  # a corpus the cache does not keep is read here
    console = console or Console(stderr=True)
    started = time.perf_counter()
    counts = {"records": 0, "tokens": 0}
    try:
        with Progress(
            SpinnerColumn(), TextColumn("tokenizing {task.description}"), TimeElapsedColumn(),
            console=console, transient=True, disable=not console.is_terminal,
        ) as progress:  # fmt: skip
            task = progress.add_task("0 records", total=None)

            def advance(num_tokens: int) -> None:
                counts["records"] += 1
                counts["tokens"] += num_tokens
                if counts["records"] % 512 == 0:
                    progress.update(
                        task, description=f"{counts['records']:,} records, {counts['tokens']:,} tokens"
                    )

            results = [build_cache(cfg, spec.tokenizer, progress=advance) for cfg in configs]
    except RecordError as err:
        return [_record_error(spec, err)]
    except RefusedFile as err:  # a damaged cache folder (components/files/token_cache.py)
        return [_cache_error(err)]
    elapsed = time.perf_counter() - started
    folders = ", ".join(str(folder) for folder, _ in results)
    if any(built for _, built in results):
        console.print(
            f"data: tokenized {counts['records']:,} records ({counts['tokens']:,} tokens) in {elapsed:.1f} s "
            f"into {folders}",
            markup=False,
            highlight=False,
        )
    else:
        console.print(
            f"data: reusing the tokenized corpus in {folders} ({elapsed:.2f} s)",
            markup=False,
            highlight=False,
        )
    return pair_data_errors(spec, console) or distill_prompt_errors(spec) or _sizes(spec)


def _record_error(spec: RunSpec, err: RecordError) -> SpecError:
    return SpecError(
        ("data.sources",) if spec.data.sources else ("data.path", "data.format", "data.field"),
        f"{err} Tokenization stopped at that record; no rank was started. Fix or drop the record.",
    )


def _cache_error(err: RefusedFile) -> SpecError:
    return SpecError(("data.cache_dir",), f"{err} No rank was started.")


def _sizes(spec: RunSpec) -> list[SpecError]:
    """The data-size problems, or the record that stops tokenizing a corpus the cache does not keep."""
    try:
        return size_errors(spec)
    except RecordError as err:
        return [_record_error(spec, err)]
    except RefusedFile as err:
        return [_cache_error(err)]
