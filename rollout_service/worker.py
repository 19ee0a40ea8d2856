"""One rollout worker: its engine and, with a Redis URL in the config, the rollout loop
(which follows the learner's weight syncs, rollout_service/loop.py) and held-out
evaluation (rollout_service/evals.py); without one it only serves ``/v1/generate`` (a plain
sampling server, as the tests use it).

The HTTP routes (rollout_service/app.py) are thin: what they answer is decided here, and so
are start-up, SIGTERM's drain and shutdown.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
import signal
from contextlib import contextmanager
from typing import TYPE_CHECKING

from fastapi import HTTPException
from prometheus_client import generate_latest

from quant.precision_profile import profile_for
from rlpipe.config import RunConfig
from rollout_service.api_models import (
    Choice,
    GenerateRequest,
    GenerateResponse,
    SessionOpened,
    Turn,
    bad_request,
    max_tokens_within,
)

if TYPE_CHECKING:
    from rollout_service.api_models import Episode, Finish, OpenSession, TurnResult
    from rollout_service.openai_api import ChatRequest, CompletionRequest

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
    the app's lifespan; ``drain`` is SIGTERM's first step (rollout_service/server.py)."""

    def __init__(self, cfg: RunConfig, worker_id: str = "w0", address: str = "", redis_client=None):
        from rollout_service.adapters import lora_serve
        from rollout_service.engine import RolloutEngine
        from rollout_service.metrics import RolloutMetrics
        from weight_sync.transport_choice import role_transport

        self.cfg, self.id, self.address, self.redis_client = cfg, worker_id, address, redis_client
        self.limits = cfg.rollout
        self.profile = profile_for(cfg.rollout.precision, quant=cfg.quant, model_path=cfg.model.path)
        self.engine = RolloutEngine(cfg.model.path, self.profile, cfg.rollout, seed=cfg.seed,
                                    transport=role_transport(cfg), lora=lora_serve(cfg))
        self.metrics = RolloutMetrics(worker_id, self.profile.precision, cfg.run_id, str(cfg.model.path or ""),
                                      cfg.rollout.vllm_metrics)
        self.api_share = ApiShare(cfg)
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

        self.sessions = Sessions(self.limits, self.tokenizer, chat_template, self._sample_one,
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
            # updates after which running requests kept the prefix cache from being reset
            "prefix_cache_reset_failures": engine.prefix_cache_reset_failures,
            "adapters": engine.adapters.versions,  # learner.lora: the versions whose adapters the engine holds
            "last_error": loop.last_error if loop else None,
        }

    def _check_ready(self) -> None:
        if not self.started or self.engine.errored:
            raise HTTPException(503, "engine not ready")

    async def sample(self, prompt_ids: list[int], n: int, sampling: dict):
        """The one way API requests reach the engine (``/v1/generate``, sessions, the OpenAI
        routes): within the API's share of it (``ApiShare``: 429 beyond), an engine refusal as a
        422 naming the field. Returns ``(samples, version_at_start, version_at_end)``."""
        from rollout_service.engine import InvalidRequest

        self._check_ready()
        try:
            with self.api_share.hold(n):
                return await self.engine.generate(prompt_ids, n=n, **sampling)
        except InvalidRequest as e:
            raise bad_request(e.field, str(e)) from None

    async def _sample_one(self, prompt_ids: list[int], sampling: dict):
        results, v0, v1 = await self.sample(prompt_ids, 1, sampling)
        return results[0], v0, v1

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        """``req``'s ``n`` samples, within the API's share of the engine (``ApiShare``)."""
        self._check_ready()
        prompt_ids = await self._prompt_ids(req)
        results, v0, v1 = await self.sample(prompt_ids, req.n, req.sampling())
        return GenerateResponse(
            prompt_token_ids=list(prompt_ids),
            choices=[Choice(tokens=r.tokens.tolist(), logprobs=r.logprobs.tolist(),
                            versions=None if r.versions is None else r.versions.tolist(),
                            finish_reason=r.finish_reason,
                            text=self.tokenizer.decode(r.tokens, skip_special_tokens=True)) for r in results],
            policy_version=v0, policy_version_end=v1, precision=self.profile.precision,
        )

    # -- sessions and the OpenAI-shaped routes (rollout_service/sessions.py, openai_api.py) ------
    async def open_session(self, req: OpenSession) -> SessionOpened:
        """A new session (not while draining: it could not finish; open ones may)."""
        self._check_ready()
        if self.draining:
            raise HTTPException(503, "draining: no new sessions on this worker")
        messages = None if req.messages is None else [m.for_template() for m in req.messages]
        session = await self.sessions.start_off_loop(messages, req.tools, req.prompt, req.prompt_token_ids)
        return SessionOpened(session_id=session.id, prompt_token_ids=session.ids)

    async def session_turn(self, session_id: str, req: Turn) -> TurnResult:
        return await self.sessions.turn(self.sessions.get(session_id), req)

    def finish_session(self, session_id: str, req: Finish) -> Episode:
        return self.sessions.finish(self.sessions.get(session_id), req)

    async def chat_completion(self, req: ChatRequest, session_header: str | None) -> dict:
        """A chat completion: stateless, or the next model turn of a session (the messages
        beyond those it holds appended first)."""
        from rollout_service.openai_api import new_messages, session_of

        self._check_ready()
        session_id = session_of(req, session_header)
        if session_id is None:
            messages = [m.for_template() for m in req.messages]
            return await self._stateless(req, True, await self.sessions.off_loop(self._chat_ids, messages, req.tools))
        session = self.sessions.get(session_id)
        return await self._session_turn(req, True, session, new_messages(session, req), None)

    async def completion(self, req: CompletionRequest, session_header: str | None) -> dict:
        """A text completion: stateless, or a plain session's next turn (``prompt`` appended first)."""
        from rollout_service.openai_api import session_of

        self._check_ready()
        session_id = session_of(req, session_header)
        if session_id is None:
            if isinstance(req.prompt, list):
                return await self._stateless(req, False, [int(i) for i in req.prompt])
            ids = await self.sessions.off_loop(self._text_ids, req.prompt, "prompt", self.limits.max_model_len - 1,
                                               f"no room within the model length {self.limits.max_model_len}")
            return await self._stateless(req, False, ids)
        as_turn = {"token_ids": req.prompt} if isinstance(req.prompt, list) else {"text": req.prompt or None}
        return await self._session_turn(req, False, self.sessions.get(session_id), [], as_turn)

    async def _session_turn(self, req, chat: bool, session, new_messages: list[dict], context: dict | None) -> dict:
        from rollout_service.api_models import Sampling
        from rollout_service.openai_api import choice, response

        if req.n != 1:
            raise bad_request("n", "a session samples one turn at a time: n must be 1")
        turn_req = Turn.model_construct(**{k: getattr(req, k) for k in Sampling.model_fields}, **(context or {}))
        turn = await self.sessions.turn(session, turn_req, new_messages if chat else None, req.max_tokens_field)
        prompt_ids = session.ids[:len(session.ids) - len(turn.token_ids)]
        return response(req, chat, prompt_ids, [choice(self.tokenizer, 0, chat, turn.text, turn.token_ids,
                                                       turn.logprobs, turn.versions, turn.finish_reason,
                                                       bool(req.logprobs))],
                        session.id, turn.policy_version, turn.policy_version_end)

    async def _stateless(self, req, chat: bool, prompt_ids: list[int]) -> dict:
        """A plain OpenAI-compatible completion of ``prompt_ids`` (nothing kept)."""
        from rollout_service.openai_api import choice, response

        field = "messages" if chat else "prompt"
        if not prompt_ids:
            raise bad_request(field, "empty prompt")
        self.sessions.check_ids(prompt_ids, field)
        if req.n > self.limits.max_n:
            raise bad_request("n", f"exceeds rollout.max_n ({self.limits.max_n})")
        room = self.limits.max_model_len - len(prompt_ids)
        if room < 1:
            raise bad_request(field, f"{len(prompt_ids)} tokens leave no room within the model length "
                              f"{self.limits.max_model_len}")
        max_tokens = max_tokens_within(req.max_tokens, req.min_tokens, self.limits.max_new_tokens, room,
                                       f"in the model length {self.limits.max_model_len} after the "
                                       f"{len(prompt_ids)} prompt tokens", req.max_tokens_field)
        results, v0, v1 = await self.sample(prompt_ids, req.n, req.sampling(max_tokens))
        choices = [choice(self.tokenizer, i, chat, self.tokenizer.decode(r.tokens, skip_special_tokens=True),
                          r.tokens.tolist(), r.logprobs.tolist(),
                          r.versions.tolist() if r.versions is not None else [v0] * len(r.tokens),
                          r.finish_reason, bool(req.logprobs)) for i, r in enumerate(results)]
        return response(req, chat, prompt_ids, choices, None, v0, v1)

    # -- text to ids, in the text threads (rollout_service/tokenizing.py) ----------------------
    def _text_ids(self, text: str, field: str, limit: int, beyond: str, encode=None) -> list[int]:
        """``text``'s ids, or a 422 naming ``field`` (``beyond`` says why) when it makes more than
        ``limit`` tokens, known from its bytes before it is tokenized when they say so
        (``TokenBound``: 1 MB took seconds to tokenize, its bytes take milliseconds)."""
        too_long = self.sessions.bound.over(text, limit)
        if too_long:
            raise bad_request(field, f"{too_long}: {beyond}")
        return encode(text) if encode else [int(i) for i in self.tokenizer(text)["input_ids"]]

    def _chat_ids(self, messages: list[dict], tools: list | None) -> list[int]:
        """A stateless chat's prompt ids: rendered with the generation prompt, then as ``_text_ids``."""
        return self._text_ids(self.sessions.chat.render(messages, tools, True), "messages",
                              self.limits.max_model_len - 1,
                              f"no room within the model length {self.limits.max_model_len}", self.sessions.chat.encode)

    async def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        """The prompt's token ids (text tokenized off the event loop, or refused from its bytes
        before), checked against what the schema cannot state: the limits for text, the
        vocabulary, and the prompt plus ``max_tokens`` within the model length (422 naming the field)."""
        limits = self.limits
        if req.prompt is not None:
            field = "prompt"
            try:
                prompt_ids = await self.sessions.off_loop(self._text_ids, req.prompt, field, limits.max_prompt_tokens,
                                                          f"exceeds the limit of {limits.max_prompt_tokens}")
            except (TypeError, ValueError) as e:  # text the schema let through but the tokenizer refuses
                raise bad_request(field, f"the tokenizer refused it: {e}") from None
        else:
            prompt_ids, field = req.prompt_token_ids, "prompt_token_ids"
        if not prompt_ids:
            raise bad_request(field, "empty prompt")
        if len(prompt_ids) > limits.max_prompt_tokens:  # for text (the schema bounds token ids, n, max_tokens)
            raise bad_request(field, f"{len(prompt_ids)} tokens exceeds the limit of {limits.max_prompt_tokens}")
        vocab = len(self.tokenizer)
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise bad_request(field, f"token ids must be in [0, {vocab})")
        max_tokens_within(req.max_tokens, req.min_tokens, limits.max_new_tokens, limits.max_model_len - len(prompt_ids),
                          f"in the model length {limits.max_model_len} after the {len(prompt_ids)} prompt tokens")
        return prompt_ids
