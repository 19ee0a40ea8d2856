"""The learner's side of held-out evaluation (``eval.*``; the workers' side is rollout_service/evals.py).

The learner asks for an evaluation of version v at step 0, every ``eval.every`` steps and at
the end, by adding ``{version, step}`` to the run's ``eval:requests`` stream, once per version
(a restarted learner does not ask again for a version already asked for). It never waits for
one while training: each step it reads the results that arrived since the last one it logged,
writes each as an ``eval`` row of metrics.jsonl (``kind: "eval"``; :func:`learner.metrics.read_jsonl`
returns step rows unless asked for these), sets ``rlpipe_eval_accuracy{dataset,metric}``, and
remembers the last one logged in Redis, so a restarted learner logs each result once. At the
end of the run it waits up to ``eval.final_wait_s`` for the final version's result.

A result is logged only if it is one of this run's (:func:`check_result`: of a version the
learner asked for, on the configured dataset, proportions finite and within [0, 1], rows
within ``eval.size``) and the first answer to its request (``eval:answered``: a copy of a real
result, with a forged score or not, is not); any other entry, or one delivered ``queue.max_deliveries`` times
without being logged, is dead-lettered with the reason and never stops the learner
(rlpipe/side_streams.py).
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Callable

import redis

from learner.metrics import LearnerMetrics
from rlpipe.config import RunConfig
from rlpipe.keys import Keys
from rlpipe.side_streams import Rejected, dead_letter, delivered, settled

log = logging.getLogger(__name__)

# A result's fields in [0, 1] (a held-out accuracy: the mean of rewards that are right or not),
# those of them a result may lack (from a worker before them) and the one that may be null
# (no sampled answers), and the lists of row numbers of the held-out set.
PROPORTIONS = ("pass_at_1", "pass_at_1_low", "pass_at_1_high", "pass_at_1_lenient", "pass_at_1_lenient_low",
               "pass_at_1_lenient_high", "mean_at_k", "pass_at_1_without_tool", "pass_at_1_without_tool_low",
               "pass_at_1_without_tool_high")
OPTIONAL = ("pass_at_1_lenient", "pass_at_1_lenient_low", "pass_at_1_lenient_high", "pass_at_1_without_tool",
            "pass_at_1_without_tool_low", "pass_at_1_without_tool_high")
NULLABLE = ("mean_at_k",)
ROW_LISTS = ("rows_evaluated", "rows_right", "rows_right_lenient", "rows_right_without_tool")
COUNTS = ("tool_calls", "rows_using_tool")  # task.tool's: values written, rows whose greedy answer used it


def _number(result: dict, key: str, low: float, high: float, kind: type | tuple = (int, float)):
    """``result[key]`` if it is a number of ``kind`` within ``low..high`` (not NaN), else :class:`Rejected`."""
    value = result.get(key)
    if isinstance(value, bool) or not isinstance(value, kind) or not low <= value <= high:
        raise Rejected(f"{key}: {str(value)[:40]} is not {'an integer' if kind is int else 'a number'} "
                       f"within {low}..{high}")
    return value


def check_result(raw: bytes | None, cfg: RunConfig, asked_at: Callable[[int], int | None]) -> dict:
    """An ``eval:results`` entry's ``result`` field as a result of this run, or
    :class:`Rejected` saying why not. ``asked_at(version)``: the step the learner asked for
    an evaluation of ``version`` at (``eval:requested``), None if it never did. Everything a
    result carries is checked here, so that logging one that passed cannot fail on it."""
    ec = cfg.eval
    if raw is None:
        raise Rejected("result: missing field")
    if len(raw) > 4096 + 32 * ec.size:  # three lists of at most eval.size row numbers, and the rest
        raise Rejected(f"result: {len(raw)} bytes, more than a result of eval.size {ec.size} rows takes")
    try:
        result = json.loads(raw)
    except ValueError as e:
        raise Rejected(f"result: not JSON ({e})") from None
    if not isinstance(result, dict):
        raise Rejected(f"result: a JSON {type(result).__name__}, not an object")
    if result.get("dataset") != ec.dataset:
        raise Rejected(f"dataset: {str(result.get('dataset'))[:80]!r}, not eval.dataset {ec.dataset!r}")
    version, step = _number(result, "requested_version", 0, math.inf, int), _number(result, "step", 0, math.inf, int)
    if asked_at(version) != step:
        raise Rejected(f"requested_version: the learner never asked for an evaluation of version {version} at "
                       f"step {step}")
    rows = _number(result, "rows", 0, ec.size, int)
    _number(result, "skipped_rows", 0, ec.size - rows, int)
    for key in ("version", "version_end", "k"):
        _number(result, key, -1, math.inf, int)
    for key in PROPORTIONS:
        if not (key in OPTIONAL and key not in result or key in NULLABLE and result.get(key) is None):
            _number(result, key, 0, 1)
    for key in ROW_LISTS:
        value = result.get(key, [])
        if not isinstance(value, list) or len(value) > rows or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < ec.size for i in value):
            raise Rejected(f"{key}: not a list of at most {rows} row numbers below eval.size {ec.size}")
    for key in COUNTS:
        if key in result:
            _number(result, key, 0, math.inf, int)
    _number(result, "seconds", 0, math.inf)
    if not isinstance(result.get("worker"), str):
        raise Rejected("worker: not a string")
    return result


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

    def start(self, version: int, step: int) -> None:
        """The evaluation a learner asks for before its first step here. With ``eval.base_at_rest``
        a fresh run's step 0 waits for it, so every row sees version 0 (an evaluation beside training
        spans the versions the engine takes meanwhile); a restart logged it already and goes on."""
        if self.cfg.eval.base_at_rest and step == 0 and self.last_id == "0-0":
            log.info("eval.base_at_rest: waiting for the base model's evaluation before the first update")
            self.finish(version, step)
        else:
            self.request(version, step)

    def poll(self, step: int) -> list[dict]:
        """Log the results that arrived since the last one logged; returns them. Any other
        entry is dead-lettered (see the module docstring), and the learner goes on."""
        if not self.every:
            return []
        stream = self.keys.eval_results
        got = self.r.xread({stream: self.last_id}, count=100) or []
        out = []
        for entry_id, fields in (got[0][1] if got else []):
            entry_id = entry_id.decode()
            times = delivered(self.r, stream, entry_id)
            try:
                if times > self.cfg.queue.max_deliveries:
                    raise Rejected(f"delivered {times - 1} times and never logged (it stopped the learner each time?)")
                result = check_result(fields.get(b"result"), self.cfg, self.asked_at)
                self._first_answer(result["requested_version"], entry_id)
            except Rejected as e:
                dead_letter(self.r, stream, entry_id, fields, str(e))
            else:
                self.metrics.record_eval(step, result)
                out.append(result)
                log.info("held-out %s at version %d: pass@1 %.3f [%.3f, %.3f] (lenient %.3f) over %d rows",
                         result["dataset"], result["version"], result["pass_at_1"], result["pass_at_1_low"],
                         result["pass_at_1_high"], result.get("pass_at_1_lenient", float("nan")), result["rows"])
                settled(self.r, stream, entry_id)
            self.last_id = entry_id
            self.r.set(self.keys.eval_logged, entry_id)
        self.results += out
        return out

    def _first_answer(self, version: int, entry_id: str) -> None:
        """Claim ``version``'s one answer for ``entry_id`` (``eval:answered``), or :class:`Rejected`
        if another entry answered it: a copy of a real result, its score changed or not, is never
        logged. The same entry read again (a learner that stopped before it noted the entry as
        logged) keeps its claim."""
        if not self.r.hsetnx(self.keys.eval_answered, str(version), entry_id):
            first = self.r.hget(self.keys.eval_answered, str(version))
            if first is not None and first.decode() != entry_id:
                raise Rejected(f"requested_version: version {version} was answered already (entry "
                               f"{first.decode()}); one result per request")

    def asked_at(self, version: int) -> int | None:
        """The step the learner asked for an evaluation of ``version`` at (``eval:requested``), or None."""
        step = self.r.hget(self.keys.eval_requested, str(version))
        try:
            return int(step) if step is not None else None
        except ValueError:  # not written by a learner
            return None

    def finish(self, version: int, step: int) -> dict | None:
        """Ask for ``version``'s evaluation (if not yet) and wait for its result: the final version's at
        the end of a run, and the base model's at its start with ``eval.base_at_rest`` (:meth:`start`)."""
        if not self.every:
            return None
        self.request(version, step)
        deadline = time.monotonic() + self.cfg.eval.final_wait_s
        log.info("waiting up to %.0f s for the evaluation of version %d", self.cfg.eval.final_wait_s, version)
        while True:
            done = [res for res in self.results if res["requested_version"] == version]
            if done:
                return done[-1]
            if time.monotonic() > deadline:
                log.warning("no evaluation of version %d within eval.final_wait_s", version)
                return None
            self.poll(step)
            time.sleep(0.5)
