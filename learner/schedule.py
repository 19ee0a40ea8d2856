"""The learner's schedules: its learning rate over the steps (``learner.schedule``,
ScheduleConfig), and when a time budget ends training (``train_budget_s``, :class:`TrainBudget`).

The learner asks for the LR of the next step with ``next_lr()`` (step 1 on a fresh
schedule, or the step after a restored one), and after each step ``t`` calls
``update(t, response_length_mean)`` for the LR of step ``t + 1``. Steps are 1-based.

``length_surge`` is the seed paper's length-decay scheduler (Algorithm 1): it ties the decay
to when training changes phase, seen as a surge of the mean response length, instead of to a
step fixed in advance; from then on the LR halves every ``decay_period`` steps down to
``min_lr_ratio`` x lr.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque

from rlpipe.config import ScheduleConfig

log = logging.getLogger(__name__)


def apply_lr(optimizer, lr: float) -> None:
    """Set ``lr`` on every param group: torch reads it from the groups at each ``step()``."""
    for group in optimizer.param_groups:
        group["lr"] = lr


class LRSchedule:
    """One schedule for one run; ``state_dict`` carries everything ``update`` needs to resume."""

    def __init__(self, cfg: ScheduleConfig, base_lr: float, total_steps: int):
        self.cfg, self.base_lr, self.total_steps = cfg, base_lr, total_steps
        self.floor = base_lr * cfg.min_lr_ratio
        self.step = 0  # last finished step
        # length_surge: raw lengths for the moving average, and the recent smoothed values.
        self.lengths: deque[float] = deque(maxlen=cfg.surge_smooth)
        self.smoothed: deque[float] = deque(maxlen=cfg.surge_window)
        self.surge_step: int | None = None
        self.decay_period: int | None = cfg.decay_period
        self.halvings = 0

    def _warmup(self, s: int) -> float:
        """Linear warmup: a fresh optimizer's moment estimates are poor, so the first steps are small."""
        w = self.cfg.warmup_steps
        return min(1.0, s / w) if w > 0 else 1.0

    def _lr(self, s: int) -> float:
        """The LR for step ``s`` (1-based) given what ``update`` has seen so far."""
        cfg = self.cfg
        if cfg.kind == "warmup_cosine":
            span = self.total_steps - cfg.warmup_steps
            progress = min(1.0, max(0.0, (s - cfg.warmup_steps) / span)) if span > 0 else float(s > cfg.warmup_steps)
            lr = self.floor + (self.base_lr - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))
        elif cfg.kind == "length_surge":
            lr = self._halved_lr()
        else:
            lr = self.base_lr
        return lr * self._warmup(s)

    def _halved_lr(self) -> float:
        return max(self.base_lr * 0.5 ** self.halvings, self.floor)

    def next_lr(self) -> float:
        return self._lr(self.step + 1)

    def update(self, step: int, response_length_mean: float) -> float:
        """Record step ``step``'s mean response length; return the LR for step ``step + 1``."""
        self.step = step
        if self.cfg.kind == "length_surge":
            self._surge_update(step, response_length_mean)
        return self._lr(step + 1)

    def _surge_update(self, t: int, length: float) -> None:
        """Algorithm 1. L_t is the mean of the last ``surge_smooth`` lengths; there is a surge at
        the first t with L_t >= surge_factor x min(L over the up to ``surge_window`` earlier
        smoothed values), so the first test is one step after the first full average. Then the
        LR halves at every t > surge step with t % decay_period == 0 (floored), from step t + 1.
        """
        cfg = self.cfg
        if math.isfinite(length):  # a step without responses says nothing about length
            self.lengths.append(float(length))
            if len(self.lengths) == cfg.surge_smooth:
                # Smoothing keeps one lucky batch from counting as a surge.
                smooth = sum(self.lengths) / cfg.surge_smooth
                low = min(self.smoothed, default=None)  # None until an earlier smoothed value exists
                if self.surge_step is None and low is not None and smooth > 0 and smooth >= cfg.surge_factor * low:
                    self.surge_step = t
                    if self.decay_period is None:
                        self.decay_period = max(1, round(cfg.decay_period_factor * t))
                    log.info("response length surge at step %d (smoothed %.1f >= %.1f x %.1f); halving the LR "
                             "every %d steps", t, smooth, cfg.surge_factor, low, self.decay_period)
                self.smoothed.append(smooth)
        if self.surge_step is not None and t > self.surge_step and t % self.decay_period == 0:
            before = self._halved_lr()
            if before > self.floor:  # already at the floor: nothing to halve
                self.halvings += 1
                log.info("step %d: LR halved %.3g -> %.3g", t, before, max(before / 2, self.floor))

    def state(self) -> dict:
        return {"kind": self.cfg.kind, "lr": self.next_lr(), "surge_step": self.surge_step,
                "decay_period": self.decay_period, "halvings": self.halvings}

    def state_dict(self) -> dict:
        return {"kind": self.cfg.kind, "step": self.step, "lengths": list(self.lengths),
                "smoothed": list(self.smoothed), "surge_step": self.surge_step,
                "decay_period": self.decay_period, "halvings": self.halvings}

    def load_state_dict(self, d: dict) -> None:
        """Restore a checkpoint's schedule; the LR is recomputed from the step and halvings,
        so a changed ``base_lr`` or ``min_lr_ratio`` takes effect on resume."""
        if d.get("kind") != self.cfg.kind:
            log.warning("checkpoint schedule kind %r != configured %r; keeping only the step", d.get("kind"),
                        self.cfg.kind)
            self.step = int(d.get("step", 0))
            return
        self.step = int(d["step"])
        self.lengths = deque(d["lengths"], maxlen=self.cfg.surge_smooth)
        self.smoothed = deque(d["smoothed"], maxlen=self.cfg.surge_window)
        self.surge_step, self.halvings = d["surge_step"], int(d["halvings"])
        self.decay_period = self.cfg.decay_period or d["decay_period"]


class TrainBudget:
    """``train_budget_s``: training ends after this many seconds from the first step, as if
    the steps were done, so that one recipe fits its hour on a slow CPU and trains more
    steps on a fast one. 0: no budget. Measured with ``time.perf_counter`` from ``start``."""

    def __init__(self, seconds: float):
        self.seconds, self.started, self.reached = seconds, None, False

    def start(self, now: float) -> None:
        """The first step begins (later calls change nothing)."""
        if self.started is None:
            self.started = now

    def spent(self, step: int, steps: int) -> bool:
        """Whether the budget is spent; the first time it is, logs at which step."""
        if self.reached:
            return True
        if not self.seconds or self.started is None or time.perf_counter() - self.started < self.seconds:
            return False
        log.info("train_budget_s %.0f s spent at step %d of %d: finishing as if done", self.seconds, step, steps)
        self.reached = True
        return True
