"""The run-time advisor: advice from training guides' troubleshooting tables, from signals the run logs anyway.

An observer on rank 0 (launcher/components/loggers/observers.py). At the start of a session it judges the
setup (fp32 on a bf16 GPU, bf16 autocast on a CPU, a resumed run whose global batch changed but
whose learning rate did not); then every training record goes through the record rules of
launcher/components/advice_rules.py. Each piece of advice is printed once, in a box, when it first
applies, and the summary lists them all under `advice` ({"id", "step", "message"} each).
`train.advice=false` silences it. docs/monitoring.md lists the rules and their thresholds.

No torch at import: CUDA facts are read inside the function that needs them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.components.advice_rules import record_rules
from launcher.components.files.records import read_advice_state
from launcher.components.files.safe_load import RefusedFile

if TYPE_CHECKING:
    from launcher.components.loggers.observers import RunContext

STATE_FILE = "advice_state.json"
"""The advisor's own file in the run directory: the global batch and learning rate of the latest session."""

CPU_BF16_NOTE = (
    "bf16 autocast on a CPU is for matching a GPU run's numerics, not for speed: on CPUs without native bf16 "
    "matrix units (AMX or AVX512-BF16) it is emulated and usually slower than fp32. Measured with the default "
    "model (gpt_tiny, micro batch 16 x 128 tokens, 20 steps) on a 2-core AMD EPYC with AVX2 only: about "
    "1,700 tokens/s in fp32 and 330 in bf16, 5x slower. Use precision=fp32 here unless you compare numerics."
)
"""Two runs each, `train precision=fp32|bf16 train.max_steps=20` (median tokens/s 1817, 1586 vs 359, 295)."""


@dataclass(frozen=True, kw_only=True)
class Advice:
    """One piece of advice, as summary.json lists it."""

    id: str
    """Which rule spoke (one piece per id per session)."""
    step: int
    """The step whose record (or the session's start) made it apply."""
    message: str
    """What was seen and what to do about it."""


def cuda_bf16_supported() -> bool:
    """Whether the visible GPU runs bf16 natively (Ampere or newer)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


def precision_advice(precision: str, device_type: str, *, bf16_capable: bool) -> list[tuple[str, str]]:
    """(id, message) about the precision chosen for this device, judged once at the start."""
    if device_type == "cuda" and precision == "fp32" and bf16_capable:
        return [
            (
                "fp32_on_bf16_gpu",
                "this GPU runs bf16 natively but the run trains in fp32: precision=bf16 (autocast, fp32 weights "
                "and optimizer state) is typically 2x or more faster and halves activation memory, with the same "
                "range as fp32. Keep fp32 only to compare numerics.",
            )
        ]
    if device_type == "cpu" and precision == "bf16":
        return [("bf16_on_cpu", CPU_BF16_NOTE)]
    return []


def lr_rule(optimizer: str) -> str:
    """The learning-rate scaling rule for a batch change: linear for SGD, square root for adaptive optimizers."""
    return "linear" if optimizer == "sgd" else "sqrt"


def batch_advice(
    previous: dict[str, Any] | None, *, global_batch: int, lr: float, optimizer: str
) -> str | None:
    """Advice when the previous session trained with another global batch at the same learning rate."""
    if not previous or previous.get("global_batch") in (None, global_batch):
        return None
    before = int(previous["global_batch"])
    if not math.isclose(float(previous.get("lr", math.nan)), lr, rel_tol=1e-9):
        return None  # the learning rate was changed with the batch: the user has scaled it
    ratio = global_batch / before
    rule = lr_rule(optimizer)
    scaled = lr * (ratio if rule == "linear" else math.sqrt(ratio))
    why = (
        "SGD: the linear rule (Goyal et al., 2017)"
        if rule == "linear"
        else f"{optimizer}, an adaptive optimizer: the square-root rule (Malladi et al., 2022)"
    )
    other = "square-root" if rule == "linear" else "linear"
    other_lr = lr * (math.sqrt(ratio) if rule == "linear" else ratio)
    return (
        f"the global batch changed from {before} to {global_batch} sequences since the previous session, but "
        f"optimizer.lr stayed {lr:g}. Scale the learning rate with the batch; for {why} gives "
        f"optimizer.lr={scaled:.3g} (the {other} rule: {other_lr:.3g}). Or resume with the previous batch to keep "
        "the run's dynamics."
    )


def read_state(run_dir: Path, warn: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """The previous session's global batch and learning rate, if a session recorded them; a record that does
    not read back as written is named through `warn` and ignored (advice never stops a run)."""
    path = run_dir / STATE_FILE
    if not path.is_file():
        return None
    try:
        return read_advice_state(path)
    except RefusedFile as err:
        if warn is not None:
            warn(str(err))
        return None


def write_state(run_dir: Path, *, global_batch: int, lr: float) -> None:
    """Record this session's global batch and learning rate for the next session to compare."""
    path = run_dir / STATE_FILE
    tmp = path.with_suffix(".json.tmp")
    try:
        tmp.write_text(json.dumps({"global_batch": global_batch, "lr": lr}) + "\n")
        tmp.replace(path)
    except OSError:  # advice never stops a run; the next session just cannot compare
        pass


class Advisor:
    """Prints each piece of advice once per session and lists them in the summary (an Observer)."""

    def __init__(
        self,
        context: RunContext,
        *,
        precision: str,
        global_batch: int,
        lr: float,
        optimizer: str,
        enabled: bool = True,
        bf16_capable: bool | None = None,
        moe_load_ceiling: float = 0.0,
        moe_folder: bool = False,
    ) -> None:
        self.console, self.enabled = context.console, enabled
        self.given: list[Advice] = []
        if bf16_capable is None:
            bf16_capable = context.device_type == "cpu" or (
                context.device_type == "cuda" and cuda_bf16_supported()
            )
        resumed = context.session > 0 or context.start_step > 0
        previous = read_state(context.run_dir, self._warn) if resumed else None
        write_state(context.run_dir, global_batch=global_batch, lr=lr)
        self.rules = record_rules(
            bf16_capable=bf16_capable, moe_load_ceiling=moe_load_ceiling, moe_folder=moe_folder
        )
        start = precision_advice(precision, context.device_type, bf16_capable=bf16_capable)
        batch = batch_advice(previous, global_batch=global_batch, lr=lr, optimizer=optimizer)
        if batch:
            start.append(("lr_not_scaled", batch))
        for rule_id, message in start:
            self.give(rule_id, context.start_step, message)

    def _warn(self, message: str) -> None:
        """One console line about the advisor's own file."""
        self.console.print(f"warning: {message}", markup=False, highlight=False, soft_wrap=True)

    def give(self, rule_id: str, step: int, message: str) -> None:
        """Print `message` in a box unless advice `rule_id` was already given this session."""
        if not self.enabled or any(a.id == rule_id for a in self.given):
            return
        from rich.panel import Panel
        from rich.text import Text

        self.given.append(Advice(id=rule_id, step=step, message=message))
        self.console.print(
            Panel(
                Text(message),
                title=f"advice: {rule_id} (step {step})",
                subtitle="train.advice=false silences advice",
                border_style="yellow",
                expand=False,
            ),
            soft_wrap=False,  # a log file's console does not wrap lines; the box must, or it cuts them
        )

    def on_record(self, record: dict[str, Any]) -> None:
        """Run every record rule over a training record (evaluation records are not judged)."""
        if not self.enabled or "loss" not in record:
            return
        for rule in self.rules:
            if any(a.id == rule.id for a in self.given):
                continue
            message = rule.check(record)
            if message:
                self.give(rule.id, int(record.get("step", 0)), message)

    def on_finish(self, summary: dict[str, Any]) -> None:
        """List this session's advice in the summary."""
        if self.enabled:
            summary["advice"] = [asdict(a) for a in self.given]

    def close(self) -> None:
        """Nothing to release."""
