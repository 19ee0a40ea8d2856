"""The int8 monitors off the learner's critical path: run on a copy of the policy, in a thread.

The monitors (quant/monitor.py ``monitor``) forward the probe set twice (the quantized policy
simulated, and bf16) and measure every linear; on a real model that took most of a monitored
update's sync (32 of 55 s for SmolLM2 on an AVX2 EPYC), and the step waited for it. Here an update
copies the policy's weights into a shadow model (a copy made once: the training step goes on
changing the live one, and the monitors' hooks must not fire in its forwards) and hands the
monitors to one background thread; the learner sends the update at once. Their result arrives
with a later update's metrics, named for the step it measured (``quant_monitor_step``), and a
threshold crossed there acts then: a warning, or with ``recalibrate: auto`` a recalibration of the
policy of that later update. An update that finds the thread still busy skips its monitors
(``quant_monitor_skipped_total``) rather than wait or queue them.
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from quant.monitor import monitor


class BackgroundMonitor:
    def __init__(self):
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="int8-monitor")
        self.shadow: torch.nn.Module | None = None
        self.future: Future | None = None
        self.skipped = 0

    def busy(self) -> bool:
        return self.future is not None and not self.future.done()

    def submit(self, model, tensors: dict, smoothed: dict, profile, previous: dict | None, step: int) -> bool:
        """Start the monitors of ``step``'s update on a copy of ``model``'s weights now; False (and
        counted) when the last ones are still running."""
        if self.busy():
            self.skipped += 1
            return False
        self._copy_weights(model)
        self.future = self.pool.submit(self._run, tensors, smoothed, profile, previous, step)
        return True

    def result(self, wait: bool = False) -> dict | None:
        """The finished monitors' metrics (with ``quant_monitor_step`` and ``quant_monitor_seconds``)
        once, or None while they run or when none were started; ``wait``: block until they finish."""
        if self.future is None or not (wait or self.future.done()):
            return None
        future, self.future = self.future, None
        return future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    @torch.no_grad()
    def _copy_weights(self, model) -> None:
        if self.shadow is None:
            grads = [p.grad for p in model.parameters()]
            for p in model.parameters():
                p.grad = None  # not copied: only the weights are the monitors'
            try:
                self.shadow = copy.deepcopy(model).requires_grad_(False).eval()
            finally:
                for p, g in zip(model.parameters(), grads):
                    p.grad = g
            return
        for dst, src in zip(self.shadow.parameters(), model.parameters()):
            dst.copy_(src.detach())

    def _run(self, tensors, smoothed, profile, previous, step: int) -> dict:
        t0 = time.perf_counter()
        m = monitor(self.shadow, tensors, smoothed, profile, previous)
        return {**m, "quant_monitor_step": step, "quant_monitor_seconds": time.perf_counter() - t0}
