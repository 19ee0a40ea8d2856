"""The rollout worker's HTTP interface (FastAPI).

    GET  /healthz      process alive
    GET  /readyz       engine up and holding weights of a known version (503 otherwise)
    GET  /metrics      Prometheus
    GET  /v1/status    version, precision, in-flight groups
    POST /v1/generate  token ids or text in; tokens, behavior log-probs, finish reasons out

With a Redis URL in the config the app also runs the rollout loop (a *worker*); without
one it only serves ``/v1/generate`` (a plain sampling server, as the tests use it).
"""

from __future__ import annotations

import logging
import os
import signal
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from quant.profiles import profile_for
from rlpipe.config import RunConfig

log = logging.getLogger(__name__)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[int] | None = Field(None, description="prompt as token ids (exactly one of this and prompt)")
    prompt: str | None = Field(None, description="prompt as text, tokenized by the worker")
    temperature: float = Field(1.0, ge=0, le=100, description="0 = greedy")
    n: int = Field(1, ge=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
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


class Choice(BaseModel):
    tokens: list[int]
    logprobs: list[float]
    versions: list[int] | None
    finish_reason: str
    text: str


class GenerateResponse(BaseModel):
    prompt_token_ids: list[int]
    choices: list[Choice]
    policy_version: int
    policy_version_end: int
    precision: str


def bad_request(field: str, msg: str) -> HTTPException:
    """A 422 in FastAPI's own error shape, naming the offending field."""
    return HTTPException(status_code=422, detail=[{"loc": ["body", field], "msg": msg, "type": "value_error"}])


def create_app(cfg: RunConfig, worker_id: str = "w0", address: str = "") -> FastAPI:
    from rollout_service.engine import InvalidRequest, RolloutEngine
    from rollout_service.metrics import RolloutMetrics

    profile = profile_for(cfg.rollout.precision)
    engine = RolloutEngine(cfg.model.path, profile, cfg.rollout, seed=cfg.seed)
    metrics = RolloutMetrics(worker_id, profile.precision)
    limits = cfg.rollout

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from transformers import AutoTokenizer

        app.state.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
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

            queue = TrajectoryQueue(connect(cfg.redis_url), cfg.run_id)
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
    app.state.fatal = None
    app.state.engine = engine
    app.state.metrics = metrics

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limits.max_body_bytes):
            return JSONResponse({"detail": f"body larger than {limits.max_body_bytes} bytes"}, status_code=413)
        return await call_next(request)

    @app.get("/healthz")
    async def healthz():
        if engine.errored:
            return JSONResponse({"status": "engine dead", "worker_id": worker_id}, status_code=503)
        return {"status": "ok", "worker_id": worker_id}

    @app.get("/readyz")
    async def readyz():
        if not app.state.ready or not engine.synced or engine.errored:
            return JSONResponse({"ready": False, "version": engine.version}, status_code=503)
        return {"ready": True, "version": engine.version}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/status")
    async def status():
        loop = app.state.loop
        return {
            "worker_id": worker_id,
            "version": engine.version,
            "synced": engine.synced,
            "precision": profile.precision,
            "quant_profile": profile.quant_hash,
            "inflight_requests": engine.inflight,
            "inflight_groups": len(loop.groups) if loop else 0,
            "sync_generation": loop.generation if loop else 0,
            "paused_seconds_total": engine.paused_seconds_total,
            # updates after which running requests kept the prefix cache from being reset
            "prefix_cache_reset_failures": engine.prefix_cache_reset_failures,
            "last_error": loop.last_error if loop else None,
        }

    @app.post("/v1/generate", response_model=GenerateResponse)
    async def generate(req: GenerateRequest):
        if not app.state.ready:
            raise HTTPException(503, "engine not ready")
        tokenizer = app.state.tokenizer
        if req.prompt is not None:
            prompt_ids = tokenizer(req.prompt)["input_ids"]
            field = "prompt"
        else:
            prompt_ids, field = req.prompt_token_ids, "prompt_token_ids"
        if not prompt_ids:
            raise bad_request(field, "empty prompt")
        if len(prompt_ids) > limits.max_prompt_tokens:
            raise bad_request(field, f"{len(prompt_ids)} tokens exceeds the limit of {limits.max_prompt_tokens}")
        vocab = len(tokenizer)
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise bad_request(field, f"token ids must be in [0, {vocab})")
        if req.n > limits.max_n:
            raise bad_request("n", f"{req.n} exceeds the limit of {limits.max_n}")
        if req.max_tokens > limits.max_new_tokens:
            raise bad_request("max_tokens", f"{req.max_tokens} exceeds the limit of {limits.max_new_tokens}")
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

    return app
