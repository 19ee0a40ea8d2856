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
``rollout`` config section; a request over one gets a 4xx naming the field.

With a Redis URL in the config the app also runs the rollout loop (a *worker*); without
one it only serves ``/v1/generate`` (a plain sampling server, as the tests use it).
"""

from __future__ import annotations

import logging
import os
import signal
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from quant.profiles import profile_for
from rlpipe.auth import api_token, require_token
from rlpipe.config import RunConfig

log = logging.getLogger(__name__)


class GenerateRequest(BaseModel):
    # strict: the types the schema states, no coercion (lax mode would take `true` as 1).
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "oneOf": [{"required": ["prompt"]}, {"required": ["prompt_token_ids"]}]})

    # Typed without None so the schema says what the service accepts; absent = None.
    prompt_token_ids: list[int] = Field(None, description="prompt as token ids (exactly one of this and prompt)")
    prompt: str = Field(None, description="prompt as text, tokenized by the worker")
    temperature: float = Field(1.0, ge=0, le=100, description="0 = greedy")
    n: int = Field(1, ge=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=2**31 - 1, description="-1 or 0: off")
    max_tokens: int = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0, description="no end-of-sequence before this many tokens")
    seed: int | None = Field(None, ge=0, lt=2**31)
    stop: list[str] | None = Field(None, max_length=16)

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of 'prompt' and 'prompt_token_ids'")
        return self

    @field_validator("n")
    @classmethod
    def _greedy_is_single(cls, n, info):
        if n > 1 and info.data.get("temperature", 1.0) == 0:
            raise ValueError("greedy sampling (temperature 0) gives one distinct sample: n must be 1")
        return n


def request_model(limits) -> type[GenerateRequest]:
    """``GenerateRequest`` with this worker's configured limits in its schema, so the
    served OpenAPI document states them. (Rules that span fields, such as prompt plus
    max_tokens within the model length, are checked in the handler.)"""
    return create_model(
        "GenerateRequest", __base__=GenerateRequest,
        prompt_token_ids=(list[Annotated[int, Field(ge=0, lt=2**31)]], Field(
            None, min_length=1, max_length=limits.max_prompt_tokens,
            description="prompt as token ids (exactly one of this and prompt)")),
        n=(int, Field(1, ge=1, le=limits.max_n)),
        max_tokens=(int, Field(16, ge=1, le=limits.max_new_tokens)),
        min_tokens=(int, Field(0, ge=0, le=limits.max_new_tokens,
                               description="no end-of-sequence before this many tokens")),
    )


class Choice(BaseModel):
    tokens: list[int] = Field(description="the response token ids exactly as sampled (never re-tokenized)")
    logprobs: list[float] = Field(description="behavior log-prob of each token, after temperature/top-p/top-k")
    versions: list[int] | None = Field(description="weights version of each token; only when an update "
                                       "happened during this request")
    finish_reason: str = Field(description="stop, length or abort")
    text: str = Field(description="the tokens decoded, for reading; train on the tokens")


class GenerateResponse(BaseModel):
    prompt_token_ids: list[int]
    choices: list[Choice]
    policy_version: int = Field(description="weights version when generation started")
    policy_version_end: int = Field(description="weights version when the last token was sampled")
    precision: str


class Problem(BaseModel):
    detail: str | list


ERRORS = {code: {"model": Problem, "description": why} for code, why in (
    (400, "body is not JSON"), (401, "missing or wrong bearer token"), (411, "no Content-Length"), (413, "body too large"),
    (422, "invalid request: detail names the field"), (503, "not ready, draining, or engine down"))}


def bad_request(field: str, msg: str) -> HTTPException:
    """A 422 in FastAPI's own error shape, naming the offending field."""
    return HTTPException(status_code=422, detail=[{"loc": ["body", field], "msg": msg, "type": "value_error"}])


def create_app(cfg: RunConfig, worker_id: str = "w0", address: str = "", redis_client=None) -> FastAPI:
    from rollout_service.engine import InvalidRequest, RolloutEngine
    from rollout_service.metrics import RolloutMetrics

    profile = profile_for(cfg.rollout.precision, quant=cfg.quant, model_path=cfg.model.path)
    engine = RolloutEngine(cfg.model.path, profile, cfg.rollout, seed=cfg.seed)
    metrics = RolloutMetrics(worker_id, profile.precision, cfg.run_id)
    limits = cfg.rollout

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
        app.state.loop = None
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
                                         app.state.tokenizer, metrics, on_fatal)
            app.state.loop.start()
        else:
            engine.synced = True  # standalone: the weights on disk are the policy
        app.state.ready = True
        log.info("worker %s ready at %s (%s)", worker_id, address, profile.precision)
        try:
            yield
        finally:
            app.state.ready = False
            if app.state.loop is not None:
                await app.state.loop.stop()
            engine.shutdown()

    app = FastAPI(title="rlpipe rollout worker", version="1", lifespan=lifespan)
    app.state.ready = False
    app.state.draining = False
    app.state.fatal = None
    app.state.engine = engine
    app.state.metrics = metrics

    def drain() -> None:
        """SIGTERM: stop taking prompts at once (the groups in flight finish at shutdown)."""
        log.info("worker %s draining: no new prompts", worker_id)
        app.state.draining = True
        if app.state.loop is not None:
            app.state.loop.stopping.set()

    app.state.drain = drain

    def ready() -> bool:
        return app.state.ready and not app.state.draining and engine.synced and not engine.errored

    metrics.ready.set_function(lambda: float(ready()))
    token = api_token()
    authorized = [require_token(token)]
    LimitedRequest = request_model(limits)

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
            "limits": {k: getattr(limits, k) for k in ("max_prompt_tokens", "max_n", "max_new_tokens",
                                                       "max_model_len", "max_body_bytes")},
            "draining": app.state.draining,
            "inflight_requests": engine.inflight,
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
            prompt_ids = tokenizer(req.prompt)["input_ids"]
            field = "prompt"
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
    app.post("/v1/generate", response_model=GenerateResponse, dependencies=authorized,
             responses={c: ERRORS[c] for c in (400, 401, 411, 413, 422, 503)})(generate)
    return app
