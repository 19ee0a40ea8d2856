"""Slowness injected by tests, unset in normal runs: a role reads the seconds to add from a
file named by an environment variable each time, so a test can make rollout or the learner
the bottleneck mid-run and back (as a slow verifier or a straggler node would) while the
roles run as separate processes. Crashes are injected the same way: RLPIPE_CRASH_AT names one point of
one process's work (:func:`crash_at`), RLPIPE_CRASH_ON_PROMPT a group that kills whoever forwards it."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

log = logging.getLogger(__name__)

STEP_DELAY_ENV = "RLPIPE_STEP_DELAY_FILE"  # the learner: seconds added to each training step
GROUP_DELAY_ENV = "RLPIPE_GROUP_DELAY_FILE"  # a worker: seconds added to each group before its push
# The exactly-once tests: RLPIPE_CRASH_AT=<point>:<step> SIGKILLs the learner at that point of that step
# (collected, trained, synced, checkpoint_written, checkpointed); receiving:<version>:<k> a worker's engine
# as it is about to receive bucket k of that version.
CRASH_AT_ENV = "RLPIPE_CRASH_AT"
# The poison tests: a group whose prompt_id is this SIGKILLs the learner whenever it is forwarded, as a
# record that crashes the process would.
CRASH_ON_PROMPT_ENV = "RLPIPE_CRASH_ON_PROMPT"


def injected_delay(env_var: str) -> float:
    """The seconds the file named by ``env_var`` holds now; 0 when unset, missing or empty."""
    path = os.environ.get(env_var, "")
    try:
        return float(Path(path).read_text().strip() or 0) if path else 0.0
    except (OSError, ValueError):
        return 0.0


def crash_at(point: str) -> None:
    """SIGKILL this process if RLPIPE_CRASH_AT names ``point`` (e.g. ``trained:3``); read from the
    environment at the call, so a test that sets it before starting a role reaches that role."""
    if os.environ.get(CRASH_AT_ENV, "") == point:
        log.warning("%s=%s: killing myself", CRASH_AT_ENV, point)
        os.kill(os.getpid(), signal.SIGKILL)


def crash_on_poison(prompt_ids) -> None:
    """SIGKILL this process if RLPIPE_CRASH_ON_PROMPT is one of ``prompt_ids`` (a batch being forwarded)."""
    poison = os.environ.get(CRASH_ON_PROMPT_ENV, "")
    if poison and poison in prompt_ids:
        log.warning("%s=%s is in this batch: killing myself", CRASH_ON_PROMPT_ENV, poison)
        os.kill(os.getpid(), signal.SIGKILL)
