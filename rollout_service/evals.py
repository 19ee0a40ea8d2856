"""Held-out evaluation on a rollout worker, between (beside) its rollout groups (``eval.*``).

The learner asks for an evaluation of a version by adding an entry to the run's
``eval:requests`` stream (learner/evals.py); the workers read it in one consumer group,
so exactly one of them evaluates each request. That worker sends the first ``eval.size``
rows of ``eval.dataset`` through its own engine, ``eval.concurrency`` rows at a time, next
to the groups its rollout loop keeps in flight: the engine batches both, so training never
waits for an evaluation; it only shares the worker's tokens for a while. Per row: one greedy
answer (pass@1, the mean of its rewards) and, with ``eval.samples`` k > 0, k answers sampled
at ``sampling.temperature`` with a seed fixed per row (mean@k). The result, with the version
the engine served when it started and when it ended (an update may land mid-evaluation),
goes to the ``eval:results`` stream, and only then is the request acknowledged: a request
whose worker died is claimed by a live worker (its consumer is no longer in the registry).

A request is evaluated only if the learner asked for it: its version and step are in the
``eval:requested`` hash the learner writes before it adds a request. Any other is
dead-lettered at once, as is one delivered ``queue.max_deliveries`` times without a result
(its evaluation failed, or killed its worker, each time), with the reason
(rlpipe/side_streams.py): a forged request costs no worker a minute's wait, and none is
tried forever.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time

import redis

from rlpipe import registry
from rlpipe.config import RunConfig
from rlpipe.datasets import load_rows
from rlpipe.keys import Keys
from rlpipe.side_streams import dead_letter
from rollout_service import eval_cache
from rollout_service.engine import RolloutEngine
from rollout_service.inline_tools import answer_with_tool, load_tool
from rollout_service.tasks import PromptEncoder, Task, any_number_matches, eval_task_config, make_task

log = logging.getLogger(__name__)

GROUP = "eval"
VERSION_WAIT_S = 60.0  # how long an evaluation waits for the engine to load the version asked for
EVAL_SEED = 1_000_000_007  # eval rows' sampling seeds: row i samples with seed EVAL_SEED + i, on any worker


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion (better than the normal one near 0 and 1,
    where small models' accuracies are)."""
    if n == 0:
        return 0.0, 0.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def make_eval_task(cfg: RunConfig) -> Task:
    """The held-out task: the training task's settings on ``eval.dataset``, rows in file order, without the
    questions it shares with ``task.dataset`` when ``eval.drop_shared`` (else launch refused them)."""
    task = make_task(eval_task_config(cfg.task, cfg.eval.dataset))
    if cfg.eval.drop_shared:
        t = cfg.task  # read with the task's fields, as its own rows are
        dropped = task.drop_questions_of(load_rows(t.dataset, t.prompt_field, t.answer_field, t.id_field,
                                                   need_answer=False))
        log.info("eval: %d rows of %s dropped (their question is in %s); %d left", dropped, cfg.eval.dataset,
                 cfg.task.dataset, task.size)
    return task


class EvalRunner:
    def __init__(self, cfg: RunConfig, worker_id: str, engine: RolloutEngine, r: redis.Redis, task: Task,
                 encode: PromptEncoder):
        self.cfg, self.worker_id, self.engine, self.r, self.task, self.encode = cfg, worker_id, engine, r, task, encode
        self.keys = Keys(cfg.run_id)
        self.stopping = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.errors: dict[str, str] = {}  # request -> why its last evaluation here failed
        self.tool = load_tool(cfg.task.tool) if cfg.task.tool else None  # answers written with it (task.tool)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="eval")

    async def stop(self) -> None:
        self.stopping.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def run(self) -> None:
        while not self.stopping.is_set():
            entry_id = None
            try:
                entry = await asyncio.to_thread(self.next_request)
                if entry is None:
                    continue
                entry_id, fields = entry
                asked = await asyncio.to_thread(self.asked, entry_id, fields)
                if asked is None:
                    continue
                result = await self.evaluate(*asked)
                await asyncio.to_thread(self.publish, entry_id, result)
                self.errors.pop(entry_id, None)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis away for a moment, a reward that failed: tried again (next_request)
                if entry_id is not None:
                    self.errors[entry_id] = repr(e)
                log.warning("eval: request %s failed: %r", entry_id, e)
                await asyncio.sleep(1.0)

    # -- Redis -----------------------------------------------------------------------------
    def next_request(self, block_ms: int = 1000) -> tuple[str, dict] | None:
        """An orphaned request (its worker is gone) first, else a new one (waits up to ``block_ms``)."""
        try:
            self.r.xgroup_create(self.keys.eval_requests, GROUP, id="0", mkstream=True)
        except redis.ResponseError:  # BUSYGROUP: it exists
            pass
        live = registry.live_workers(self.r, self.keys)
        for pending in self.r.xpending_range(self.keys.eval_requests, GROUP, "-", "+", 16):
            consumer, entry_id = _text(pending["consumer"]), _text(pending["message_id"])
            # Its own: a request this process's predecessor (same worker id) took and never finished,
            # or one whose evaluation failed here (tried again until its delivery limit).
            if consumer not in live or consumer == self.worker_id:
                claimed = self.r.xclaim(self.keys.eval_requests, GROUP, self.worker_id, 0, [entry_id])
                if not claimed or claimed[0][1] is None:  # deleted while pending
                    self.r.xack(self.keys.eval_requests, GROUP, entry_id)
                    continue
                if pending["times_delivered"] >= self.cfg.queue.max_deliveries:
                    why = self.errors.pop(entry_id, "its worker died with it each time?")
                    dead_letter(self.r, self.keys.eval_requests, entry_id, claimed[0][1],
                                f"delivered {pending['times_delivered']} times without a result: {why}", GROUP)
                    continue
                if consumer != self.worker_id:
                    log.info("eval: taking over request %s of worker %s", entry_id, consumer)
                return self._decoded(claimed[0])
        got = self.r.xreadgroup(GROUP, self.worker_id, {self.keys.eval_requests: ">"}, count=1, block=block_ms)
        return self._decoded(got[0][1][0]) if got else None

    def asked(self, entry_id: str, fields: dict) -> tuple[int, int] | None:
        """A request's ``(version, step)`` if the learner asked for it (``eval:requested``
        has that version at that step); otherwise it is dead-lettered at once, saying why,
        and None."""
        try:
            version, step = int(fields.get("version", "")), int(fields.get("step", ""))
        except ValueError:
            why = f"version {fields.get('version', '')[:40]!r}, step {fields.get('step', '')[:40]!r}: not integers"
        else:
            asked_at = self.r.hget(self.keys.eval_requested, str(version))
            if asked_at is not None and _text(asked_at) == str(step):
                return version, step
            why = f"the learner never asked for an evaluation of version {version} at step {step}"
        dead_letter(self.r, self.keys.eval_requests, entry_id, fields, why, GROUP)
        return None

    @staticmethod
    def _decoded(entry) -> tuple[str, dict]:
        entry_id, fields = entry
        return _text(entry_id), {_text(k): _text(v) for k, v in fields.items()}

    def publish(self, entry_id: str, result: dict) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.keys.eval_results, {"result": json.dumps(result)})
        pipe.xack(self.keys.eval_requests, GROUP, entry_id)
        pipe.execute()
        log.info("eval of version %d on %s: pass@1 %.3f, mean@%d %s (%d rows, %.0f s)", result["version"],
                 result["dataset"], result["pass_at_1"], result["k"],
                 "-" if result["mean_at_k"] is None else f"{result['mean_at_k']:.3f}", result["rows"],
                 result["seconds"])

    # -- the evaluation ----------------------------------------------------------------------
    async def evaluate(self, requested_version: int, step: int) -> dict:
        # The learner asks once it sent the version; the engine loads it a moment later.
        deadline = time.monotonic() + VERSION_WAIT_S
        while self.engine.version < requested_version and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        t0, v0 = time.monotonic(), self.engine.version
        key = await asyncio.to_thread(self.base_key) if self._reusable(requested_version) else None
        fields = eval_cache.load(key) if key else None
        reused = fields is not None
        if reused:
            log.info("eval: the base model's result on %s reused (eval.reuse_base, key %s)", self.cfg.eval.dataset, key)
        else:
            fields = await self.score_rows()
            if key and self.engine.version == v0:  # no update landed meanwhile: the base model's own
                await asyncio.to_thread(eval_cache.store, key, fields)
        return {"dataset": self.cfg.eval.dataset, "requested_version": requested_version, "step": step,
                "version": v0, "version_end": self.engine.version, **fields, "reused": reused,
                "seconds": time.monotonic() - t0, "worker": self.worker_id}

    def _reusable(self, requested_version: int) -> bool:
        """Version 0 on an engine that still serves the base model (its own files, or the learner's
        copy of them at version 0): the one evaluation whose answers another run already has."""
        return (self.cfg.eval.reuse_base and requested_version == 0 and self.engine.version == 0
                and self.engine.weights_source in ("base", "learner"))

    def base_key(self) -> str:
        ec, s = self.cfg.eval, self.cfg.sampling
        rows = [self.task.prompt(i) for i in range(min(ec.size, self.task.size))]
        sampling = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k} if ec.samples else {}
        settings = {"max_tokens": s.max_tokens, "samples": ec.samples, "max_model_len": self.cfg.rollout.max_model_len,
                    "seed": EVAL_SEED, **sampling,
                    **({"tool": self.cfg.task.tool, "without_tool": ec.without_tool} if self.tool else {})}
        return eval_cache.base_key(self.engine.model_dir, self.engine.profile,
                                   [(self.encode(p.text, p.messages), p.answer) for p in rows], settings)

    async def score_rows(self) -> dict:
        """Every row's greedy answer (and ``eval.samples`` sampled ones), scored: the result's
        proportions, intervals and the rows right."""
        ec, s = self.cfg.eval, self.cfg.sampling
        gate = asyncio.Semaphore(ec.concurrency)
        max_len = self.cfg.rollout.max_model_len
        t0 = time.monotonic()

        async def row(i: int) -> tuple[float, list[float], int, bool, dict] | None:
            async with gate:
                prompt = self.task.prompt(i)
                ids = self.encode(prompt.text, prompt.messages)
                if len(ids) + s.max_tokens > max_len:
                    return None
                answers, calls = await self._answers(ids, 1, None, temperature=0.0)
                if ec.samples:
                    answers += (await self._answers(ids, ec.samples, (EVAL_SEED + i) % 2**31,
                                                    temperature=s.temperature, top_p=s.top_p, top_k=s.top_k))[0]
                if self.tool is not None and ec.without_tool:
                    plain, _, _ = await self.engine.generate(ids, n=1, temperature=0.0, max_tokens=s.max_tokens)
                    answers.append(plain[0].tokens)
                texts = [self.encode.tokenizer.decode(tokens, skip_special_tokens=True) for tokens in answers]
                # A held-out score is a proportion: a reward outside [0, 1] (a user's reward may pay more for
                # a better answer) counts as 1 or 0, else its mean and Wilson interval are no proportion at all.
                scores = [min(max(float(reward), 0.0), 1.0) for reward, _ in await self.task.score(prompt, texts)]
                plain = scores.pop() if self.tool is not None and ec.without_tool else None
                extra = {"calls": calls[0] if calls else 0, "plain": plain}
                return scores[0], scores[1:], i, scores[0] > 0 or any_number_matches(prompt.answer, texts[0]), extra

        rows = [r for r in await asyncio.gather(*(row(i) for i in range(min(ec.size, self.task.size))))
                if r is not None]
        greedy = [g for g, *_ in rows]
        lenient = [float(ok) for *_, ok, _ in rows]
        sampled = [sum(k) / len(k) for _, k, *_ in rows if k]
        low, high = wilson_interval(sum(greedy), len(greedy))
        low_l, high_l = wilson_interval(sum(lenient), len(lenient))
        return {
            "rows": len(rows), "skipped_rows": min(ec.size, self.task.size) - len(rows),
            "pass_at_1": sum(greedy) / len(greedy) if greedy else 0.0, "pass_at_1_low": low, "pass_at_1_high": high,
            # lenient: any number of the answer equals the reference (strict: the last one)
            "pass_at_1_lenient": sum(lenient) / len(lenient) if lenient else 0.0,
            "pass_at_1_lenient_low": low_l, "pass_at_1_lenient_high": high_l,
            # which rows were right (strict, lenient): a paired test against another version's
            "rows_evaluated": [i for _, _, i, _, _ in rows], "rows_right": [i for g, _, i, _, _ in rows if g > 0],
            "rows_right_lenient": [i for _, _, i, ok, _ in rows if ok],
            "k": ec.samples, "mean_at_k": sum(sampled) / len(sampled) if sampled else None,
            "seconds": time.monotonic() - t0,
            **(self._tool_fields(rows) if self.tool is not None else {}),
        }

    def _tool_fields(self, rows: list) -> dict:
        """With ``task.tool``: how often the greedy answers used it and, with ``eval.without_tool``,
        the same rows answered without it (the skill that stays)."""
        fields = {"tool": self.cfg.task.tool, "tool_calls": sum(x["calls"] for *_, x in rows),
                  "rows_using_tool": sum(1 for *_, x in rows if x["calls"])}
        if self.cfg.eval.without_tool:
            plain = [x["plain"] for *_, x in rows]
            low, high = wilson_interval(sum(plain), len(plain))
            fields.update({"pass_at_1_without_tool": sum(plain) / len(plain) if plain else 0.0,
                           "pass_at_1_without_tool_low": low, "pass_at_1_without_tool_high": high,
                           "rows_right_without_tool": [i for _, _, i, _, x in rows if x["plain"] > 0]})
        return fields

    async def _answers(self, ids: list[int], n: int, seed: int | None, **sampling) -> tuple[list, list[int]]:
        """``n`` answers' tokens to ``ids`` (with ``task.tool``, written with it: each answer its own
        request, its seed ``seed + i``) and how many values the tool wrote in each."""
        max_tokens = self.cfg.sampling.max_tokens
        if self.tool is None:
            results, _, _ = await self.engine.generate(ids, n=n, max_tokens=max_tokens, seed=seed, **sampling)
            return [r.tokens for r in results], [0] * n
        answers = await asyncio.gather(*(
            answer_with_tool(self.engine, self.encode.tokenizer, ids, self.tool(), max_tokens,
                             None if seed is None else (seed + i) % 2**31, **sampling) for i in range(n)))
        return [a.tokens for a in answers], [a.calls for a in answers]
