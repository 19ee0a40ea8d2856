"""Who the learner syncs with (weight_sync/sender.py's bookkeeping, on every transport):
the current generation's members under their ranks, and the workers left out, each in
the incarnation that was left out.

A worker is left out when it did not check in before the deadline, refused the
learner's manifest, or failed or fell behind in a transfer (weight_sync/stragglers.py):
it is logged once, counted in ``left_out_total`` (the learner's
``weight_sync_left_out_total``), and not asked in again until its incarnation changes,
so it never costs the learner a second timeout.
"""

from __future__ import annotations

import logging
from typing import Mapping

from weight_sync.manifest import refused_manifest
from weight_sync.transport import NOT_CHECKED_IN

log = logging.getLogger("weight_sync.sender")  # where these lines were always logged


class Membership:
    def __init__(self):
        self.members: dict[str, str] = {}  # id -> incarnation of the current generation ({} without one)
        self.ranks: dict[str, int] = {}  # id -> rank of the members not given up on
        self.excluded: dict[str, str] = {}  # id -> the incarnation that was left out
        self.left_out_total = 0

    def candidates(self, live: Mapping[str, str]) -> dict[str, str]:
        """The live workers (id -> incarnation) minus those left out in their current incarnation."""
        return {w: inc for w, inc in sorted(live.items()) if self.excluded.get(w) != inc}

    def admit(self, members: list[str], candidates: Mapping[str, str]) -> None:
        """The generation formed with ``members``, ranks 1, 2, ... in that order."""
        self.members = {w: candidates[w] for w in members}
        self.ranks = {w: rank for rank, w in enumerate(members, 1)}

    def clear(self) -> None:
        self.members, self.ranks = {}, {}

    def leave_out(self, generation: int, worker: str, incarnation: str, why: str) -> None:
        self.excluded[worker] = incarnation
        self.left_out_total += 1
        log.warning("sync generation %d: worker %s left out: %s", generation, worker, why)

    def leave_out_ranks(self, generation: int, failed: Mapping[int, str]) -> None:
        """Leave out the members whose transfer failed or who were given up on (rank -> why)."""
        worker_of = {rank: w for w, rank in self.ranks.items()}
        for rank, why in failed.items():
            self.leave_out(generation, worker_of[rank], self.members[worker_of[rank]], why)

    def forget(self, failed: Mapping[int, str]) -> list[int]:
        """The members given up on leave the generation; the others stay in it under the
        ranks they have. Returns the ranks that left."""
        gone = [rank for rank in self.ranks.values() if rank in failed]
        for worker, rank in list(self.ranks.items()):
            if rank in failed:
                del self.ranks[worker], self.members[worker]
        return gone

    def refusals(self, generation: int, left_out: Mapping[str, str], candidates: Mapping[str, str],
                 manifest_hash: str) -> dict[str, str]:
        """Leave out the candidates that did not check in or refused the manifest hashed
        ``manifest_hash`` (worker -> their answer); returns the refusals that must stop this
        learner: those of its own manifest. A refusal that names another manifest judged one
        rewritten in the sync hash (a worker before the check of weight_sync/follower.py
        signed for the hash it read beside it): logged, and that worker is not left out, so
        the next sync asks it again. A Redis writer without the sync token may cost a worker
        a version, never the run."""
        fatal = {}
        for worker, answer in left_out.items():
            named, why = refused_manifest(answer)
            if answer != NOT_CHECKED_IN and named != manifest_hash:
                log.warning("sync generation %d: worker %s refused manifest %s, not this learner's %s (the sync "
                            "hash was rewritten?): asked again at the next sync: %s", generation, worker,
                            named or "(unnamed)", manifest_hash, why)
                continue
            self.leave_out(generation, worker, candidates[worker], why)
            if answer != NOT_CHECKED_IN:
                fatal[worker] = why
        return fatal
