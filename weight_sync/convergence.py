"""Fleet convergence of a weight version: how long from the start of the learner's sync
until every worker that received it serves it, and the longest activation pause it cost.

Where it is measured. The learner never waits for it: its step would then be held by the
slowest worker's activation, which is the very thing being measured. Each worker publishes,
in its registry hash (rlpipe/registry.py, written by rollout_service/loop.py at once after
every update), ``version`` and ``incarnation``, and in ``last_sync`` (JSON) the update's
``version``, ``pause_s`` (the wall time generation was paused to load it,
rollout_service/engine.py ``_apply``) and ``activated_at`` (wall clock when generation
resumed on the new weights). The learner reads the registry anyway, twice a second while it
waits for groups and at every sync; :meth:`Convergence.observe` then closes every version
whose members all serve it, from the workers' own timestamps, so the value does not depend
on when the learner looked. It reaches the metrics row of the learner's next step, with
the version it belongs to.

Who counts. The members are the workers the version's transfer reached (``received``); a
worker that was left out of the generation, or whose transfer failed, never had it and is
not waited for. A member that still has not switched holds the version open (a worker
stopped with SIGSTOP after its transfer: convergence waits for it) while it is live in the
registry with the same incarnation; once its registry entry expires or it restarted (a new
incarnation, which catches up from a checkpoint instead), it is left out and not counted.
A version whose members are all gone closes with nothing to report. A member that
already serves a later version when the learner looks (it switched twice between two
looks) counts with that later activation, an upper bound. A version still open when
``max_open`` newer ones are is given up (logged).

Clocks. ``activated_at`` is the worker's wall clock and the start is the learner's: on
separate hosts the value includes their offset (milliseconds under NTP).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Mapping

log = logging.getLogger(__name__)


@dataclass
class Converged:
    """One version, converged: the seconds from its sync's start until its last member
    served it, the longest activation pause among its members, and how many counted."""

    version: int
    seconds: float
    pause_max_s: float
    workers: int

    def metrics(self) -> dict:
        """The learner's row keys (learner/metrics.py)."""
        return {"weight_sync_converged_version": self.version, "weight_sync_convergence_seconds": self.seconds,
                "weight_sync_pause_max_seconds": self.pause_max_s, "weight_sync_converged_workers": self.workers}


@dataclass
class _Open:
    version: int
    started_at: float  # learner wall clock at the start of the sync
    members: dict[str, str]  # worker id -> the incarnation the transfer reached
    activated: dict[str, tuple[float, float]] = field(default_factory=dict)  # id -> (activated_at, pause_s)


def served(fields: Mapping[str, str], version: int) -> tuple[float, float] | None:
    """``(activated_at, pause_s)`` when a worker's registry ``fields`` say it serves
    ``version`` or a later one (pause unknown, 0, for a later one), else None."""
    try:
        last = json.loads(fields.get("last_sync") or "{}")
        current = int(fields.get("version", -1))
    except (ValueError, TypeError):
        return None
    if current < version or "activated_at" not in last or int(last.get("version", -1)) != current:
        return None
    return float(last["activated_at"]), float(last.get("pause_s", 0.0)) if current == version else 0.0


class Convergence:
    """Versions sent and not yet served by all their members (see the module docstring)."""

    def __init__(self, max_open: int = 8):
        self.max_open = max_open
        self.open: list[_Open] = []
        self.last_started = -1  # the newest version whose convergence was opened

    def started(self, version: int, started_at: float, received: Mapping[str, str]) -> None:
        """``version``'s sync began at ``started_at`` (wall clock) and reached ``received``
        (id -> incarnation). A version sent again (a re-formed generation) keeps its first start
        and members: a worker that joined later was not part of that sync."""
        if not received or version <= self.last_started:
            return
        self.last_started = version
        self.open.append(_Open(version, started_at, dict(received)))
        for gone in self.open[:-self.max_open]:
            log.warning("version %d never converged: %s did not serve it", gone.version,
                        sorted(set(gone.members) - set(gone.activated)))
        self.open = self.open[-self.max_open:]

    def observe(self, workers: Mapping[str, Mapping[str, str]]) -> list[Converged]:
        """Close the versions every counted member serves, given the live workers' registry
        fields (``registry.live_workers``); returns them, oldest first."""
        done, still = [], []
        for o in self.open:
            waiting = False
            for w, incarnation in o.members.items():
                fields = workers.get(w)
                if w in o.activated or fields is None or fields.get("incarnation", "") != incarnation:
                    continue  # switched already, or gone: not waited for
                at = served(fields, o.version)
                if at is None:
                    waiting = True
                else:
                    o.activated[w] = at
            if waiting:
                still.append(o)
            elif o.activated:
                done.append(Converged(o.version, max(a for a, _ in o.activated.values()) - o.started_at,
                                      max(p for _, p in o.activated.values()), len(o.activated)))
        self.open = still
        return done
