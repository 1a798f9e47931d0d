"""Rewards of online RL: built-in verifiable terms and a user's own TRL-style functions, weighted and summed.

`build_rewards(cfg, base_dir)` makes a `RewardSet` from the reward group (reading the user's files, checking
them against the digests the spec recorded); `RewardSet.score(prompts, completions, fields)` returns each
completion's weighted sum (`RewardScores.total`) and every reward's own values (`per_function`, by name).

Completions are strings, or for conversational prompts (lists of message dicts) TRL's form, a list holding
one assistant message: strings given for conversational prompts are wrapped so, for user functions, as
TRL does; built-in terms read the text. A user function may return None for a completion it does not
apply to (TRL's convention): that value is NaN in `per_function` and adds nothing to `total`.

A function that raises, returns a non-finite value or the wrong number of values raises `RewardError`,
naming the function, the prompt and the error; the loop stops the run on it with exit status 1, keeping
the newest checkpoint, and prints `stop_message(err, ...)`.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.components.rewards.terms import MissingField, TermFn, build_term
from launcher.components.rewards.user_files import RewardFileError, call_kwargs, file_path, load_function
from launcher.config.reward import RewardConfig, function_name

__all__ = ["RewardError", "RewardFileError", "RewardScores", "RewardSet", "TrainerState", "build_rewards"]

_NOT_FIELDS = ("prompt", "completion", "completion_ids")
"""Record keys TRL does not pass on as fields (they are passed as prompts, completions, completion_ids)."""


class RewardError(RuntimeError):
    """A reward failed on a batch: it raised, or returned a non-finite or wrong-length result."""

    def __init__(self, function: str, prompt: str, error: str) -> None:
        super().__init__(f"the reward '{function}' failed on the prompt {_quoted(prompt)}: {error}")
        self.function, self.prompt, self.error = function, prompt, error


@dataclass(frozen=True, kw_only=True)
class RewardScores:
    """Rewards of a batch of completions: the weighted sum and each reward's own values."""

    total: list[float]
    """Per completion: the weighted sum over every reward (a None of a user function adds nothing)."""
    per_function: dict[str, list[float]]
    """Reward name -> its unweighted values per completion (NaN where a user function returned None)."""
    logged: dict[str, list[float]] = field(default_factory=dict)
    """Scalars user functions logged through TRL's `log_metric(name, value)`, by name."""
    extra: dict[str, list[Any]] = field(default_factory=dict)
    """Columns user functions logged through TRL's `log_extra(column, values)`, one value per completion."""

    def summary(self) -> dict[str, float]:
        """reward/mean, reward/std and reward/<name>/mean, /std (over the values that are not NaN) for a metrics record."""
        out = {"reward/mean": _mean(self.total), "reward/std": _std(self.total)}
        for name, values in self.per_function.items():
            out[f"reward/{name}/mean"] = _mean(values)
            out[f"reward/{name}/std"] = _std(values)
        return out


@dataclass(frozen=True)
class TrainerState:
    """What TRL's `trainer_state` offers a reward function for shaping by progress (the attributes it reads most)."""

    global_step: int = 0
    max_steps: int = 0


@dataclass(frozen=True)
class _Reward:
    name: str
    weight: float
    term: TermFn | None = None
    function: Callable[..., Any] | None = None


class RewardSet:
    """The configured rewards, called in order on each batch (built-in terms first, then user functions)."""

    def __init__(self, rewards: Sequence[_Reward]) -> None:
        self._rewards = list(rewards)

    @property
    def names(self) -> list[str]:
        """Every reward's name, in order (the keys of RewardScores.per_function)."""
        return [r.name for r in self._rewards]

    def score(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        fields: Sequence[dict[str, Any]],
        *,
        completion_ids: Sequence[Sequence[int]] | None = None,
        step: int = 0,
        max_steps: int = 0,
    ) -> RewardScores:
        """Score one completion per prompt (prompts repeated per sample), with its record's fields; RewardError on failure."""
        num = len(prompts)
        if len(completions) != num or len(fields) != num:
            raise ValueError(
                f"{num} prompts, {len(completions)} completions and {len(fields)} records: one each"
            )
        texts = [completion_text(c) for c in completions]
        counts = [len(ids) for ids in completion_ids] if completion_ids is not None else None
        logged: dict[str, list[float]] = {}
        extra: dict[str, list[Any]] = {}
        kwargs = _trl_kwargs(prompts, completions, fields, completion_ids, TrainerState(step, max_steps))
        kwargs["log_metric"] = lambda name, value: logged.setdefault(name, []).append(float(value))
        kwargs["log_extra"] = lambda column, values: extra.setdefault(column, []).extend(values)
        per_function: dict[str, list[float]] = {}
        for reward in self._rewards:
            if reward.term is not None:
                per_function[reward.name] = _run_term(reward, prompts, texts, fields, counts)
            else:
                per_function[reward.name] = _run_function(reward, prompts, kwargs)
        weights = {r.name: r.weight for r in self._rewards}
        total = [
            math.fsum(weights[n] * v[i] for n, v in per_function.items() if not math.isnan(v[i]))
            for i in range(num)
        ]
        return RewardScores(total=total, per_function=per_function, logged=logged, extra=extra)


def completion_text(completion: Any) -> str:
    """A completion's text: the string, or the content of a TRL conversational completion's messages."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content", "")) for m in completion)


def prompt_text(prompt: Any) -> str:
    """A prompt's text for messages: the string, or the content of its last message."""
    if isinstance(prompt, str):
        return prompt
    return str(prompt[-1].get("content", "")) if prompt else ""


def _trl_kwargs(prompts, completions, fields, completion_ids, state: TrainerState) -> dict[str, Any]:
    """The keyword arguments TRL's GRPOTrainer passes a reward function (launcher.components.rewards.user_files)."""
    conversational = bool(prompts) and not isinstance(prompts[0], str)
    if conversational:
        completions = [
            [{"role": "assistant", "content": c}] if isinstance(c, str) else c for c in completions
        ]
    keys = [k for k in dict.fromkeys(k for record in fields for k in record) if k not in _NOT_FIELDS]
    kwargs: dict[str, Any] = {k: [record.get(k) for record in fields] for k in keys}
    kwargs.update(prompts=list(prompts), completions=list(completions), trainer_state=state)
    kwargs["completion_ids"] = None if completion_ids is None else [_ids(ids) for ids in completion_ids]
    return kwargs


def _ids(ids: Any) -> list[int]:
    """A completion's token ids as the list of ints TRL passes (from a list, a tuple or a tensor)."""
    return [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]


def _call(function: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """Call a reward function with the arguments it takes; an `async def` one runs to completion (TRL awaits it)."""
    result = function(**call_kwargs(function, kwargs))
    if inspect.isawaitable(result):
        result = asyncio.run(_awaited(result))
    return result


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _run_term(reward: _Reward, prompts, texts, fields, counts) -> list[float]:
    try:
        return reward.term(texts, fields, counts)
    except ValueError as err:  # MissingField included: a record without the term's field
        row = err.row if isinstance(err, MissingField) else 0
        raise RewardError(reward.name, prompt_text(prompts[row]) if prompts else "", str(err)) from None


def _run_function(reward: _Reward, prompts, kwargs: dict[str, Any]) -> list[float]:
    """Call a user function as TRL does; its values checked (length, finite; None becomes NaN)."""
    num = len(prompts)
    function = reward.function
    try:
        result = _call(function, kwargs)
    except Exception as err:
        row = _failing_row(function, kwargs, num)
        raise RewardError(reward.name, prompt_text(prompts[row]), f"{type(err).__name__}: {err}") from err
    try:
        values = list(result)
    except TypeError:
        raise RewardError(
            reward.name,
            prompt_text(prompts[0]),
            f"it returned a {type(result).__name__}, not a list of floats",
        ) from None
    if len(values) != num:
        raise RewardError(
            reward.name,
            prompt_text(prompts[0]),
            f"it returned {len(values)} values for {num} completions (one each)",
        )
    return [_checked(reward.name, prompts[i], v) for i, v in enumerate(values)]


def _checked(name: str, prompt: Any, value: Any) -> float:
    """A user function's value as a float (None: NaN, TRL's 'does not apply'); RewardError when not a finite number."""
    if value is None:
        return math.nan
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RewardError(name, prompt_text(prompt), f"it returned {value!r}, not a number") from None
    if not math.isfinite(number):
        raise RewardError(name, prompt_text(prompt), f"it returned the non-finite value {number}")
    return number


def _failing_row(function: Callable[..., Any], kwargs: dict[str, Any], num: int) -> int:
    """The first completion the function raises on when called on it alone (0 when none does alone)."""
    for i in range(num):
        one = {k: v[i : i + 1] if isinstance(v, list) and len(v) == num else v for k, v in kwargs.items()}
        try:
            _call(function, one)
        except Exception:
            return i
    return 0


def build_rewards(cfg: RewardConfig, base_dir: Path) -> RewardSet:
    """The RewardSet of the reward group; user files are read from `base_dir` and checked against cfg.digests."""
    rewards = [_Reward(name=name, weight=t.weight, term=build_term(t)) for name, t in cfg.terms()]
    weights = cfg.function_weights or (1.0,) * len(cfg.functions)
    for index, (entry, weight) in enumerate(zip(cfg.functions, weights, strict=True)):
        function, digest = load_function(entry, base_dir)
        recorded = cfg.digests[index] if index < len(cfg.digests) else None
        if recorded is not None and recorded != digest and not cfg.allow_changed_files:
            raise RewardFileError(changed_file_text(entry, file_path(entry, base_dir), recorded, digest))
        rewards.append(_Reward(name=function_name(entry), weight=weight, function=function))
    return RewardSet(rewards)


def changed_file_text(entry: str, path: Path, recorded: str, digest: str) -> str:
    """One paragraph: a reward file's content differs from the run's record of it, and what to do."""
    return (
        f"the reward file {path} (reward.functions entry '{entry}') changed since the run recorded it: sha256 "
        f"{digest[:12]}... now, {recorded[:12]}... recorded. Its rewards would differ from those the run trained on. "
        "Restore the file, or start a new run (another run_dir), or accept the new code on purpose with "
        "reward.allow_changed_files=true (the new digest is recorded)."
    )


def stop_message(err: RewardError, step: int, checkpoint: Path | None) -> str:
    """The paragraph a run prints when a reward fails: what failed, where, and that the newest checkpoint is kept."""
    kept = (
        f"the newest checkpoint, {checkpoint}, is kept"
        if checkpoint
        else "no checkpoint was written before it"
    )
    return (
        f"the run stopped at step {step} (exit status 1): {err}. The rollouts of that step were not trained on; "
        f"{kept}. Fix the reward, then continue with resume=auto (a changed reward file is refused unless "
        "reward.allow_changed_files=true) or start a new run."
    )


def _quoted(prompt: str, limit: int = 200) -> str:
    one_line = " ".join(prompt.split())
    return repr(one_line if len(one_line) <= limit else one_line[: limit - 3] + "...")


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return math.fsum(finite) / len(finite) if finite else math.nan


def _std(values: Sequence[float]) -> float:
    """The population standard deviation of the values that are not NaN."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return math.nan
    mean = math.fsum(finite) / len(finite)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in finite) / len(finite))
