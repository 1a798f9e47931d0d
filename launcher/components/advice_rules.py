"""The advisor's rules over metrics records: each watches the records and speaks once it sees its problem.

The rules come from the troubleshooting tables of training guides (input-bound steps, loss spikes,
fp16 scale collapse, low utilization, allocator fragmentation) and read only what the engine
already logs (launcher/rank/engine.py `_log_record`). Each is a small class with an `id`, its
thresholds as named constants below, and `check(record) -> message | None`; the Advisor
(launcher/components/advice.py) prints a message once per id. Pure Python, no torch: a test feeds them
synthetic record streams.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

from launcher.components.advice_moe import moe_rules
from launcher.components.advice_rl import rl_rules

GiB = 1024**3

DATA_WAIT_FRACTION = 0.10
"""Advise when waiting for data (time_data_s) takes more than this share of the timed step phases."""
DATA_WAIT_MIN_RECORDS = 2
"""Training records after the first (warm-up: workers start, caches fill) that the share is measured over."""

SPIKE_WINDOW = 20
"""Records of the rolling window a loss or grad-norm spike is measured against."""
SPIKE_MIN_RECORDS = 8
"""Records the window must hold before a spike can be judged."""
SPIKE_Z = 6.0
"""A value more than this many standard deviations above the window's mean is a spike."""
SPIKE_MIN_RATIO = {"loss": 1.2, "grad_norm": 2.0}
"""...and at least this multiple of the window's mean (a quiet curve's small wobble is many deviations but no spike)."""
SPIKE_REL_STD_FLOOR = 0.02
"""The window's standard deviation is taken as at least this share of its mean (a flat curve's tiny noise is no spike)."""

LOSS_SCALE_FLOOR = 1.0
"""An fp16 loss scale below this has collapsed: gradients underflow in fp16 even after scaling."""
LOSS_SCALE_HALVINGS = 10
"""Halvings below the highest loss scale seen (2**10 = 1024x lower) that count as a collapse."""
OVERFLOW_FRACTION = 0.05
"""Advise when more than this share of steps since the first record were skipped as fp16 overflows."""
OVERFLOW_MIN_STEPS = 20
"""Steps after the first record before the overflow share is judged (the first steps find the scale)."""

LOW_MFU = 0.20
"""Model FLOPs utilization below this on a GPU is low (well-tuned dense training reaches 0.35-0.6)."""
MFU_WARMUP_RECORDS = 3
"""Records skipped before MFU is judged (compilation, allocator warm-up, cold caches)."""
MFU_MIN_RECORDS = 2
"""Records after the warm-up whose median MFU is judged."""

RESERVED_RATIO = 1.5
"""Advise when the CUDA caching allocator reserves more than this multiple of the peak allocated bytes..."""
RESERVED_GAP_BYTES = 1 * GiB
"""...and the reserved-but-unallocated memory is more than this."""

STUCK_RECORDS = 10
"""Consecutive preference records (after the first) with chance accuracy and no margin before the advisor speaks."""
STUCK_MARGIN = 0.01
"""A rewards/margins below this (in absolute value) is no margin."""
ZERO_RECORDS = 2
"""Consecutive records (after the first) whose rewards and margins are exactly 0 before the advisor speaks."""
STUCK_ACCURACY = (0.35, 0.65)
"""A rewards/accuracy in this range is chance (exact ties count as 0 accuracy, so 0 with a zero margin is too)."""
FALLING_RECORDS = 8
"""Consecutive records over which logps/chosen falling at every record is the known DPO failure..."""
FALLING_DROP = 1.0
"""...once it has fallen by more than this many nats in all (a small wobble is not a trend)."""


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


class DataWait:
    """The loop waits for data: an input-bound run leaves the accelerator idle."""

    id = "data_wait"

    def __init__(self) -> None:
        self._seen = 0
        self._data = self._total = 0.0

    def check(self, record: dict[str, Any]) -> str | None:
        phases = {  # the step's phases; time_checkpoint_s is a save holding the loop, not step time
            k: v
            for k, v in record.items()
            if k.startswith("time_") and k.endswith("_s") and _finite(v) and k != "time_checkpoint_s"
        }
        if "time_data_s" not in phases or "on_policy" in record:  # on-policy: the data phase is sampling
            return None
        self._seen += 1
        if self._seen == 1:  # the first log interval is warm-up
            return None
        self._data += phases["time_data_s"]
        self._total += sum(phases.values())
        share = self._data / self._total if self._total > 0 else 0.0
        if self._seen - 1 < DATA_WAIT_MIN_RECORDS or share <= DATA_WAIT_FRACTION:
            return None
        return (
            f"waiting for data takes {share:.0%} of step time (above {DATA_WAIT_FRACTION:.0%}): the run is "
            "input-bound. Let loader processes build micro batches ahead (data.num_workers=2 or more: prefetched, "
            "and pinned on CUDA), use a pre-tokenized corpus rather than tokenizing while streaming "
            "(data.streaming=false), and pack short sequences (data.packing=true)."
        )


class Spike:
    """A sudden jump of a training curve (loss or gradient norm) above its recent past."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.id = f"{key}_spike"
        self._window: deque[float] = deque(maxlen=SPIKE_WINDOW)

    def check(self, record: dict[str, Any]) -> str | None:
        value = record.get(self.key)
        if not _finite(value):  # non-finite steps are the non-finite guard's (skipped, counted)
            return None
        if (
            self.key == "loss" and "equal_groups" in record
        ):  # a policy-gradient surrogate sits near 0: no scale
            return None
        window, message = self._window, None
        if len(window) >= SPIKE_MIN_RECORDS:
            mean = statistics.fmean(window)
            std = max(statistics.pstdev(window), SPIKE_REL_STD_FLOOR * abs(mean), 1e-12)
            z = (value - mean) / std
            if z > SPIKE_Z and value > SPIKE_MIN_RATIO[self.key] * mean:
                message = self._message(record.get("step"), value, mean, z)
        window.append(value)
        return message

    def _message(self, step: Any, value: float, mean: float, z: float) -> str:
        what = "loss" if self.key == "loss" else "gradient norm"
        return (
            f"{what} spiked at step {step}: {value:.4g}, {z:.0f} standard deviations above the mean {mean:.4g} of "
            f"the last {len(self._window)} records. Lower optimizer.lr or lengthen scheduler.warmup_steps, clip "
            "gradients (train.max_grad_norm=1.0), and in an fp16 run train in bf16 instead (precision=bf16) where "
            "the hardware has it; look at the data near this step too."
        )


def _bf16_hint(bf16_capable: bool) -> str:
    if bf16_capable:
        return "Train in bf16 instead (precision=bf16): it has fp32's range and needs no loss scaling."
    return (
        "bf16 (precision=bf16) would need no loss scaling but this device lacks it; lower optimizer.lr, clip "
        "gradients (train.max_grad_norm) or keep the sensitive parts in fp32."
    )


class LossScale:
    """fp16's dynamic loss scale keeps falling: values overflow fp16 again and again."""

    id = "fp16_loss_scale"

    def __init__(self, *, bf16_capable: bool) -> None:
        self.bf16_capable = bf16_capable
        self._highest = 0.0

    def check(self, record: dict[str, Any]) -> str | None:
        scale = record.get("loss_scale")
        if not _finite(scale):
            return None
        self._highest = max(self._highest, scale)
        collapsed = scale < LOSS_SCALE_FLOOR or scale <= self._highest / 2**LOSS_SCALE_HALVINGS
        if not collapsed:
            return None
        return (
            f"the fp16 loss scale fell to {scale:g} at step {record.get('step')} (highest so far {self._highest:g}; "
            f"advised below {LOSS_SCALE_FLOOR:g} or {2**LOSS_SCALE_HALVINGS}x under the highest): gradients overflow "
            f"fp16 again and again. {_bf16_hint(self.bf16_capable)}"
        )


class Overflows:
    """fp16 steps skipped for overflow pile up: the run trains on fewer steps than it counts."""

    id = "fp16_overflow"

    def __init__(self, *, bf16_capable: bool) -> None:
        self.bf16_capable = bf16_capable
        self._first: tuple[int, int] | None = None  # (step, overflow_skips) of the first record

    def check(self, record: dict[str, Any]) -> str | None:
        skips, step = record.get("overflow_skips"), record.get("step")
        if skips is None or step is None or "loss" not in record:
            return None
        if self._first is None:
            self._first = (step, skips)
            return None
        steps, skipped = step - self._first[0], skips - self._first[1]
        if steps < OVERFLOW_MIN_STEPS or skipped <= OVERFLOW_FRACTION * steps:
            return None
        return (
            f"{skipped} of the last {steps} steps (to step {step}) were skipped for fp16 overflow, more than "
            f"{OVERFLOW_FRACTION:.0%}. {_bf16_hint(self.bf16_capable)}"
        )


class LowMfu:
    """The GPU does little useful math: small kernels, syncs or fp32 keep it waiting."""

    id = "low_mfu"

    def __init__(self) -> None:
        self._values: list[float] = []

    def check(self, record: dict[str, Any]) -> str | None:
        mfu = record.get("mfu")
        if not _finite(mfu):
            return None
        self._values.append(mfu)
        judged = self._values[MFU_WARMUP_RECORDS:]
        if len(judged) < MFU_MIN_RECORDS or statistics.median(judged) >= LOW_MFU:
            return None
        return (
            f"MFU is {statistics.median(judged):.0%} (median after warm-up, below {LOW_MFU:.0%}): the GPU waits "
            "more than it computes. Compile the model (compile=default), raise train.micro_batch_size (or "
            "memory=auto_batch), train in bf16 (precision=bf16), and log less often (train.log_every: each log "
            "step syncs the device)."
        )


class ReservedMemory:
    """The CUDA caching allocator holds far more than the tensors need: fragmentation."""

    id = "cuda_fragmentation"

    def check(self, record: dict[str, Any]) -> str | None:
        reserved, allocated = record.get("mem_reserved_bytes"), record.get("mem_peak_bytes")
        if not (_finite(reserved) and _finite(allocated)):
            return None
        if reserved <= RESERVED_RATIO * allocated or reserved - allocated <= RESERVED_GAP_BYTES:
            return None
        return (
            f"CUDA reserves {reserved / GiB:.1f} GiB but the tensors peaked at {allocated / GiB:.1f} GiB: the caching "
            "allocator is fragmented (varying shapes: token-budget batches, unpacked sequences). Let it grow "
            "segments instead (memory.cuda_alloc_conf=expandable_segments:True), or keep shapes fixed (packing)."
        )


class PreferenceStuck:
    """A preference run whose rewards never separate: accuracy at chance and zero margins."""

    id = "preference_stuck"

    def __init__(self) -> None:
        self._seen = self._stuck = self._zero = 0

    def check(self, record: dict[str, Any]) -> str | None:
        accuracy, margin = record.get("rewards/accuracy"), record.get("rewards/margins")
        if not (_finite(accuracy) and _finite(margin)):
            return None
        self._seen += 1
        chance = STUCK_ACCURACY[0] <= accuracy <= STUCK_ACCURACY[1] or (accuracy == 0 and margin == 0)
        self._stuck = self._stuck + 1 if self._seen > 1 and chance and abs(margin) < STUCK_MARGIN else 0
        zero = all(record.get(k) == 0 for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"))
        self._zero = self._zero + 1 if self._seen > 1 and zero else 0
        if self._zero >= ZERO_RECORDS:
            return (
                f"rewards and margins have been exactly 0 for {self._zero} records: the policy's log-probs equal "
                "the reference's on every pair, so nothing trains (loss ln 2). Either no response token is "
                "trained (prompts longer than data.seq_len, blank responses: raise data.seq_len) or the policy "
                "does not move (optimizer.lr, frozen layers, LoRA targets)."
            )
        if self._stuck < STUCK_RECORDS:
            return None
        return (
            f"rewards/accuracy has sat at {accuracy:.2f} with margins {margin:.2g} for {self._stuck} records: the "
            "policy does not move away from its reference. Raise objective.beta (0.1 is usual) or optimizer.lr, "
            "check that chosen and rejected differ in the data, and that the policy trains (LoRA targets, "
            "frozen layers)."
        )


class ChosenFalling:
    """The chosen responses' log-probs fall steadily: the policy lowers both sides (the known DPO failure)."""

    id = "chosen_logps_falling"

    def __init__(self) -> None:
        self._window: deque[float] = deque(maxlen=FALLING_RECORDS)

    def check(self, record: dict[str, Any]) -> str | None:
        value = record.get("logps/chosen")
        if not _finite(value):
            return None
        self._window.append(value)
        window = list(self._window)
        if len(window) < FALLING_RECORDS or any(b >= a for a, b in zip(window, window[1:], strict=False)):
            return None
        if window[0] - window[-1] <= FALLING_DROP:
            return None
        return (
            f"logps/chosen fell at each of the last {len(window)} records ({window[0]:.4g} -> {window[-1]:.4g}): "
            "the policy pushes the rejected responses down by lowering the chosen ones too. Lower optimizer.lr, "
            "raise objective.beta, or add an NLL term on the chosen side (objective=orpo, or SFT first)."
        )


def record_rules(*, bf16_capable: bool, moe_load_ceiling: float = 0.0, moe_folder: bool = False) -> list[Any]:
    """Every rule over training records, in the order they are checked (`moe_load_ceiling`: num_experts / top_k
    of the model's MoE blocks, 0 without; `moe_folder`: they are a Hugging Face folder's MoE layers)."""
    return [
        DataWait(),
        Spike("loss"),
        Spike("grad_norm"),
        LossScale(bf16_capable=bf16_capable),
        Overflows(bf16_capable=bf16_capable),
        LowMfu(),
        ReservedMemory(),
        PreferenceStuck(),
        ChosenFalling(),
        *rl_rules(),
        *moe_rules(load_ceiling=moe_load_ceiling, folder=moe_folder),
    ]
