"""Where the learner's checkpoints live and how to find the newest complete one.

The learner writes them (``learner/checkpoint.py``); rollout workers read the newest one
to catch up after they missed weight syncs (a restart, a timeout), so the layout is
shared here. A checkpoint is ``<root>/step_00000010/`` holding a Hugging Face model
directory plus ``trainer_state.pt`` and ``meta.json`` (with the weights' ``version``), and
in the sharded format the optimizer state's per-rank shards under ``optimizer/``.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlpipe.config import RunConfig

PREFIX = "step_"


def checkpoint_root(cfg: RunConfig) -> Path:
    return Path(cfg.learner.checkpoint_dir or Path(cfg.run_dir or ".") / "checkpoints")


def complete(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob(f"{PREFIX}*") if (p / "meta.json").is_file() and (p / "trainer_state.pt").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest(root: str | Path) -> Path | None:
    found = complete(root)
    return found[-1] if found else None


def read_meta(path: str | Path) -> dict:
    return json.loads((Path(path) / "meta.json").read_text())
