"""The one rule by which the learner gives up on a member alone, on every transport.

Every transport hands a version to each member separately, over something of that
member's own: under gloo its two-rank gloo group ("pair", weight_sync/transport.py
:class:`~weight_sync.transport.GlooGroup`); under nccl its own NCCL communicator with
the learner (weight_sync/nccl.py); under ipc its gloo pair, over which it acks each
bucket (weight_sync/ipc.py). So each step of a transfer is one wait per member, and
:meth:`StragglerRule.wait` decides, for all three, when a member is given up on:

- a member whose wait fails (it died, its engine refused a bucket) is failed, with why;
- once any member has finished the step, each other one has ``straggler_s`` more (the
  ``sync.straggler_s`` setting, capped by ``sync.timeout_s``); one still not done then is
  *late*: failed ("stopped reading?") and abandoned through the transport's ``abandon``
  (gloo drops its pair, nccl aborts its communicator, ipc drops its pair and the buffer
  it may still be reading), so it holds up none of the others' next steps;
- when no member finishes, each is failed by its own wait's timeout, or at
  ``timeout_s`` (plus a second) as late.

The sender (weight_sync/sender.py) then leaves every failed member out, in its
incarnation, with the same log line and the same ``left_out_total`` whatever the
transport, and the generation goes on without it. The rule is tested on CPU with gloo
pairs between processes and threads (tests/test_weight_sync.py); nccl and ipc call this
same code, with their CUDA calls the only part not run here.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from weight_sync.transport import SyncError

# A member still busy with a step this long after another member finished it is given up on
# (capped by the sync timeout): one that stopped reading costs the others this, once.
STRAGGLER_S = 10.0


@dataclass(frozen=True)
class StragglerRule:
    timeout_s: float  # the sync timeout: what one step may take at most
    straggler_s: float = STRAGGLER_S  # what a member may lag the first one done with a step

    def __post_init__(self):
        object.__setattr__(self, "straggler_s", min(self.straggler_s, self.timeout_s))

    def wait(self, waits: Mapping[int, Callable[[], object]], failed: dict[int, str],
             abandon: Callable[[int], None]) -> None:
        """Wait for one step with each member (rank -> a call that returns once it is done
        and raises once it failed), noting in ``failed`` (rank -> why) each member that
        failed or was late; each late one is ``abandon``-ed. Each member is waited on in a
        daemon thread of its own, which holds what its call holds until the call returns:
        a call must end on its own within about ``timeout_s`` (a gloo wait's timeout, a
        future's ``result(timeout)``), and one still running is left to run out. One member
        alone is waited on here, for its call's whole timeout: there is no other to lag."""
        if len(waits) == 1:
            ((rank, call),) = waits.items()
            why = _outcome(call)
            if why is not None:
                failed.setdefault(rank, why)
            return
        done: dict[int, str | None] = {}  # rank -> why it failed, None when it finished
        changed = threading.Condition()

        def run(rank: int, call: Callable[[], object]) -> None:
            why = _outcome(call)
            with changed:
                done[rank] = why
                changed.notify()

        for rank, call in waits.items():
            threading.Thread(target=run, args=(rank, call), name=f"rlpipe-member-{rank}", daemon=True).start()
        got, first = self._collect(done, changed, len(waits))
        for rank, why in got.items():
            if why is not None:
                failed.setdefault(rank, why)
        for rank in waits.keys() - got.keys():
            failed.setdefault(rank, self.late(first is not None))
            abandon(rank)

    def _collect(self, done: dict, changed: threading.Condition, n: int) -> tuple[dict, float | None]:
        """What ``done`` holds once every member reported, or at the deadline: ``timeout_s``
        (and a second) from now, or ``straggler_s`` after the first member finished.
        Returns it and when the first finished (None: none did)."""
        deadline = time.monotonic() + self.timeout_s + 1.0
        first = None
        with changed:
            while len(done) < n:
                now = time.monotonic()
                if first is None and None in done.values():
                    first = now
                limit = deadline if first is None else min(deadline, first + self.straggler_s)
                if now >= limit:
                    break
                changed.wait(limit - now)
            return dict(done), first

    def late(self, another_finished: bool) -> str:
        """Why a late member was given up on."""
        if another_finished:
            return (f"still receiving {self.straggler_s:.1f} s after another member had the same transfer "
                    "(stopped reading?)")
        return f"transfer not taken within the sync timeout ({self.timeout_s:.0f} s)"


def _outcome(call: Callable[[], object]) -> str | None:
    """None when ``call`` returned, else why it failed."""
    try:
        call()
    except SyncError as e:
        return str(e)
    except Exception as e:  # a transport's own error (a CUDA or NCCL one): the member failed, named
        return repr(e)
    return None
