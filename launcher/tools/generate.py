"""`train-generate SOURCE --prompt TEXT`: complete a prompt with a run's model or a Hugging Face folder.

SOURCE is a run directory or a `checkpoints/step_N` directory (the model is rebuilt from spec.yaml
with the checkpoint's weights and adapters, `launcher.tools.merge.load_adapted`; the tokenizer is
the run's own, as `launcher.tools.hf_folder.load_tokenizer` gives it), or a folder holding a
Hugging Face causal LM (config.json and weights, e.g. one written by `train-export --format hf`).

Both kinds of source go through one decoder (launcher.components.model.generation: a key-value
cache, left-padded batches), so a run and its exported folder give the same tokens: each step picks
the most likely token (greedy, the default) or samples with `--temperature` / `--top-k` / `--top-p`,
and stops at eos or after `--max-new-tokens` (stderr then says how many tokens came and which of the
two stopped them, so an empty completion is explained). Token ids the tokenizer cannot spell (rows
a model pads its vocabulary with) are never chosen. When the text outgrows the model's context, the
oldest tokens are dropped from the window, and a note on stderr says so. `--prompts FILE` (JSONL)
completes many prompts, `--batch-size` at a time, and writes JSONL (launcher.tools.prompt_file). `--chat` is refused before
the model loads when the tokenizer's folder holds no chat template. argparse answers `--help` and
argument errors before torch or transformers is imported.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.components.data.tokenizer_folder import refuse_custom_tokenizer
from launcher.components.files.safe_load import RefusedFile, refusing_folder
from launcher.components.files.tokenizer_file import load_failure
from launcher.components.model.hf_files import refuse_custom_code
from launcher.components.model.hf_weights import folder_problems
from launcher.exits import ExitStatus
from launcher.spec import load_spec
from launcher.tools.hf_folder import ExportError, load_tokenizer
from launcher.tools.prompt_file import read_prompts, record, write_lines
from launcher.tools.tool_args import output_file_problem, tool_parser

if TYPE_CHECKING:  # torch is imported where it is used, after the arguments are parsed
    from launcher.components.model.generation import Completion, Model


@dataclass(frozen=True, kw_only=True)
class Source:
    """What generation needs of a model source."""

    model: Model
    """The model (decoded with its key-value cache), or a function from token ids [B, T] to logits."""
    tokenizer: Any
    """A transformers tokenizer."""
    context: int
    """Tokens the model sees at once (its position count)."""
    eos_ids: tuple[int, ...]
    """Token ids that end the completion."""
    add_special_tokens: bool
    """Whether encoding the prompt lets the tokenizer add its own special tokens (bos)."""
    bos_id: int | None
    """A bos id to put before the prompt ourselves (a run trained with tokenizer.add_bos), else None."""


DESCRIPTION = (
    "Complete a prompt with a run's model (run or step_N directory) or a Hugging Face folder; "
    "greedy unless --temperature or --top-p ask for sampling. Exit status 2: bad input."
)
"""`train-generate --help`'s description."""


def _ids(value: Any) -> tuple[int, ...]:
    """None, an id or a list of ids as a tuple."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def run_source(path: Path) -> Source:
    """A run directory or step_N directory: the model as training built it, with its checkpoint's weights."""
    from launcher.tools.merge import checkpoint_dir, load_adapted

    spec, model = load_adapted(checkpoint_dir(path))
    tokenizer = load_tokenizer(spec.tokenizer)
    if spec.tokenizer.kind == "bytes":
        eos, bos = 0, None
    else:
        eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id if spec.tokenizer.add_bos else None
    return Source(
        model=model, tokenizer=tokenizer, context=spec.model.max_seq_len,
        eos_ids=_ids(eos), add_special_tokens=False, bos_id=bos,
    )  # fmt: skip


def folder_source(path: Path) -> Source:
    """A Hugging Face folder: AutoModelForCausalLM and AutoTokenizer, local files only, no remote code."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launcher.components.model.hf import HFCausalLM

    local = {"local_files_only": True, "trust_remote_code": False}
    refuse_custom_code(str(path))
    _refuse_mismatched_weights(path)
    with refusing_folder(path):  # pytorch_model.bin weights-only, safetensors' header checked
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **local).eval()
    refuse_custom_tokenizer(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **local)
    except (ImportError, RefusedFile):  # a missing package, or a file that needs code: their messages say so
        raise
    except Exception as err:  # transformers' KeyError and the tokenizers library's errors name no file
        raise ExportError(load_failure(str(path), err) + ".") from None
    config = model.config
    context = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    eos = _ids(model.generation_config.eos_token_id) or _ids(tokenizer.eos_token_id)
    return Source(
        model=HFCausalLM(model), tokenizer=tokenizer,
        context=int(context or tokenizer.model_max_length), eos_ids=eos, add_special_tokens=True, bos_id=None,
    )  # fmt: skip


def _refuse_mismatched_weights(path: Path) -> None:
    """ExportError (exit 2) when the folder's weights do not fit its config.json, as `train` refuses the folder."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as err:
        raise ExportError(f"'{path / 'config.json'}' does not load as a model config ({err}).") from None
    problems = folder_problems(path, config)
    if problems:
        raise ExportError(" ".join(problems))


def open_source(path: Path) -> Source:
    """The source `path` names; ExportError (exit 2) when it is neither a run nor a Hugging Face folder."""
    path = Path(path)
    if (path / "config.json").is_file():
        return folder_source(path)
    if path.is_dir() and (path.name.startswith("step_") or (path / "spec.yaml").is_file()):
        try:
            return run_source(path)
        except FileNotFoundError as err:
            raise ExportError(str(err)) from err
    raise ExportError(
        f"{path} is neither a run directory (spec.yaml and checkpoints/step_N), a step_N directory, nor a "
        "Hugging Face folder (config.json and weights). Give one of those, e.g. a folder written by "
        "`train-export RUN_DIR OUT --format hf`."
    )


CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
"""Where transformers saves a tokenizer's chat template besides tokenizer_config.json's `chat_template`."""


def _has_chat_template(folder: Path) -> bool:
    """Whether a tokenizer folder holds a chat template (read from its files, without loading it)."""
    if any((folder / name).is_file() for name in CHAT_TEMPLATE_FILES):
        return True
    if (folder / "additional_chat_templates").is_dir():
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def chat_problem(path: Path) -> str | None:
    """Why --chat cannot work for the source `path` (its tokenizer has no chat template), before the model loads."""
    path = Path(path)
    if (path / "config.json").is_file():
        folder = path
    else:
        spec_path = path / "spec.yaml" if (path / "spec.yaml").is_file() else path.parent.parent / "spec.yaml"
        if not spec_path.is_file():
            return None  # open_source says what is wrong with the path
        tokenizer = load_spec(spec_path).tokenizer
        if tokenizer.kind == "bytes":
            return (
                f"--chat renders the prompt with the tokenizer's chat template, but the run {spec_path.parent} "
                "trained with the byte tokenizer (tokenizer=bytes), which has none. Drop --chat, or give a run "
                "trained with a tokenizer folder that has a chat template (tokenizer=hf tokenizer.path=DIR)."
            )
        folder = Path(tokenizer.path or "")
    if _has_chat_template(folder):
        return None
    return (
        f"--chat renders the prompt with the tokenizer's chat template, and the tokenizer in {folder} has none "
        "(no chat_template in its tokenizer_config.json, no chat_template.jinja). Add one: put the template in "
        "chat_template.jinja in that folder (or set tokenizer.chat_template and call "
        "tokenizer.save_pretrained(FOLDER)); or drop --chat."
    )


def prompt_ids(source: Source, prompt: str, *, chat: bool) -> list[int]:
    """The prompt as token ids, through the tokenizer's chat template with `chat`."""
    tokenizer = source.tokenizer
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ExportError(
                "--chat renders the prompt with the tokenizer's chat template, and this tokenizer has none. "
                "Drop --chat, or use a run or folder whose tokenizer has one."
            )
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    ids = list(tokenizer.encode(prompt, add_special_tokens=source.add_special_tokens))
    ids = ([source.bos_id] if source.bos_id is not None else []) + ids
    if not ids:
        raise ExportError("the prompt gives no tokens to continue from: give a non-empty --prompt.")
    return ids


def stop_line(completion: Completion, source: Source, max_new_tokens: int) -> str:
    """What train-generate says on stderr after the completion: the token count and why it stopped."""
    count = len(completion.ids)
    noun = "token" if count == 1 else "tokens"
    if completion.stop == "max_new_tokens":
        return f"generated {count} {noun}; stopped at --max-new-tokens {max_new_tokens}."
    spelled = source.tokenizer.convert_ids_to_tokens(completion.eos_id)
    end = f"end token {completion.eos_id} ({spelled!r})"
    if count == 0:
        return (
            f"generated 0 tokens: the model's first choice was the {end}, so the completion is empty. "
            "A longer prompt, sampling (--temperature 0.8) or a model trained longer may continue it."
        )
    return f"generated {count} {noun}; stopped at the {end}."


def generate_all(
    source: Source, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
    top_p: float = 1.0, seed: int = 0, batch_size: int = 8, note: Callable[[str], None] = print,
) -> list[Completion]:  # fmt: skip
    """New token ids after each prompt (eos not included), `batch_size` prompts at a time; each prompt's
    sampling is seeded by its index in `prompts`, so the batch size does not change the tokens."""
    from launcher.components.model import generation

    sampling = generation.Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    said: list[str] = []

    def once(text: str) -> None:  # the context note once per command, not once per batch
        if not said:
            said.append(text)
            note(text)

    completions: list[Completion] = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        completions += generation.generate(
            source.model, batch, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=source.eos_ids,
            context=source.context, indices=range(start, start + len(batch)), vocab_limit=len(source.tokenizer),
            use_cache=hasattr(source.model, "new_cache"), note=once,
        )  # fmt: skip
    return completions


def generate(
    source: Source, ids: list[int], *, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
    top_p: float = 1.0, seed: int = 0, note: Callable[[str], None] = print,
) -> Completion:  # fmt: skip
    """New token ids after `ids` (eos not included), at most `max_new_tokens`, and why they stopped."""
    return generate_all(
        source, [ids], max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=seed, note=note,
    )[0]  # fmt: skip


def _parser() -> Any:
    """train-generate's arguments."""
    parser = tool_parser("train-generate", DESCRIPTION, folders=True)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", help="the text to complete")
    which.add_argument("--prompts", type=Path, help='a JSONL file, one {"prompt": TEXT} per line; JSONL out')
    parser.add_argument("--out", type=Path, help="with --prompts: write the JSONL here, not on stdout")
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")
    parser.add_argument("--chat", action="store_true", help="render the prompt through the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to add at most (default 64)")
    parser.add_argument("--temperature", type=float, default=None, help="sample at this temperature")
    parser.add_argument("--top-k", type=int, default=None, help="sample among this many most likely tokens")
    parser.add_argument("--top-p", type=float, default=None, help="sample from this probability nucleus")
    parser.add_argument("--seed", type=int, default=0, help="the sampling generator's seed (default 0)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts decoded together (default 8)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point of `train-generate`."""
    args = _parser().parse_args(argv)
    sampling = any(value is not None for value in (args.temperature, args.top_k, args.top_p))
    temperature = (args.temperature if args.temperature is not None else 1.0) if sampling else 0.0
    top_k, top_p = args.top_k or 0, args.top_p if args.top_p is not None else 1.0
    problem = _option_problem(args.max_new_tokens, temperature, top_p) or _batch_problem(args, top_k)
    try:
        problem = problem or (chat_problem(args.source) if args.chat else None)
        if problem:
            raise ExportError(problem)
        texts = [args.prompt] if args.prompts is None else read_prompts(args.prompts)
        source = open_source(args.source)
        prompts = [prompt_ids(source, text, chat=args.chat) for text in texts]
    except (
        ExportError,
        KeyError,
        ValueError,
    ) as err:  # ValueError: a refused file (RefusedFile, SpecFileError)
        print(f"error: {err}", file=sys.stderr)
        return ExitStatus.INVALID_SPEC
    completions = generate_all(
        source, prompts, max_new_tokens=args.max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=args.seed, batch_size=args.batch_size, note=lambda text: print(text, file=sys.stderr),
    )  # fmt: skip
    if args.prompts is None:
        print(source.tokenizer.decode(completions[0].ids))
        print(stop_line(completions[0], source, args.max_new_tokens), file=sys.stderr)
        return ExitStatus.OK
    records = [
        record(text, source.tokenizer.decode(done.ids), done.ids, done.stop)
        for text, done in zip(texts, completions, strict=True)
    ]
    write_lines(records, args.out)
    ended = sum(done.stop == "eos" for done in completions)
    print(
        f"generated {sum(len(done.ids) for done in completions)} tokens for {len(completions)} prompts; "
        f"{ended} stopped at an end token, {len(completions) - ended} at --max-new-tokens {args.max_new_tokens}.",
        file=sys.stderr,
    )
    return ExitStatus.OK


def _batch_problem(args: Any, top_k: int) -> str | None:
    """What is wrong with --top-k, --batch-size or --out, or None."""
    if top_k < 0:
        return f"--top-k must be 0 (no limit) or more, got {top_k}."
    if args.batch_size < 1:
        return f"--batch-size must be 1 or more, got {args.batch_size}."
    if args.out is not None and args.prompts is None:
        return "--out writes the JSONL of --prompts; with one --prompt the completion goes to stdout. Drop --out."
    if args.out is not None:
        return output_file_problem(args.out, force=args.force)
    return None


def _option_problem(max_new_tokens: int, temperature: float, top_p: float) -> str | None:
    """What is wrong with the sampling options, or None."""
    if max_new_tokens < 1:
        return f"--max-new-tokens must be 1 or more, got {max_new_tokens}."
    if temperature < 0:
        return f"--temperature must be 0 (greedy) or more, got {temperature}."
    if not 0 < top_p <= 1:
        return f"--top-p must be in (0, 1], got {top_p}."
    return None


if __name__ == "__main__":
    sys.exit(main())
