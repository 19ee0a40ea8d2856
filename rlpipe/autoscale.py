"""How many rollout workers the run wants: one rule, computed by the learner from what it
already measures, exported as ``rlpipe_fleet_desired_workers`` (and written into its Redis
state) so that every scaler acts on the same number: ``rlpipe up --autoscale MIN:MAX`` here,
the HorizontalPodAutoscaler in deploy/k8s on a cluster.

The two signals are the two ways an asynchronous pipeline is unbalanced:

- rollout is the bottleneck: the learner waits for groups (``learner_wait_seconds`` over
  itself plus ``learner_step_seconds``, the **wait fraction**);
- the learner is: the workers sit with nothing in flight under back-pressure (the change of
  the fleet's idle seconds over workers x elapsed time, the **idle fraction**).

The rule (:func:`decide`), over the last ``autoscale.window_s`` seconds of steps measured at
one fleet size:

- grow while the learner waits more than ``scale_up_wait_fraction`` and the workers idle
  less than ``scale_down_idle_fraction``: to ``workers x busy / (1 - wait)`` (the workers
  that would keep a learner that never waits fed, if each worker's rate stays), at least one
  more; growing is proportional because a starved learner wastes the most expensive GPUs;
- shrink by one worker while the learner waits less than ``scale_up_wait_fraction`` and
  one worker fewer, doing the same work, would still idle more than
  ``scale_down_idle_fraction`` (``1 - workers x busy / (workers - 1)``): a shrink that
  would starve the learner would be undone by the next window (flapping), and a worker
  takes an engine start to come back, so shrinking is cautious, one worker at a time;
- otherwise hold (both signals high means something else limits the run, such as
  ``queue.max_lag`` or syncs; neither high is balance);

always within ``[min_workers, max_workers]``. Hysteresis: after a change the rule waits
until the fleet has the size it asked for (new workers registered, drained ones gone; at
most ``converge_timeout_s``, after which it judges the fleet it got), then for a full window
measured at that size and ``cooldown_s`` since the change, so each scale event is judged on
what it did and never on the engine starts it caused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlpipe.config import AutoscaleConfig


@dataclass(frozen=True)
class Window:
    """What the rule reads: the fleet measured over some steps at one size."""

    workers: int  # registered workers throughout the window
    wait_fraction: float  # of the learner's wall time, spent waiting for groups
    idle_fraction: float  # of the workers' time, with no group in flight


def decide(cfg: AutoscaleConfig, w: Window) -> int:
    """The worker count the window asks for (see the module docstring)."""
    n = w.workers
    if w.wait_fraction > cfg.scale_up_wait_fraction and w.idle_fraction < cfg.scale_down_idle_fraction:
        n = max(n + 1, math.ceil(w.workers * (1 - w.idle_fraction) / max(1 - w.wait_fraction, 0.1) - 1e-9))
    elif w.wait_fraction < cfg.scale_up_wait_fraction and w.workers > 1 and \
            1 - w.workers * (1 - w.idle_fraction) / (w.workers - 1) > cfg.scale_down_idle_fraction:
        n = w.workers - 1
    return min(cfg.max_workers, max(cfg.min_workers, n))


class FleetSizer:
    """The learner's side: fed each step's metrics row, keeps the window and the last
    decision. ``observe`` returns the row's ``fleet_*`` keys. Times are the rows' ``time``
    (seconds since the learner started)."""

    def __init__(self, cfg: AutoscaleConfig):
        self.cfg = cfg
        self.rows: list[dict] = []  # this fleet size's rows; the first is the window's start
        self.desired: int | None = None
        self.changed_at = -math.inf

    def observe(self, row: dict) -> dict:
        workers, now = int(row.get("rollout_workers", 0)), float(row["time"])
        if self.rows and int(self.rows[0].get("rollout_workers", 0)) != workers:
            self.rows = []  # the fleet changed size: measure the new one afresh
        self.rows.append(row)
        while len(self.rows) > 2 and now - float(self.rows[1]["time"]) >= self.cfg.window_s:
            self.rows.pop(0)
        if self.desired is None:
            self.desired = min(self.cfg.max_workers, max(self.cfg.min_workers, workers))
        window = self.window()
        if window is None:
            return {"fleet_desired_workers": self.desired}
        settled = workers == self.desired or now - self.changed_at >= self.cfg.converge_timeout_s
        if settled and now - self.changed_at >= self.cfg.cooldown_s:
            n = decide(self.cfg, window)
            if n != self.desired:
                self.desired, self.changed_at = n, now
        return {"fleet_desired_workers": self.desired, "fleet_wait_fraction": round(window.wait_fraction, 4),
                "fleet_idle_fraction": round(window.idle_fraction, 4)}

    def window(self) -> Window | None:
        """The rows of the last ``window_s`` seconds at the current size, once they span that
        long (idle seconds are a running total: the row before the window is its start)."""
        if len(self.rows) < 3 or not self.rows[0].get("rollout_workers"):
            return None
        first, rows = self.rows[0], self.rows[1:]
        elapsed = float(rows[-1]["time"]) - float(first["time"])
        if elapsed < self.cfg.window_s:
            return None
        workers = int(first["rollout_workers"])
        wait = sum(float(r.get("learner_wait_seconds", 0.0)) for r in rows)
        wall = wait + sum(float(r.get("learner_step_seconds", 0.0)) for r in rows)
        idle = float(rows[-1]["rollout_idle_seconds_total"]) - float(first["rollout_idle_seconds_total"])
        if wall <= 0:
            return None
        return Window(workers, min(1.0, max(0.0, wait / wall)), min(1.0, max(0.0, idle / (workers * elapsed))))
