"""The learner's side of held-out evaluation (``eval.*``; the workers' side is rollout_service/evals.py).

The learner asks for an evaluation of version v at step 0, every ``eval.every`` steps and at
the end, by adding ``{version, step}`` to the run's ``eval:requests`` stream, once per version
(a restarted learner does not ask again for a version already asked for). It never waits for
one while training: each step it reads the results that arrived since the last one it logged,
writes each as an ``eval`` row of metrics.jsonl (``kind: "eval"``; :func:`learner.metrics.read_jsonl`
returns step rows unless asked for these), sets ``rlpipe_eval_accuracy{dataset,metric}``, and
remembers the last one logged in Redis, so a restarted learner logs each result once. At the
end of the run it waits up to ``eval.final_wait_s`` for the final version's result.
"""

from __future__ import annotations

import json
import logging
import time

import redis

from learner.metrics import LearnerMetrics
from rlpipe.config import RunConfig
from rlpipe.queue import Keys

log = logging.getLogger(__name__)


class Evals:
    def __init__(self, cfg: RunConfig, r: redis.Redis, keys: Keys, metrics: LearnerMetrics):
        self.cfg, self.r, self.keys, self.metrics = cfg, r, keys, metrics
        self.every = cfg.eval.every
        last = r.get(keys.eval_logged)
        self.last_id = last.decode() if last else "0-0"
        self.results: list[dict] = []  # every result logged by this process

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def request(self, version: int, step: int) -> None:
        """Ask the fleet to evaluate ``version`` (once per version, whoever asks)."""
        if self.every and self.r.hsetnx(self.keys.eval_requested, str(version), step):
            self.r.xadd(self.keys.eval_requests, {"version": version, "step": step})
            log.info("eval of version %d (step %d) requested", version, step)

    def poll(self, step: int) -> list[dict]:
        """Log the results that arrived since the last one logged; returns them."""
        if not self.every:
            return []
        got = self.r.xread({self.keys.eval_results: self.last_id}, count=100) or []
        out = []
        for entry_id, fields in (got[0][1] if got else []):
            result = json.loads(fields[b"result"])
            entry_id = entry_id.decode()
            self.metrics.record_eval(step, result)
            self.last_id = entry_id
            self.r.set(self.keys.eval_logged, entry_id)
            out.append(result)
            log.info("held-out %s at version %d: pass@1 %.3f [%.3f, %.3f] over %d rows", result["dataset"],
                     result["version"], result["pass_at_1"], result["pass_at_1_low"], result["pass_at_1_high"],
                     result["rows"])
        self.results += out
        return out

    def finish(self, version: int, step: int) -> dict | None:
        """Ask for the final version's evaluation (if not yet) and wait for its result."""
        if not self.every:
            return None
        self.request(version, step)
        deadline = time.monotonic() + self.cfg.eval.final_wait_s
        log.info("waiting up to %.0f s for the final evaluation (version %d)", self.cfg.eval.final_wait_s, version)
        while True:
            done = [res for res in self.results if res["requested_version"] == version]
            if done:
                return done[-1]
            if time.monotonic() > deadline:
                log.warning("no evaluation of version %d within eval.final_wait_s", version)
                return None
            self.poll(step)
            time.sleep(0.5)
