"""Rules of the reward group (built-in rewards and a user's reward files), checked before anything starts.

A user's reward file is run here, in the launching process, as the ranks will run it: a missing file, a
file that fails to import, a missing or non-callable function is refused naming it (exit status 2). A
resume compares each file's digest with the one the checkpoint recorded (its manifest, else the spec.yaml
beside it): a changed file is refused naming it, since the checkpoint's policy was trained on the old
rewards and reward code is never taken from a checkpoint (reward.allow_changed_files accepts it).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from launcher.components import checkpoint
from launcher.components.checkpoint_files import read_manifest
from launcher.components.rewards import changed_file_text
from launcher.components.rewards.user_files import RewardFileError, file_path, load_function
from launcher.components.rewards.verifiers import extraction_problem, math_verify_installed
from launcher.config.objective import ONLINE
from launcher.config.reward import CHECKPOINT_KEY, recorded_files, split_function
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError


def _read(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    r = spec.reward
    if r.configured() and spec.objective.name not in ONLINE:
        yield SpecError(
            ("reward", "objective.name"),
            f"rewards are set ({', '.join(r.names())}), but objective={spec.objective.name} reads none: only "
            f"{' and '.join(ONLINE)} score completions. Choose `objective=grpo` (or rloo), or drop the rewards "
            "(`reward=none`).",
        )


def _built_in(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    a, f, n = spec.reward.answer, spec.reward.format, spec.reward.length
    if a.weight is not None:
        problem = extraction_problem(a.extract)
        if problem is not None:
            yield SpecError(
                ("reward.answer.extract",), f"{problem}, e.g. `reward.answer.extract=boxed|last_number`."
            )
        if not a.field.strip():
            yield SpecError(
                ("reward.answer.field",), "names no record field: give the field holding the answer."
            )
        if a.match == "math_verify" and not math_verify_installed():
            yield SpecError(
                ("reward.answer.match",),
                "math_verify compares answers with the math-verify package, which is not installed here. Install "
                "it (`pip install math-verify`, or the launcher's `rewards` extra), or compare as numbers "
                "(`reward.answer.match=numeric`).",
            )
    if f.weight is not None:
        try:
            re.compile(f.pattern)
        except re.error as err:
            yield SpecError(
                ("reward.format.pattern",),
                f"is not a valid Python regex ({err}): {f.pattern!r}. Fix the pattern (quote it on the command line).",
            )
    if n.weight is not None and n.max_tokens is None:
        yield SpecError(
            ("reward.length.max_tokens",),
            "the length penalty reaches -1 at reward.length.max_tokens, which is null. Set it (e.g. to the "
            "completion budget), or turn the penalty off (`reward.length.weight=null`).",
        )
    elif n.weight is not None and n.soft_tokens > n.max_tokens:
        yield SpecError(
            ("reward.length.soft_tokens", "reward.length.max_tokens"),
            f"the penalty's soft zone ({n.soft_tokens} tokens) is longer than reward.length.max_tokens "
            f"({n.max_tokens}). Set reward.length.soft_tokens to at most {n.max_tokens}.",
        )


def _functions(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    r = spec.reward
    if r.function_weights and len(r.function_weights) != len(r.functions):
        yield SpecError(
            ("reward.function_weights", "reward.functions"),
            f"{len(r.function_weights)} weight(s) for {len(r.functions)} reward function(s): give one weight per "
            "function, in order, or none (1.0 each).",
        )
    twice = sorted(name for name, count in Counter(r.names()).items() if count > 1)
    if twice:
        yield SpecError(
            ("reward.functions",),
            f"more than one reward is named {', '.join(twice)}; metrics (reward/<name>) and errors name each "
            "reward by its name. Rename the function (built-in rewards take answer, format and length).",
        )
    for entry in r.functions:
        try:
            load_function(entry, Path.cwd())
        except RewardFileError as err:
            yield SpecError(("reward.functions",), str(err))


def _checkpoint_files(step_dir: Path) -> dict[str, str] | None:
    """Reward file -> digest as the checkpoint recorded them: its manifest, else the spec.yaml beside it (None: unknown)."""
    try:
        recorded = read_manifest(step_dir).get(CHECKPOINT_KEY)
    except (OSError, ValueError, KeyError, TypeError):
        recorded = None
    if isinstance(recorded, dict):
        return {str(k): str(v) for k, v in recorded.items()}
    try:
        written: Any = yaml.safe_load((step_dir.parent.parent / "spec.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    reward = written.get("reward") if isinstance(written, dict) else None
    if not isinstance(reward, dict):
        return None
    functions, digests = reward.get("functions") or [], reward.get("digests") or []
    return {split_function(str(e))[0]: str(d) for e, d in zip(functions, digests, strict=False)}


def _resumed(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    r = spec.reward
    if not r.functions or not r.digests or r.allow_changed_files or spec.resume is None:
        return
    run_dir = Path(spec.run_dir) if spec.run_dir else None
    if spec.resume == "auto" and run_dir is None:
        return
    found = checkpoint.resolve_resume(spec.resume, run_dir, warn=False)
    recorded = _checkpoint_files(found[0]) if found else None
    for path, digest in recorded_files(r).items():
        old = (recorded or {}).get(path)
        if old is not None and old != digest:
            entry = next(e for e in r.functions if split_function(e)[0] == path)
            yield SpecError(
                ("resume", "reward.functions"),
                f"{found[0]} was trained with other reward code: "
                f"{changed_file_text(entry, file_path(entry, Path.cwd()), old, digest)}",
            )


RULES: tuple[Rule, ...] = (_read, _built_in, _functions, _resumed)
"""This module's rules, in the order they report."""
