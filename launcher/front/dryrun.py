"""The dry run: the keys that differ from the schema's defaults with where each value came from (every
key with `dry_run=all`), the verdict, the plan.

The verdict is the real run's: the rules, then the data-size checks a run makes before it starts
(front/data_sizes.py), on the tokenized corpus (built into the token cache, or read from it), so a
spec the run would refuse is never called valid. On a machine without a GPU, `launcher.device=cuda`
is planned for the GPU `simulate_hardware` names (rules/hardware.py) and judged against its memory.
"""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from launcher.components.data import mixture
from launcher.components.data.sources import describe
from launcher.components.data.tokenizer import load_tokenizer, padded_vocab_size
from launcher.config.redact import redacted_container
from launcher.exits import ExitStatus
from launcher.front import deepspeed_file
from launcher.front.compose import Built, strip_hydra
from launcher.front.config_values import typed
from launcher.front.model_dims import describe_model, folder_dims
from launcher.front.provenance import flatten, provenance, user_dirs
from launcher.front.tokenize import prepare_data
from launcher.front.vocab import auto_reason
from launcher.launch import backend
from launcher.parallel.pipeline_split import MULTI_STAGE_SCHEDULES, bubble_fraction
from launcher.parallel.pipeline_stage import plan_stages
from launcher.plan.pipeline import PipelineLayout, PipelinePlan, RankPlan, pipeline_plan
from launcher.plan.planner import MemoryPlan, plan
from launcher.plan.render import format_bytes, plan_table
from launcher.rules import detect_hardware
from launcher.spec import RunSpec, SpecError, schema_node


def pipeline_layout(spec: RunSpec) -> PipelineLayout:
    """Where a pp run's stages sit: the plan every rank builds its own stages from."""
    p = spec.parallel
    plans = [plan_stages(spec.model, p, spec.data.seq_len, r) for r in range(p.pp_size)]
    return PipelineLayout(
        stage_layers=tuple(plans[0].ranges),
        rank_stages=tuple(tuple(plan.local) for plan in plans),
        bubble=bubble_fraction(p.pp_size, p.pp_microbatches, p.pp_schedule, p.pp_stages_per_rank),
    )


def _stage_text(rank: RankPlan, num_stages: int) -> str:
    """A rank's stages' contents, e.g. 'emb 0-1 / 4-5' (emb: the embeddings, head: final norm and LM head)."""
    parts = []
    for stage, layers in zip(rank.stages, rank.layers, strict=True):
        span = f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else f"{layers[0]}"
        parts.append(
            " ".join([*(["emb"] if stage == 0 else []), span, *(["head"] if stage == num_stages - 1 else [])])
        )
    return " / ".join(parts)


def bubble_line(pipeline: PipelinePlan, pp_size: int) -> str:
    """The schedule's theoretical bubble with its formula, e.g. 'schedule 1f1b: bubble (p-1)/(m+p-1) = 0.20'."""
    p, m, v = pp_size, pipeline.microbatches, pipeline.stages_per_rank
    multi = pipeline.schedule in MULTI_STAGE_SCHEDULES
    formula = "(p-1)/(v*m+p-1)" if multi else "(p-1)/(m+p-1)"
    values = f"p={p}, m={m}" + (f", v={v}" if multi else "")
    bound = (
        ", an upper bound: deferred weight gradients fill most of it"
        if pipeline.schedule == "zero_bubble"
        else ""
    )
    return f"schedule {pipeline.schedule}: bubble {formula} = {pipeline.bubble:.2f} ({values}{bound})"


def print_pipeline_plan(console: Console, spec: RunSpec) -> MemoryPlan:
    """Print a pp run's plan: the largest pipeline rank's memory, every rank's stages, the bubble; that rank's plan."""
    pipeline = pipeline_plan(spec, pipeline_layout(spec))
    _print_memory(console, pipeline.memory, f"; the largest pipeline rank ({pipeline.worst.pp_rank})")
    table = Table(title="pipeline stages", title_justify="left", box=None, padding=(0, 2, 0, 0))
    for column in ("pipeline rank", "stages", "layers", "params", "est. memory"):
        table.add_column(column, justify="right" if column in ("params", "est. memory") else "left")
    num_stages = len(pipeline.ranks) * pipeline.stages_per_rank
    for rank in pipeline.ranks:
        table.add_row(
            str(rank.pp_rank),
            ", ".join(str(s) for s in rank.stages),
            _stage_text(rank, num_stages),
            f"{rank.num_params / 1e6:,.2f}M",
            format_bytes(rank.memory.total),
        )
    console.print(table, highlight=False)
    console.print(bubble_line(pipeline, spec.parallel.pp_size), markup=False, highlight=False)
    return pipeline.memory


def print_plan(console: Console, spec: RunSpec) -> MemoryPlan:
    """Print the memory plan of a valid spec (on the device it runs on, or the GPU it names); that plan."""
    if spec.parallel.pp_size > 1:
        return print_pipeline_plan(console, spec)
    memory = plan(spec, device_type=detect_hardware(spec).device_type)
    _print_memory(console, memory)
    return memory


def fit_line(memory: MemoryPlan, spec: RunSpec) -> str | None:
    """Whether the plan fits the GPU it runs on, and which GPU that is (probed here, or named); None off a GPU."""
    hw = detect_hardware(spec)
    if hw.device_type != "cuda" or not hw.gpu_memory_bytes:
        return None
    where = (
        f"an {hw.gpu_name}; named, not probed: this machine has no GPU"
        if hw.requested
        else f"this machine's {hw.gpu_name or 'GPU'}"
    )
    share = memory.total / hw.gpu_memory_bytes
    return (
        f"fit: {'fits' if share <= 1 else 'does not fit'}: {format_bytes(memory.total)} per rank, {share:.0%} of "
        f"the {format_bytes(hw.gpu_memory_bytes)} of {where}"
    )


def data_check(console: Console, spec: RunSpec) -> list[SpecError]:
    """The run's own data-size checks: tokenize (or read the token cache), count, and say how long it took."""
    started = time.perf_counter()
    errors = prepare_data(spec, console)  # prints how long tokenizing took, or that the cache was reused
    elapsed = time.perf_counter() - started
    outcome = (
        "refused"
        if errors
        else "enough for one optimizer step"
        + (" and every evaluation" if spec.train.evaluates() else " (the run makes no evaluation)")
    )
    console.print(
        f"data check: {outcome} ({elapsed:.1f} s, tokenizing included)", markup=False, highlight=False
    )
    return errors


def _print_memory(console: Console, memory: MemoryPlan, which: str = "") -> None:
    """Print a memory plan: its headline (`which` says whose plan it is), its table and its notes."""
    console.print(
        f"memory plan: per {memory.device_type} device, {memory.world_size} rank(s), "
        f"{memory.num_params / 1e6:,.2f}M parameters{which}"
    )
    console.print(plan_table(memory))
    for note in memory.notes:
        console.print(f"  [dim]{note}", highlight=False)


def print_tokenizer(console: Console, spec: RunSpec, auto: str | None = None) -> None:
    """Print the tokenizer's name, size and special tokens, where model.vocab_size came from, and why auto chose it."""
    tokenizer = load_tokenizer(spec.tokenizer)
    special = ", ".join(f"{name} {token}" for name, token in tokenizer.special_tokens().items()) or "none"
    size = tokenizer.vocab_size
    rows = spec.model.vocab_size
    padding = (
        f" (padded from {size} to a multiple of 64)"
        if rows and rows > size and rows == padded_vocab_size(size)
        else ""
    )
    console.print(
        f"tokenizer: {tokenizer.name}, {size} token ids, special tokens: {special}; model.vocab_size {rows}{padding}"
        + (f"\n  chosen by tokenizer=auto: {auto}" if auto else ""),
        markup=False,
        highlight=False,
    )


def _sources(cfg: DictConfig, auto: str | None) -> dict[str, str]:
    """Dotted key -> where its value came from, the values the launcher decided included."""
    choices = dict(cfg.hydra.runtime.choices) if "hydra" in cfg else {}
    task_overrides = OmegaConf.to_container(cfg.hydra.overrides.task, resolve=False) if "hydra" in cfg else []
    sources = provenance(choices, task_overrides, user_dirs(cfg))
    sources.update({t.spec_key: t.credit for t in deepspeed_file.taken(cfg)})  # a user's DeepSpeed file
    model = typed(cfg, "model")
    for key in (folder_dims(model) if model is not None else None) or {}:
        sources[f"model.{key}"] = "the folder's config.json"
    for key in ("tokenizer.kind", "tokenizer.path", "tokenizer.add_bos") if auto else ():
        sources[key] = "tokenizer=auto"
    return sources


def show(built: Built, run_dir: Path) -> int:
    """Print the spec table with each value's source, the verdict, the memory plan and the launch plan; the exit
    status the real run would have before starting: 2 where it would be refused, else 0."""
    console = Console() if Console().is_terminal else Console(width=160)
    cfg, spec, errors = built.config, built.spec, built.errors
    choices = dict(cfg.hydra.runtime.choices) if "hydra" in cfg else {}
    values = flatten(redacted_container(strip_hydra(cfg)))
    defaults = flatten(OmegaConf.to_container(schema_node(), resolve=False))
    auto = auto_reason(spec) if spec is not None and choices.get("tokenizer") == "auto" else None
    sources = _sources(cfg, auto)
    show_all = cfg.get("dry_run") == "all"
    table = Table(title="resolved run spec", title_justify="left", box=None, padding=(0, 2, 0, 0))
    table.add_column("key")
    table.add_column("value")
    table.add_column("from")
    num_defaults = 0
    for key, value in values.items():
        changed = defaults.get(key, object()) != value
        num_defaults += not changed
        if changed:
            table.add_row(key, repr(value), sources.get(key, "schema default"))
        elif show_all:
            table.add_row(f"[dim]{key}", f"[dim]{value!r}", "[dim]schema default")
    console.print(table)
    if not show_all:
        console.print(
            f"[dim]{num_defaults} more keys at their schema defaults; `dry_run=all` lists every key."
        )
    console.print("groups: " + ", ".join(f"{g}={o}" for g, o in choices.items() if not g.startswith("hydra")))
    if errors:
        console.print(f"[red bold]verdict: invalid[/] ({len(errors)} problem(s)); nothing would be started:")
        for error in errors:
            console.print(f"  - {error}", markup=False, highlight=False)
        return ExitStatus.INVALID_SPEC
    data = mixture.describe(spec.data) if spec.data.sources else describe(spec.data)
    console.print(f"data: {data}", markup=False, highlight=False)
    refusals = data_check(console, spec)
    if refusals:
        console.print(f"[red bold]verdict: would be refused[/] ({len(refusals)} problem(s) with the data):")
        for error in refusals:
            console.print(f"  - would be refused: {error}", markup=False, highlight=False)
        console.print("dry run: nothing was started; the run itself would stop here with exit status 2.")
        return ExitStatus.INVALID_SPEC
    console.print("[green bold]verdict: valid")
    console.print(describe_model(spec.model), markup=False, highlight=False)
    print_tokenizer(console, spec, auto)
    line = fit_line(print_plan(console, spec), spec)
    if line:
        console.print(line, markup=False, highlight=False)
    console.print(f"would launch: {backend(spec.launcher.backend).describe(spec, run_dir)}")
    console.print(
        "dry run: nothing was started; no run directory was written (a tokenized corpus stays cached)."
    )
    return ExitStatus.OK
