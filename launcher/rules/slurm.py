"""Rules of the slurm backend, checked before submission: job geometry, resources, preemption settings."""

from __future__ import annotations

import shlex
import signal
from collections.abc import Iterator

from launcher.config.launcher import TIME_FORMATS, time_limit_s
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError

_UNCATCHABLE = {"KILL", "STOP"}
# sbatch options the generated script writes itself, and the key that sets each (extra_sbatch may not).
_GENERATED = {
    "nodes": "launcher.nnodes",
    "ntasks-per-node": "launcher.nproc",
    "ntasks": "launcher.nproc (tasks per node) and launcher.nnodes",
    "time": "launcher.slurm.time_min",
    "partition": "launcher.slurm.partition",
    "account": "launcher.slurm.account",
    "qos": "launcher.slurm.qos",
    "constraint": "launcher.slurm.constraint",
    "cpus-per-task": "launcher.slurm.cpus_per_task",
    "mem": "launcher.slurm.mem_gb",
    "gpus-per-node": "launcher.slurm.gpus_per_node",
    "gpus": "launcher.slurm.gpus_per_node (x launcher.nnodes)",
    "gres": "launcher.slurm.gpus_per_node",
    "job-name": "name",
    "output": "run_dir (the log is RUN_DIR/slurm/%j.out)",
    "signal": "launcher.slurm.signal and launcher.slurm.signal_lead_s",
    "requeue": "launcher.slurm.max_requeues",
    "no-requeue": "launcher.slurm.max_requeues=0",
    "open-mode": "nothing (the script appends to its log across requeues)",
}
_SHORT = {"N": "nodes", "n": "ntasks", "t": "time", "p": "partition", "A": "account", "q": "qos",
          "C": "constraint", "c": "cpus-per-task", "J": "job-name", "o": "output", "G": "gpus"}  # fmt: skip
_SIGNALS = sorted(
    s.name[3:] for s in signal.Signals if s.name.startswith("SIG") and not s.name.startswith("SIG_")
)


def _slurm(spec: RunSpec) -> bool:
    return spec.launcher.backend == "slurm"


def _geometry(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    """Tasks per node against GPUs per node; nodes against the world size the parallel group needs."""
    if not _slurm(spec):
        return
    launcher, s, p = spec.launcher, spec.launcher.slurm, spec.parallel
    if launcher.nnodes < 1:
        yield SpecError(("launcher.nnodes",), f"must be at least 1, got {launcher.nnodes}.")
        return
    if s.gpus_per_node < 0:
        yield SpecError(("launcher.slurm.gpus_per_node",), "must be 0 (CPU ranks) or more.")
    elif s.gpus_per_node and launcher.nproc != s.gpus_per_node:
        yield SpecError(
            ("launcher.nproc", "launcher.slurm.gpus_per_node"),
            f"a GPU job runs one rank per GPU, but launcher.nproc={launcher.nproc} tasks per node and "
            f"launcher.slurm.gpus_per_node={s.gpus_per_node}. Set both to the same number.",
        )
    if launcher.device == "cuda" and not s.gpus_per_node:
        yield SpecError(
            ("launcher.device", "launcher.slurm.gpus_per_node"),
            "launcher.device=cuda, but the job asks SLURM for no GPUs. Set launcher.slurm.gpus_per_node "
            "(= launcher.nproc), or use launcher.device=auto for CPU ranks.",
        )
    # Degrees against the world size are launcher.parallel.dims's (launcher.rules.sharding asks it).
    if launcher.nnodes > 1 and p.tp_size > launcher.nproc:
        yield SpecError(
            ("parallel.tp_size", "launcher.nproc"),
            f"tensor parallelism of degree {p.tp_size} would span nodes (launcher.nproc={launcher.nproc} ranks "
            "per node): its per-layer collectives need the fast links inside a node. Keep parallel.tp_size "
            "at or below launcher.nproc.",
        )
    if p.replicate_degree > 1 and launcher.nnodes > 1 and launcher.nnodes % p.replicate_degree:
        yield SpecError(
            ("parallel.replicate_degree", "launcher.nnodes"),
            f"hybrid sharding replicates over nodes, so launcher.nnodes ({launcher.nnodes}) must be a multiple "
            f"of parallel.replicate_degree ({p.replicate_degree}).",
        )


def _positive_or_null(key: str, value: float | None) -> Iterator[SpecError]:
    if value is not None and value <= 0:
        yield SpecError((key,), f"must be positive or null (the cluster's default), got {value}.")


def _resources(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    """Time, memory, CPUs, port and free-form values that must not break the script."""
    if not _slurm(spec):
        return
    s = spec.launcher.slurm
    yield from _time_limit(s.time_min)
    yield from _positive_or_null("launcher.slurm.mem_gb", s.mem_gb)
    yield from _positive_or_null("launcher.slurm.cpus_per_task", s.cpus_per_task)
    if s.port is not None and not 1024 <= s.port <= 65535:
        yield SpecError(
            ("launcher.slurm.port",), f"must lie in 1024-65535 or be null (from the job id), got {s.port}."
        )
    for key in ("partition", "account", "qos", "constraint"):
        value = getattr(s, key)
        if value is not None and (not value.strip() or any(c in value for c in "\n\r\0")):
            yield SpecError(
                (f"launcher.slurm.{key}",),
                f"{value!r} is not a usable value: give a non-empty name on one line, or null.",
            )
    for i, line in enumerate(s.extra_sbatch):
        yield from _extra_line(i, line)


def _time_limit(value: str | None) -> Iterator[SpecError]:
    try:
        seconds = time_limit_s(value)
    except ValueError:
        seconds = -1
    if seconds is not None and seconds <= 0:
        yield SpecError(
            ("launcher.slurm.time_min",),
            f"{value!r} is not a time limit: give one as sbatch --time takes it, {TIME_FORMATS}, "
            "or null for the partition's limit.",
        )


def _option_name(word: str) -> str:
    """The long name of an sbatch option word: '--nodes=3' -> nodes, '-N3' -> nodes."""
    if word.startswith("--"):
        return word[2:].split("=", 1)[0]
    return _SHORT.get(word[1:2], word[1:2])


def _extra_line(i: int, line: str) -> Iterator[SpecError]:
    key = f"launcher.slurm.extra_sbatch[{i}]"
    try:
        words = shlex.split(line)
    except ValueError as err:
        yield SpecError((key,), f"{line!r} does not parse ({err}): close its quotes.")
        return
    if any(c in line for c in "\n\r\0") or not words or not words[0].startswith("-"):
        yield SpecError(
            (key,),
            f"{line!r} is not an sbatch option: give one option per entry, on one line, e.g. '--mail-type=END'.",
        )
        return
    name = _option_name(words[0])
    if name in _GENERATED and not (name == "gres" and "gpu" not in line):
        yield SpecError(
            (key,),
            f"{line!r} sets --{name}, which the generated script already writes from {_GENERATED[name]}; "
            "with both in the script sbatch would take one silently. Remove the entry and set "
            f"{_GENERATED[name].split(' (')[0]} instead.",
        )


def _preemption(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    """The warning signal, its lead time against the time limit, and the requeue cap."""
    if not _slurm(spec):
        return
    s = spec.launcher.slurm
    name = s.signal.removeprefix("SIG")
    if name not in _SIGNALS or name in _UNCATCHABLE:
        yield SpecError(
            ("launcher.slurm.signal",),
            f"'{s.signal}' is not a signal a rank can catch. Use USR2 (the default; NCCL may use USR1) "
            "or another catchable name such as TERM.",
        )
    if s.signal_lead_s <= 0:
        yield SpecError(("launcher.slurm.signal_lead_s",), f"must be positive, got {s.signal_lead_s}.")
    elif _seconds(s.time_min) > 0 and s.signal_lead_s >= _seconds(s.time_min):
        yield SpecError(
            ("launcher.slurm.signal_lead_s", "launcher.slurm.time_min"),
            f"the warning comes {s.signal_lead_s} s before the time limit ({s.time_min}), that is, before the job "
            "starts. Lower signal_lead_s (it must exceed one step plus a checkpoint) or raise time_min.",
        )
    if s.max_requeues < 0:
        yield SpecError(("launcher.slurm.max_requeues",), "must be 0 (never requeue) or more.")


def _seconds(value: str | None) -> int:
    """Seconds of a time limit; 0 for null or one _time_limit refuses."""
    try:
        return time_limit_s(value) or 0
    except ValueError:
        return 0


RULES: tuple[Rule, ...] = (_geometry, _resources, _preemption)
"""This module's rules, in the order they report."""
