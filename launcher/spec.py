"""The run spec: one frozen, typed object holding every decision of a run, and its (de)serialization.

This is the contract that crosses spec.yaml: the launching process composes a config (Hydra, in
launcher.front), `to_spec` rejects keys the schema does not know (also those smuggled in with
`+key=value`) and builds the frozen object, `dump_spec` writes it; a rank reads it back with
`load_spec` (OmegaConf only, never Hydra). Each config group fills one field of `RunSpec`; its
schema lives with the group (launcher.components).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from launcher.config.aliases import alias_hint
from launcher.config.best import EarlyStopConfig
from launcher.config.checkpoint import CheckpointConfig
from launcher.config.compile import CompileConfig
from launcher.config.data import DataConfig
from launcher.config.distill import DistillConfig
from launcher.config.eval import EvalConfig
from launcher.config.launcher import LauncherConfig
from launcher.config.log import LogConfig
from launcher.config.logger import LoggerConfig
from launcher.config.memory import MemoryConfig
from launcher.config.model import ModelConfig
from launcher.config.objective import ObjectiveConfig
from launcher.config.optimizer import OptimizerConfig
from launcher.config.parallel import ParallelConfig
from launcher.config.precision import PrecisionConfig
from launcher.config.profiler import ProfilerConfig
from launcher.config.prune import PruneConfig
from launcher.config.qat import QatConfig
from launcher.config.quantization import QuantizationConfig
from launcher.config.redact import redacted
from launcher.config.reward import RewardConfig
from launcher.config.scheduler import SchedulerConfig
from launcher.config.sweep import SweepConfig
from launcher.config.tokenizer import TokenizerConfig


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The loop's own settings: length, batch, clipping, evaluation and logging cadence."""

    max_steps: int = 300
    """Optimizer steps to train for."""
    micro_batch_size: int = 16
    """Sequences per rank per forward/backward pass."""
    grad_accum_steps: int = 1
    """Micro batches accumulated per optimizer step (global batch = micro x accum x world size)."""
    seed: int = 1234
    """Seed of model init, data order and every RNG the loop uses."""
    loss_chunks: str = "auto"
    """Final projection + cross-entropy over this many chunks of tokens, each recomputed in backward (1: whole
    logits); auto chunks only when a micro batch's float32 logits pass 256 MiB (launcher.components.model.long_context)."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this value; null turns clipping off."""
    eval_every: int | None = 100
    """Optimizer steps between evaluations (and one at the end, see eval_at_end); null: none between."""
    eval_at_end: bool | None = None
    """Evaluate after the last step: null (auto) when max_steps >= eval_every, so a run shorter than one
    evaluation interval ends without one; true always (also with eval_every=null); false never."""
    eval_batches: int = 8
    """Micro batches of held-out data per evaluation."""
    log_every: int = 10
    """Optimizer steps between metrics records (the only steps that read values back from the device)."""
    on_nonfinite: str = "skip"
    """What a non-finite loss or gradient norm does: skip (the step, counted) or stop (exit status 3)."""
    max_nonfinite_skips: int = 20
    """Skipped non-finite steps after which the run stops anyway (exit status 3)."""
    max_nonfinite_fraction: float = 0.5
    """Stop (exit status 3) when more than this share of the last nonfinite_window_steps steps were skipped."""
    nonfinite_window_steps: int = 20
    """Optimizer steps the skipped share is measured over (once this session has run that many)."""
    stop_after: int | None = None
    """End this session after this optimizer step, with a checkpoint; the schedule still spans max_steps."""
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    advice: bool = True
    """Print run-time advice (input-bound steps, loss spikes, fp16 scale collapse, ...) once each, and list it
    in summary.json; false silences it (docs/monitoring.md)."""

    def evaluates_at_end(self) -> bool:
        """Whether the run evaluates after its last step (eval_at_end, or auto: max_steps >= eval_every)."""
        if self.eval_at_end is not None:
            return self.eval_at_end
        return self.eval_every is not None and self.max_steps >= self.eval_every

    def evaluates(self) -> bool:
        """Whether the run makes any evaluation (every eval_every steps up to max_steps, or at the end), so
        needs held-out data: the loop's own test (launcher.rank.engine), so a short run asks for none."""
        between = bool(self.eval_every) and self.max_steps >= self.eval_every
        return between or self.evaluates_at_end()


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """Every decision of a run; `spec.yaml` in the run directory serializes exactly this."""

    name: str = "run"
    """Run name, used in the default run directory."""
    run_dir: str | None = None
    """Where the run writes; null: runs/<name>-<timestamp> (or the sweep's job directory)."""
    resume: str | None = None
    """null (fresh start), auto (newest complete checkpoint of run_dir, else fresh) or a path."""
    dry_run: Any = False
    """true: print the keys that differ from the schema's defaults (all: every key), the verdict and
    the launch plan, and start nothing; simulate: also build one rank of each role on a fake process
    group with fake tensors and step it; false, true, all or simulate (a name, so not typed bool)."""
    simulate_hardware: str = "h100_sxm"
    """The hardware profile `dry_run=simulate` predicts the step on (launcher.plan.roofline.HARDWARE), and the GPU
    a dry run with launcher.device=cuda is judged against where this machine has none."""
    verify_resume: bool = False
    """Check exact resume on this spec: N steps straight vs N/2 + resume, losses compared step by step."""
    profile: bool = False
    """Record torch.profiler traces of a few steps into RUN_DIR/profile/ and print the top operators."""
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    qat: QatConfig = field(default_factory=QatConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)


@dataclass(frozen=True)
class SpecError:
    """One violated rule: the keys involved and a paragraph saying what is wrong and how to fix it."""

    keys: tuple[str, ...]
    message: str

    def __str__(self) -> str:
        return f"{', '.join(self.keys)}: {self.message}"


class InvalidSpec(Exception):
    """The spec broke one or more rules; nothing may be started."""

    def __init__(self, errors: list[SpecError]) -> None:
        super().__init__("\n".join(str(e) for e in errors))
        self.errors = errors


def _thaw(node: Any) -> Any:
    """Clear the read-only flags OmegaConf puts on frozen dataclasses, so overrides can merge."""
    node._set_flag("readonly", None)
    if isinstance(node, DictConfig):
        for key in node:
            _thaw(node._get_node(key))
    return node


@functools.cache
def _schema_template() -> DictConfig:
    """The thawed structured config of RunSpec, built once per process (OmegaConf.structured walks every dataclass)."""
    return _thaw(OmegaConf.structured(RunSpec))


def schema_node() -> DictConfig:
    """The RunSpec schema as a mutable structured config, defaults filled in (a fresh copy on each call)."""
    return copy.deepcopy(_schema_template())


def schema_fields(schema: type) -> dict[str, Any]:
    """Field name -> resolved type annotation of a schema dataclass."""
    return typing.get_type_hints(schema)


def entry_schema(annotation: Any) -> type | None:
    """The dataclass of a `tuple[Entry, ...]` field (a list of entries such as data.sources), else None."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0] if dataclasses.is_dataclass(args[0]) else None
    return None


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    """' Did you mean X?' for the closest choice, or an empty string."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]}?" if close else ""


def unknown_key_error(path: str, known: typing.Iterable[str]) -> SpecError:
    """The error for a key the schema does not define."""
    leaf = path.rsplit(".", 1)[-1]
    if leaf == "_target_":
        return SpecError(
            (path,),
            "configs may not name code to import or call: the launcher builds every component "
            "from registered names only, so `_target_` is refused. Pick an option of the group instead.",
        )
    known = sorted(known)
    return SpecError(
        (path,),
        f"unknown key.{_hint(path, leaf, known)} Known keys here: {', '.join(known)}.",
    )


def _hint(path: str, leaf: str, known: list[str]) -> str:
    """Another tool's name for one of our keys, the same name in another section, or the closest name here."""
    alias = alias_hint(leaf)
    if alias is not None:
        return f" `{leaf}` is another tool's name: {alias}."
    elsewhere = [k for k in public_keys() if k.rsplit(".", 1)[-1] == leaf and k != path]
    if elsewhere:  # the shallowest first: `seed` is train.seed before eval.generation.seed
        depth = min(k.count(".") for k in elsewhere)
        return f" Did you mean {' or '.join(k for k in elsewhere if k.count('.') == depth)}?"
    return did_you_mean(leaf, known)


def unknown_keys(cfg: DictConfig, schema: type = RunSpec, prefix: str = "") -> list[SpecError]:
    """Every key of `cfg` the schema does not define, recursively, with a did-you-mean hint."""
    fields = schema_fields(schema)
    errors = []
    for key in cfg:
        path = f"{prefix}{key}"
        if key not in fields:
            errors.append(unknown_key_error(path, fields))
            continue
        sub = fields[key]
        node = cfg._get_node(key)
        if dataclasses.is_dataclass(sub) and isinstance(node, DictConfig) and not node._is_missing():
            errors.extend(unknown_keys(node, sub, f"{path}."))
        entry = entry_schema(sub)
        if entry is not None and isinstance(node, ListConfig) and not node._is_missing():
            for index, item in enumerate(node):
                if isinstance(item, DictConfig):
                    errors.extend(unknown_keys(item, entry, f"{path}[{index}]."))
    return errors


def missing_values(cfg: DictConfig) -> list[SpecError]:
    """Mandatory values (`???`) nobody set, e.g. data.path for data=text."""
    errors = []
    for path in _leaf_paths(cfg):
        parent, _, leaf = path.rpartition(".")
        if OmegaConf.is_missing(OmegaConf.select(cfg, parent) if parent else cfg, leaf):
            errors.append(
                SpecError(
                    (path,), f"a value is required here: set it on the command line, e.g. `{path}=...`."
                )
            )
    return errors


def _leaf_paths(cfg: DictConfig, prefix: str = "") -> list[str]:
    paths = []
    for key in cfg:
        node = cfg._get_node(key)
        path = f"{prefix}{key}"
        if isinstance(node, DictConfig) and not node._is_missing():
            paths.extend(_leaf_paths(node, f"{path}."))
        else:
            paths.append(path)
    return paths


def to_spec(cfg: DictConfig) -> RunSpec:
    """Check keys and mandatory values, then build the frozen RunSpec (raises InvalidSpec)."""
    errors = unknown_keys(cfg) + missing_values(cfg)
    if errors:
        raise InvalidSpec(errors)
    typed = OmegaConf.merge(schema_node(), cfg)
    try:
        return OmegaConf.to_object(typed)
    except Exception as err:  # an interpolation that does not resolve, a bad env var, ...
        raise InvalidSpec([resolution_error(err)]) from err


def resolution_error(err: Exception) -> SpecError:
    """One paragraph for an interpolation that does not resolve: an unset environment variable named as such."""
    text = str(err)
    key = re.search(r"full_key: (\S+)", text)
    keys = (key.group(1),) if key else ("spec",)
    variable = re.search(r"Environment variable '([^']+)' not found", text)
    if variable:
        name = variable.group(1)
        return SpecError(
            keys,
            f"the environment variable {name} is not set, and `${{oc.env:{name}}}` needs it. Export it before "
            f"running train (`export {name}=...`), or give a default: `${{oc.env:{name},default}}`.",
        )
    return SpecError(keys, f"the config does not resolve: {text.splitlines()[0]}. Fix the interpolation.")


def spec_container(spec: RunSpec, raw: DictConfig | None = None) -> dict[str, Any]:
    """The spec as plain data, redacted against `raw`, the config it was built from (config.redact.redacted):
    a value holding what an `${oc.env:VAR}` of `raw` resolved to is written as `raw` writes it, so the spec's
    secrets never reach spec.yaml.
    """
    data = OmegaConf.to_container(OmegaConf.structured(spec))
    return data if raw is None else redacted(data, raw)


# spec.yaml doubles as a primary config: `train --config-path RUN_DIR --config-name spec run_dir=NEW`
# composes it against the same schema, with Hydra writing nothing, and reproduces the run.
_SPEC_HEADER = {
    "defaults": [
        "_run_spec",
        "_self_",
        {"override hydra/job_logging": "none"},
        {"override hydra/hydra_logging": "none"},
    ],
    "hydra": {"run": {"dir": "."}, "output_subdir": None, "job": {"chdir": False}},
}
_HEADER_KEYS = tuple(_SPEC_HEADER)


def spec_text(spec: RunSpec, path: Path, raw: DictConfig | None = None) -> str:
    """The text of spec.yaml at `path`: the spec, redacted against `raw` (see spec_container), with the header
    that makes it composable."""
    body = {k: v for k, v in spec_container(spec, raw).items() if k not in _HEADER_KEYS}
    text = OmegaConf.to_yaml(OmegaConf.create({**_SPEC_HEADER, **body}))
    return (
        "# The resolved run spec. Reproduce the run with:\n"
        f"#   train --config-path {path.parent.resolve()} --config-name spec run_dir=NEW_RUN_DIR\n{text}"
    )


def dump_spec(spec: RunSpec, path: Path, raw: DictConfig | None = None) -> None:
    """Write spec.yaml (see spec_text) atomically."""
    write_atomically(path, spec_text(spec, path, raw))


def write_atomically(path: Path, text: str) -> None:
    """Write a file through a temporary beside it: a reader (a rank waiting for spec.yaml) never sees half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


class SpecFileError(ValueError):
    """A spec.yaml that is not the plain YAML `dump_spec` writes (e.g. a `!!python/...` tag); nothing of it ran."""


def load_spec(path: Path) -> RunSpec:
    """Read a spec.yaml written by `dump_spec` (env interpolations resolve here, in the rank).

    OmegaConf reads YAML with a safe loader: a tag that names Python (`!!python/object/apply:...`)
    builds nothing and is refused with SpecFileError naming the file.
    """
    try:
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as err:
        raise SpecFileError(
            f"{path} was refused: it is not the plain YAML a run writes ({str(err).splitlines()[0]}); "
            "tags that name Python objects are never constructed, nothing in it was run. Restore the "
            "run's spec.yaml, or write the keys as plain values."
        ) from None
    if not isinstance(cfg, DictConfig):
        raise SpecFileError(
            f"{path} was refused: it holds a {type(cfg).__name__}, not the mapping of keys a run writes."
        )
    return to_spec(OmegaConf.masked_copy(cfg, [k for k in cfg if k not in _HEADER_KEYS]))


def public_keys(schema: type = RunSpec, prefix: str = "") -> list[str]:
    """Every dotted key of the public config surface, sorted."""
    keys = []
    for name, sub in schema_fields(schema).items():
        if dataclasses.is_dataclass(sub):
            keys.extend(public_keys(sub, f"{prefix}{name}."))
        else:
            keys.append(f"{prefix}{name}")
        entry = entry_schema(sub)
        if entry is not None:  # each entry's keys, e.g. data.sources[].weight
            keys.extend(public_keys(entry, f"{prefix}{name}[]."))
    return sorted(keys)
