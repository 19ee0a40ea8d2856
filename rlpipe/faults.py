"""Slowness injected by tests, unset in normal runs: a role reads the seconds to add from a
file named by an environment variable each time, so a test can make rollout or the learner
the bottleneck mid-run and back (as a slow verifier or a straggler node would) while the
roles run as separate processes. The crash points are learner/train.py's RLPIPE_CRASH_AT."""

from __future__ import annotations

import os
from pathlib import Path

STEP_DELAY_ENV = "RLPIPE_STEP_DELAY_FILE"  # the learner: seconds added to each training step
GROUP_DELAY_ENV = "RLPIPE_GROUP_DELAY_FILE"  # a worker: seconds added to each group before its push


def injected_delay(env_var: str) -> float:
    """The seconds the file named by ``env_var`` holds now; 0 when unset, missing or empty."""
    path = os.environ.get(env_var, "")
    try:
        return float(Path(path).read_text().strip() or 0) if path else 0.0
    except (OSError, ValueError):
        return 0.0
