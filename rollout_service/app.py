"""The rollout worker's HTTP interface (FastAPI).

    GET  /healthz      process alive (open)
    GET  /readyz       engine up and holding weights of a known version, 503 otherwise (open)
    GET  /metrics      Prometheus (open)
    GET  /v1/status    version, precision profile, in-flight requests, queue lag (token)
    POST /v1/generate  token ids or text in; tokens, behavior log-probs, finish reasons,
                       policy versions out (token)
    GET  /openapi.json the schema; /docs renders it

"token": with ``RLPIPE_API_TOKEN`` set these need ``Authorization: Bearer <token>``
(rlpipe/auth.py). Every limit (prompt length, n, max_tokens, body size) comes from the
``rollout`` config section; a request over one gets a 4xx naming the field, and so does any
malformed request (NaN or an infinity in a number, a lone surrogate in text): never a 5xx.
The schema states the ranges the engine really takes (vLLM's ``SamplingParams`` checks;
rollout_service/api_models.py).
Generation through the API holds at most its share of the engine (``ApiShare``); beyond it
a request gets 429 with ``Retry-After``.

With a Redis URL in the config the app also runs the rollout loop (a *worker*); without
one it only serves ``/v1/generate`` (a plain sampling server, as the tests use it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
from contextlib import asynccontextmanager, contextmanager

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from quant.profiles import profile_for
from rlpipe.auth import api_token, require_token
from rlpipe.config import RunConfig
from rollout_service.api_models import Choice, GenerateRequest, GenerateResponse, bad_request, request_model

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


def json_safe(value):
    """``value`` as JSON can carry it. A 422 echoes the offending input, which may be NaN or
    an infinity (JSON has neither, and rendering them failed: a 500 and a reset connection)
    or text with a lone surrogate (UTF-8 has no encoding for it); those become their Python
    spelling ('nan', 'inf', '\\ud800'), and anything else not JSON (an exception in an
    error's context) its str()."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {json_safe(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return json_safe(str(value))


class TextRequest(Request):
    """A request whose JSON body may hold bytes that are not UTF-8: they decode to lone
    surrogates, which the text fields then refuse naming the field (plain ``json.loads``
    of the bytes failed with a 400 that named nothing)."""

    async def json(self):
        if not hasattr(self, "_json"):
            self._json = json.loads((await self.body()).decode("utf-8-sig", "surrogateescape"))
        return self._json


class TextRoute(APIRoute):
    """A route that reads its body as a ``TextRequest``."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            return await handler(TextRequest(request.scope, request.receive))

        return route


class Problem(BaseModel):
    detail: str | list


ERRORS = {code: {"model": Problem, "description": why} for code, why in (
    (400, "body is not JSON"), (401, "missing or wrong bearer token"), (411, "no Content-Length"), (413, "body too large"),
    (422, "invalid request: detail names the field"),
    (429, "the API's share of the engine is busy: retry after Retry-After seconds"),
    (503, "not ready, draining, or engine down"))}


def create_app(cfg: RunConfig, worker_id: str = "w0", address: str = "", redis_client=None) -> FastAPI:
    from rlpipe.gpus import role_transport
    from rollout_service.engine import InvalidRequest, RolloutEngine
    from rollout_service.metrics import RolloutMetrics

    profile = profile_for(cfg.rollout.precision, quant=cfg.quant, model_path=cfg.model.path)
    engine = RolloutEngine(cfg.model.path, profile, cfg.rollout, seed=cfg.seed, transport=role_transport(cfg))
    metrics = RolloutMetrics(worker_id, profile.precision, cfg.run_id)
    limits = cfg.rollout
    api_share = ApiShare(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from transformers import AutoTokenizer

        from rlpipe.config import ConfigError
        from rollout_service.tasks import PromptEncoder

        app.state.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        try:  # task.chat_template with a tokenizer that has none: refused before the engine starts
            PromptEncoder(cfg.task, app.state.tokenizer, cfg.model.path)  # (rlpipe rollout checks it even earlier)
        except ConfigError as e:
            log.critical("worker %s cannot start: %s", worker_id, e)
            raise
        await engine.start()
        metrics.version.set(engine.version)
        app.state.loop = app.state.evals = None
        if cfg.redis_url:
            from rlpipe.queue import TrajectoryQueue, connect
            from rollout_service.loop import RolloutLoop
            from rollout_service.tasks import make_task

            def on_fatal(reason: str) -> None:
                # Exit (non-zero, see rollout_service.server) so a supervisor restarts us.
                log.critical("worker %s cannot continue: %s", worker_id, reason)
                app.state.fatal = reason
                os.kill(os.getpid(), signal.SIGTERM)

            queue = TrajectoryQueue(redis_client or connect(cfg.redis_url, cfg.redis_wait_s), cfg.run_id)
            app.state.loop = RolloutLoop(cfg, worker_id, address, engine, queue, make_task(cfg.task),
                                         app.state.tokenizer, metrics, on_fatal, api_slots=api_share.slots)
            app.state.loop.start()
            if cfg.eval.every:
                from rollout_service.evals import EvalRunner, make_eval_task

                app.state.evals = EvalRunner(cfg, worker_id, engine, queue.r, make_eval_task(cfg),
                                             PromptEncoder(cfg.task, app.state.tokenizer, cfg.model.path))
                app.state.evals.start()
        else:
            engine.synced = True  # standalone: the weights on disk are the policy
        app.state.ready = True
        log.info("worker %s ready at %s (%s)", worker_id, address, profile.precision)
        try:
            yield
        finally:
            app.state.ready = False
            if app.state.evals is not None:
                await app.state.evals.stop()
            if app.state.loop is not None:
                await (app.state.stopping or app.state.loop.stop())
            engine.shutdown()

    app = FastAPI(title="rlpipe rollout worker", version="1", lifespan=lifespan)
    app.state.ready = False
    app.state.draining = False
    app.state.stopping = None  # the loop's shutdown, once SIGTERM started it
    app.state.fatal = None
    app.state.engine = engine
    app.state.metrics = metrics

    def drain() -> None:
        """SIGTERM: stop taking prompts at once, and start the loop's shutdown now, so the groups in
        flight get ``rollout.shutdown_deadline_s`` from SIGTERM (as Kubernetes counts its grace
        period), not from when uvicorn has finished with its connections."""
        log.info("worker %s draining: no new prompts", worker_id)
        app.state.draining = True
        if app.state.loop is not None and app.state.stopping is None:
            app.state.loop.stopping.set()
            app.state.stopping = asyncio.ensure_future(app.state.loop.stop())

    app.state.drain = drain

    def ready() -> bool:
        return app.state.ready and not app.state.draining and engine.synced and not engine.errored

    metrics.ready.set_function(lambda: float(ready()))
    token = api_token()
    authorized = [require_token(token)]
    LimitedRequest = request_model(limits, api_share.capacity)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        """FastAPI's own 422, rendered so that no input can break it (``json_safe``)."""
        return JSONResponse({"detail": json_safe(exc.errors())}, status_code=422)

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if request.method in ("POST", "PUT", "PATCH") and length is None:
            return JSONResponse({"detail": "Content-Length required"}, status_code=411)
        if length is not None and (not length.isdigit() or int(length) > limits.max_body_bytes):
            return JSONResponse({"detail": f"body larger than {limits.max_body_bytes} bytes"}, status_code=413)
        response = await call_next(request)
        if response.status_code >= 400:
            metrics.requests_rejected.labels(**metrics.labels, code=str(response.status_code)).inc()
        return response

    @app.get("/healthz", responses={503: ERRORS[503]})
    async def healthz():
        """The process is alive and its engine has not died."""
        if engine.errored:
            return JSONResponse({"status": "engine dead", "worker_id": worker_id}, status_code=503)
        return {"status": "ok", "worker_id": worker_id}

    @app.get("/readyz", responses={503: ERRORS[503]})
    async def readyz():
        """Ready to serve: engine up, weights of a known version, not draining."""
        if not ready():
            return JSONResponse({"ready": False, "version": engine.version, "draining": app.state.draining},
                                status_code=503)
        return {"ready": True, "version": engine.version}

    @app.get("/metrics", response_class=Response)
    async def prometheus():
        """Prometheus text format."""
        if app.state.loop is not None:
            app.state.loop.idle_seconds()  # the idle counter, up to this moment
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/status", dependencies=authorized, responses={401: ERRORS[401]})
    async def status():
        """Version, precision profile, in-flight work and how far the stream is ahead."""
        loop = app.state.loop
        backlog = dict(loop.backlog) if loop else {}
        if "learner_version" in backlog:
            backlog["version_lag"] = backlog["learner_version"] - engine.version
        return {
            "worker_id": worker_id,
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
                       "api_sequences": api_share.capacity},
            "draining": app.state.draining,
            "inflight_requests": engine.inflight,
            "api_sequences": api_share.sequences,  # held by /v1/generate requests now
            "inflight_groups": len(loop.groups) if loop else 0,
            "queue": backlog,
            "sync_generation": loop.generation if loop else 0,
            "paused_seconds_total": engine.paused_seconds_total,
            "idle_seconds_total": loop.idle_seconds() if loop else 0.0,  # no group in flight while serving
            # updates after which running requests kept the prefix cache from being reset
            "prefix_cache_reset_failures": engine.prefix_cache_reset_failures,
            "last_error": loop.last_error if loop else None,
        }

    async def generate(req: GenerateRequest):
        """Sample ``n`` responses to one prompt (token ids, or text the worker tokenizes).

        For multi-turn use, send the whole conversation as ``prompt_token_ids`` built from
        earlier responses' ``tokens``: re-tokenizing their text can give other ids."""
        if not app.state.ready or engine.errored:
            raise HTTPException(503, "engine not ready")
        tokenizer = app.state.tokenizer
        if req.prompt is not None:
            field = "prompt"
            try:
                prompt_ids = tokenizer(req.prompt)["input_ids"]
            except (TypeError, ValueError) as e:  # text the schema let through but the tokenizer refuses
                raise bad_request(field, f"the tokenizer refused it: {e}") from None
        else:
            prompt_ids, field = req.prompt_token_ids, "prompt_token_ids"
        if not prompt_ids:
            raise bad_request(field, "empty prompt")
        if len(prompt_ids) > limits.max_prompt_tokens:  # for text (the schema bounds token ids, n, max_tokens)
            raise bad_request(field, f"{len(prompt_ids)} tokens exceeds the limit of {limits.max_prompt_tokens}")
        vocab = len(tokenizer)
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise bad_request(field, f"token ids must be in [0, {vocab})")
        if len(prompt_ids) + req.max_tokens > limits.max_model_len:
            raise bad_request("max_tokens", f"prompt + max_tokens exceeds the model length {limits.max_model_len}")
        try:
            with api_share.hold(req.n):
                results, v0, v1 = await engine.generate(
                    prompt_ids, n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    max_tokens=req.max_tokens, min_tokens=req.min_tokens, seed=req.seed, stop=req.stop)
        except InvalidRequest as e:
            raise bad_request(e.field, str(e)) from None
        return GenerateResponse(
            prompt_token_ids=list(prompt_ids),
            choices=[Choice(tokens=r.tokens.tolist(), logprobs=r.logprobs.tolist(),
                            versions=None if r.versions is None else r.versions.tolist(),
                            finish_reason=r.finish_reason,
                            text=tokenizer.decode(r.tokens, skip_special_tokens=True)) for r in results],
            policy_version=v0, policy_version_end=v1, precision=profile.precision,
        )

    generate.__annotations__["req"] = LimitedRequest  # a class, not a string: FastAPI reads it as is
    app.router.add_api_route("/v1/generate", generate, methods=["POST"], response_model=GenerateResponse,
                             dependencies=authorized, route_class_override=TextRoute,
                             responses={c: ERRORS[c] for c in (400, 401, 411, 413, 422, 429, 503)})
    return app
