"""One rollout worker: its engine and, with a Redis URL in the config, the rollout loop
(which follows the learner's weight syncs, rollout_service/loop.py) and held-out
evaluation (rollout_service/evals.py); without one it only serves ``/v1/generate`` (a plain
sampling server, as the tests use it).

The HTTP routes (rollout_service/app.py) are thin: start-up, SIGTERM's drain, shutdown, the
probes and ``/v1/status`` are decided here; what the API's requests get (``/v1/generate``, the
sessions, the OpenAI-shaped routes) is rollout_service/api_requests.py's, as ``worker.api``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
import signal
from contextlib import contextmanager

from fastapi import HTTPException
from prometheus_client import generate_latest

from quant.precision_profile import profile_for
from rlpipe.config import RunConfig
from rollout_service.api_requests import ApiRequests

log = logging.getLogger(__name__)


class ApiShare:
    """How much of the engine ``/v1/generate`` may hold, so an API burst cannot starve training.

    The engine's in-flight budget is what the rollout loop alone runs: ``max_inflight_groups``
    group slots of ``sampling.n`` sequences. The loop reserves ``ceil(loop_share * slots)``
    of them; API requests may hold the other slots' sequences between them (a request costs
    its ``n``), and one that does not fit now gets 429. The loop in turn starts a group only
    while its groups in flight plus ``slots()``, the API's sequences rounded up to whole
    groups, fit in ``max_inflight_groups`` (rollout_service/loop.py). As the API holds at
    most the unreserved slots, the loop can always keep its reserved groups in flight,
    whatever the API does, and all of them once the API is idle; and the engine runs at most
    the budget, plus the API's part while the loop's older groups finish. Every running
    sequence gets one token per engine step, so the loop's share of the sequences is its
    share of the engine's tokens. A worker without Redis runs no loop: the API may hold the
    whole budget. (Refusing at once, not queueing, keeps a burst from piling up requests
    whose clients have long given up.)"""

    def __init__(self, cfg: RunConfig):
        slots, self.group_size = cfg.rollout.max_inflight_groups, cfg.sampling.n
        reserved = math.ceil(cfg.rollout.loop_share * slots) if cfg.redis_url else 0
        self.capacity = (slots - reserved) * self.group_size  # sequences
        self.sequences = 0  # held by API requests now

    def slots(self) -> int:
        """Group slots the API holds now (its sequences, rounded up to whole groups)."""
        return -(-self.sequences // self.group_size)

    @contextmanager
    def hold(self, n: int):
        """Hold ``n`` sequences while generating; 429 if they do not fit now."""
        if self.sequences + n > self.capacity:
            raise HTTPException(429, f"busy: API requests hold {self.sequences} of the {self.capacity} sequences "
                                f"this worker gives /v1/generate (rollout.loop_share keeps the rest for training); "
                                f"retry later", headers={"Retry-After": "1"})
        self.sequences += n
        try:
            yield
        finally:
            self.sequences -= n


class Worker:
    """The engine, the rollout loop and the state the routes read. ``start`` and ``stop`` are
    the app's lifespan; ``drain`` is SIGTERM's first step (rollout_service/server.py); ``api``
    answers the API's requests (rollout_service/api_requests.py)."""

    def __init__(self, cfg: RunConfig, worker_id: str = "w0", address: str = "", redis_client=None):
        from rollout_service.adapters import lora_serve
        from rollout_service.engine import RolloutEngine
        from rollout_service.metrics import RolloutMetrics
        from weight_sync.transport_choice import role_transport

        self.cfg, self.id, self.address, self.redis_client = cfg, worker_id, address, redis_client
        self.limits = cfg.rollout
        self.profile = profile_for(cfg.rollout.precision, quant=cfg.quant, model_path=cfg.model.path)
        self.engine = RolloutEngine(cfg.model.path, self.profile, cfg.rollout, seed=cfg.seed,
                                    transport=role_transport(cfg), lora=lora_serve(cfg),
                                    sampler_topk=cfg.learner.score_centering_k)
        self.metrics = RolloutMetrics(worker_id, self.profile.precision, cfg.run_id, str(cfg.model.path or ""),
                                      cfg.rollout.vllm_metrics)
        self.api_share = ApiShare(cfg)
        self.api = ApiRequests(self)  # what the API's requests get, within api_share
        self.tokenizer = None
        self.loop = self.evals = None  # with Redis only
        self.sessions = self.reaper = None  # from start(), which loads the tokenizer they need
        self.started = False  # from the end of start() to the beginning of stop()
        self.draining = False
        self.stopping = None  # the loop's shutdown, once SIGTERM started it
        self.fatal = None  # why this worker cannot continue, once it cannot
        self.metrics.ready.set_function(lambda: float(self.ready()))

    async def start(self) -> None:
        from transformers import AutoTokenizer

        from rlpipe.config import ConfigError
        from rollout_service.sessions import load_chat_template
        from rollout_service.tasks import PromptEncoder

        cfg = self.cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        try:  # task.chat_template with a tokenizer that has none: refused before the engine starts
            PromptEncoder(cfg.task, self.tokenizer, cfg.model.path)  # (rlpipe rollout checks it even earlier)
            chat_template = load_chat_template(cfg.rollout.chat_template, self.tokenizer)
        except ConfigError as e:
            log.critical("worker %s cannot start: %s", self.id, e)
            raise
        await self.engine.start()
        self.metrics.version.set(self.engine.version)
        self._start_sessions(chat_template)
        if cfg.redis_url:
            self._start_loop()
        else:
            self.engine.synced = True  # standalone: the weights on disk are the policy
        # The start-up heap (torch, vLLM, the tokenizer: some 700k objects) is collected once and
        # frozen out of the collector: a full collection of it took 1.3 s on the event loop, set
        # off by the first burst of requests (48 refused 1 MB prompts held /healthz that long).
        gc.collect()
        gc.freeze()
        self.started = True
        log.info("worker %s ready at %s (%s)", self.id, self.address, self.profile.precision)

    def _start_sessions(self, chat_template: str | None) -> None:
        """The session store, and its reaper that gives back idle sessions."""
        from rollout_service.sessions import Sessions
        from rollout_service.tokenizing import OffLoop

        self.sessions = Sessions(self.limits, self.tokenizer, chat_template, self.api.sample_one,
                                 lambda: self.engine.version, self.metrics, off_loop=OffLoop())
        self.sessions.bound.measured  # noqa: B018 - measured once now, not in the first request
        self.reaper = asyncio.ensure_future(self.sessions.reap())

    def _start_loop(self) -> None:
        """The rollout loop, and evaluations when the run asks for them."""
        from rlpipe.queue import TrajectoryQueue
        from rlpipe.redis_link import connect
        from rollout_service.loop import RolloutLoop
        from rollout_service.tasks import PromptEncoder, make_task

        cfg = self.cfg
        queue = TrajectoryQueue(self.redis_client or connect(cfg.redis_url, cfg.redis_wait_s), cfg.run_id)
        self.loop = RolloutLoop(cfg, self.id, self.address, self.engine, queue, make_task(cfg.task),
                                self.tokenizer, self.metrics, self._on_fatal, api_slots=self.api_share.slots)
        self.loop.start()
        if cfg.eval.every:
            from rollout_service.evals import EvalRunner, make_eval_task

            self.evals = EvalRunner(cfg, self.id, self.engine, queue.r, make_eval_task(cfg),
                                    PromptEncoder(cfg.task, self.tokenizer, cfg.model.path))
            self.evals.start()

    def _on_fatal(self, reason: str) -> None:
        # Exit (non-zero, see rollout_service.server) so a supervisor restarts us.
        log.critical("worker %s cannot continue: %s", self.id, reason)
        self.fatal = reason
        os.kill(os.getpid(), signal.SIGTERM)

    async def stop(self) -> None:
        self.started = False
        if self.reaper is not None:
            self.reaper.cancel()
        if self.evals is not None:
            await self.evals.stop()
        if self.loop is not None:
            await (self.stopping or self.loop.stop())
        if self.sessions is not None:
            self.sessions.off_loop.close()
        self.engine.shutdown()

    def drain(self) -> None:
        """SIGTERM: stop taking prompts at once, and start the loop's shutdown now, so the groups in
        flight get ``rollout.shutdown_deadline_s`` from SIGTERM (as Kubernetes counts its grace
        period), not from when uvicorn has finished with its connections."""
        log.info("worker %s draining: no new prompts", self.id)
        self.draining = True
        if self.loop is not None and self.stopping is None:
            self.loop.stopping.set()
            self.stopping = asyncio.ensure_future(self.loop.stop())

    def ready(self) -> bool:
        """Takes work: started, not draining, weights of a known version, the engine alive, and the
        reward's or environment's calls not stuck (a worker that refuses every reward call must not
        be sent sessions or counted as serving; after STUCK_EXIT_S it exits for its supervisor)."""
        return (self.started and not self.draining and self.engine.synced and not self.engine.errored
                and not self.calls_stuck())

    def calls_stuck(self) -> str | None:
        """Why the rollout loop's reward or environment takes no calls now, or None."""
        return self.loop.watch.calls_stuck() if self.loop is not None else None

    def health(self) -> dict:
        """The process is alive, its engine has not died and its rollout loop is not stuck
        (``status`` says which): a loop whose reward hung once stopped training for good while
        this said ok, so a liveness probe never restarted it (issue 33 item 12)."""
        stuck = self.loop.watch.stuck() if self.loop is not None and not self.draining else None
        status = "engine dead" if self.engine.errored else f"rollout loop stuck: {stuck}" if stuck else "ok"
        return {"status": status, "worker_id": self.id}

    def readiness(self) -> dict:
        """Engine up, weights of a known version, not draining (``ready`` says whether)."""
        if not self.ready():
            stuck = self.calls_stuck()
            return {"ready": False, "version": self.engine.version, "draining": self.draining,
                    **({"calls_stuck": stuck} if stuck else {})}
        return {"ready": True, "version": self.engine.version}

    def prometheus(self) -> bytes:
        """The metrics in Prometheus' text format."""
        if self.loop is not None:
            self.loop.idle_seconds()  # the idle counter, up to this moment
        return generate_latest(self.metrics.registry)

    def status(self) -> dict:
        """What ``/v1/status`` answers."""
        engine, loop, limits, profile = self.engine, self.loop, self.limits, self.profile
        backlog = dict(loop.backlog) if loop else {}
        if "learner_version" in backlog:
            backlog["version_lag"] = backlog["learner_version"] - engine.version
        return {
            "worker_id": self.id,
            "version": engine.version,
            "synced": engine.synced,
            "weights": engine.weights_source,
            "precision": profile.precision,
            "quant_profile": engine.quant_profile,  # of the weights in the engine (moves with a recalibration)
            "profile": {"precision": profile.precision, "dtype": profile.dtype,
                        "quantization": profile.quantization, "hash": profile.quant_hash,
                        "checkpoint": profile.checkpoint, "compat": profile.compat},
            "limits": {**{k: getattr(limits, k) for k in ("max_prompt_tokens", "max_n", "max_new_tokens",
                                                          "max_model_len", "max_body_bytes")},
                       "api_sequences": self.api_share.capacity},
            "draining": self.draining,
            "inflight_requests": engine.inflight,
            "api_sequences": self.api_share.sequences,  # held by /v1/generate requests now
            "inflight_groups": len(loop.groups) if loop else 0,
            "queue": backlog,
            "sync_generation": loop.generation if loop else 0,
            "paused_seconds_total": engine.paused_seconds_total,
            # the last update: its version, source, timings (transfer_s or read_s: staging while generating;
            # load_s; pause_s: the activation pause, generation paused) and activated_at
            "last_sync": loop.last_sync if loop else {},
            "idle_seconds_total": loop.idle_seconds() if loop else 0.0,  # no group in flight while serving
            # the prefix-cache salt new requests get: one per weights loaded (rollout_service/prefix_cache.py)
            "prefix_cache_salt": engine.salts.current,
            "adapters": engine.adapters.versions,  # learner.lora: the versions whose adapters the engine holds
            "last_error": loop.last_error if loop else None,
        }
