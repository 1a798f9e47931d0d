"""Record each user reward file's sha256 in the spec (reward.digests), before the rules run and spec.yaml is written.

A fresh config carries no digests: the files' current ones are written in. A config that carries them (a
reproduction from a run's spec.yaml, `train --config-path RUN_DIR --config-name spec`) is compared first: a
file whose content changed since is refused naming it (exit status 2), unless reward.allow_changed_files
accepts the new code, whose digest is then recorded. A resume is compared with the checkpoint's record by
the rules (launcher.rules.reward); a missing file is theirs to report too.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from launcher.components.rewards import changed_file_text
from launcher.components.rewards.user_files import file_digest, file_path
from launcher.front.config_values import typed, with_values
from launcher.spec import SpecError


def fill_digests(cfg: DictConfig, base_dir: Path | None = None) -> tuple[DictConfig, list[SpecError]]:
    """The config with reward.digests holding the digest of each reward.functions file; or why a file is refused."""
    reward = typed(cfg, "reward")
    if reward is None or not reward.functions:
        return cfg, []
    base = Path.cwd() if base_dir is None else base_dir
    paths = [file_path(entry, base) for entry in reward.functions]
    if not all(p.is_file() for p in paths):
        return cfg, []  # launcher.rules.reward names the missing file
    current = [file_digest(p) for p in paths]
    recorded = list(reward.digests)
    if recorded and len(recorded) != len(current):
        return cfg, [
            SpecError(
                ("reward.digests", "reward.functions"),
                f"reward.digests holds {len(recorded)} digest(s) for {len(current)} reward function(s). The launcher "
                "writes it (one sha256 per reward.functions entry, in order); leave it out (reward.digests=[]) to "
                "record the files as they are now.",
            )
        ]
    if recorded and not reward.allow_changed_files:
        changed = [
            SpecError(("reward.functions", "reward.digests"), changed_file_text(entry, path, old, new))
            for entry, path, old, new in zip(reward.functions, paths, recorded, current, strict=True)
            if old != new
        ]
        if changed:
            return cfg, changed
    return with_values(cfg, {"reward.digests": current}), []
