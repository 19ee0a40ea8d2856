"""The rollout worker's HTTP interface (FastAPI).

    GET  /healthz      process alive, engine not dead, rollout loop not stuck (open)
    GET  /readyz       engine up and holding weights of a known version, 503 otherwise (open)
    GET  /metrics      Prometheus (open)
    GET  /v1/status    version, precision profile, in-flight requests, queue lag (token)
    POST /v1/generate  token ids or text in; tokens, behavior log-probs, finish reasons,
                       policy versions out (token)
    POST /v1/sessions  open a token-exact multi-turn session (token); then
         /v1/sessions/{id}/turn    append a message, sample the model's turn
         /v1/sessions/{id}/finish  close it: the whole episode with its loss mask
    GET  /v1/models    OpenAI's model list: the one model served (token)
    POST /v1/chat/completions, /v1/completions  OpenAI's shape, stateless or continuing a
                       session named by X-Session-Id or the body's session_id (token)
    GET  /openapi.json the schema; /docs renders it

"token": with ``RLPIPE_API_TOKEN`` set these need ``Authorization: Bearer <token>``
(rlpipe/auth.py), checked from the header before any of the body is read (``gate``). Every
limit (prompt length, n, max_tokens, body size) comes from the ``rollout`` config section; a
request over one gets a 4xx naming the field, and so does any malformed request (NaN or an
infinity in a number, a lone surrogate in text): never a 5xx. The schema states the ranges
the engine really takes (vLLM's ``SamplingParams`` checks; rollout_service/api_models.py).
Generation through the API holds at most its share of the engine (``ApiShare``); beyond it a
request gets 429 with ``Retry-After``.

Each route is a few lines over the app's one ``Worker`` (rollout_service/worker.py), which
holds the engine and, with a Redis URL in the config, runs the rollout loop; without one it
only serves ``/v1/generate`` (a plain sampling server, as the tests use it). The probes and
``/v1/status`` ask the worker itself; the API's requests go to its ``api``
(rollout_service/api_requests.py).
"""

from __future__ import annotations

import json
import math
import time
import types
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from rlpipe.auth import api_token, bearer_carries, require_token, wrong_token
from rlpipe.config import RunConfig
from rollout_service import api_models as models
from rollout_service.api_models import GenerateRequest, GenerateResponse, request_model
from rollout_service.openai_api import ChatRequest, CompletionRequest, error_body, model_list
from rollout_service.worker import Worker


def json_safe(value, depth: int = 0):
    """``value`` as JSON can carry it. A 422 echoes the offending input, which may be NaN or
    an infinity (JSON has neither, and rendering them failed: a 500 and a reset connection)
    or text with a lone surrogate (UTF-8 has no encoding for it); those become their Python
    spelling ('nan', 'inf', '\\ud800'), and anything else not JSON (an exception in an
    error's context) its str(). Nesting below ``MAX_JSON_DEPTH`` is echoed as '...' (a body
    may nest as deep as the JSON parser goes, too deep to render)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, (dict, list, tuple)) and depth >= models.MAX_JSON_DEPTH:
        return "..."
    if isinstance(value, dict):
        return {json_safe(k): json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, depth + 1) for v in value]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return json_safe(str(value))


# What a body may hold, counted before it is parsed: the Python objects json.loads makes of a
# JSON array or object cost some 20 times its text (a 1 MiB request of small arrays in a
# message's extra keys or in tools took 50-200 MB; issue 33 item 16), and of any small value
# about 10 times. Text costs about its size whatever it holds.
MAX_JSON_CONTAINERS = 8192  # arrays and objects: messages, content parts, tools and their schemas
MAX_JSON_VALUES = 65536  # values besides a list of token ids (TextRequest: the longest a route takes)


def json_shape(body: bytes) -> tuple[int, int]:
    """``(arrays and objects, values)`` of a JSON text, counted outside its strings without
    parsing it (values: at most one more than its commas), in a few times its size and no
    Python object per value. Once escaped backslashes and quotes are taken out, each quote
    opens or closes a string."""
    text = np.frombuffer(body.replace(b"\\\\", b"").replace(b'\\"', b""), dtype=np.uint8)
    outside = ~np.bitwise_xor.accumulate(text == ord('"'))  # an opening quote up to its closing one: inside
    containers = np.count_nonzero(((text == ord("[")) | (text == ord("{"))) & outside)
    return int(containers), int(np.count_nonzero((text == ord(",")) & outside)) + 1


def parse_body(body: bytes, max_tokens: int):
    """A JSON body as Python, refused (413) before it is parsed when it holds more arrays and
    objects than ``MAX_JSON_CONTAINERS``, or more values than ``MAX_JSON_VALUES`` and a token
    list of ``max_tokens``: so a request costs a bounded multiple of ``rollout.max_body_bytes``.
    Bytes that are not UTF-8 decode to lone surrogates, which the text fields then refuse
    naming the field (plain ``json.loads`` of the bytes failed with a 400 that named nothing)."""
    values_allowed = MAX_JSON_VALUES + max_tokens
    containers, values = body.count(b"[") + body.count(b"{"), body.count(b",") + 1  # with those in strings
    if containers > MAX_JSON_CONTAINERS or values > values_allowed:
        containers, values = json_shape(body)  # without them
    if containers > MAX_JSON_CONTAINERS or values > values_allowed:
        raise HTTPException(413, f"body holds {containers} JSON arrays and objects and {values} values: at most "
                            f"{MAX_JSON_CONTAINERS} and {values_allowed} ({MAX_JSON_VALUES}, and {max_tokens} token "
                            "ids)")
    return json.loads(body.decode("utf-8-sig", "surrogateescape"))


class TextRequest(Request):
    """A request whose JSON body is read by ``parse_body``, its token ids within the longest
    list a route takes (``rollout.max_prompt_tokens``, or the model length in a session)."""

    async def json(self):
        if not hasattr(self, "_json"):
            limits = self.app.state.worker.limits
            self._json = parse_body(await self.body(), max(limits.max_model_len, limits.max_prompt_tokens))
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
    (404, "no such session: detail says whether it expired (rollout.session_idle_timeout_s) or never existed"),
    (409, "the session's state refuses it: detail starts with the limit's config key (rollout.session_max_turns, "
          "rollout.session_max_tokens, rollout.session_max_bytes), or says a request on it is running"),
    (422, "invalid request: detail names the field"),
    (429, "the API's share of the engine is busy, or rollout.max_sessions are open: retry after Retry-After seconds"),
    (503, "not ready, draining, or engine down"))}


async def the_worker(request: Request) -> Worker:
    """The app's worker (a dependency of every route)."""
    return request.app.state.worker


TheWorker = Annotated[Worker, Depends(the_worker)]
probes = APIRouter()  # open: probes and Prometheus need no secret
api = APIRouter(route_class=TextRoute)  # the token's, when there is one (create_app)
SessionHeader = Annotated[str | None, Header(alias="X-Session-Id", description="continue this session")]
SESSION_ERRORS = {c: ERRORS[c] for c in (400, 401, 404, 409, 411, 413, 422, 429, 503)}


@probes.get("/healthz", responses={503: ERRORS[503]})
async def healthz(worker: TheWorker):
    """The process is alive and its engine has not died."""
    health = worker.health()
    return health if health["status"] == "ok" else JSONResponse(health, status_code=503)


@probes.get("/readyz", responses={503: ERRORS[503]})
async def readyz(worker: TheWorker):
    """Ready to serve: engine up, weights of a known version, not draining."""
    readiness = worker.readiness()
    return readiness if readiness["ready"] else JSONResponse(readiness, status_code=503)


@probes.get("/metrics", response_class=Response)
async def prometheus(worker: TheWorker):
    """Prometheus text format."""
    return Response(worker.prometheus(), media_type=CONTENT_TYPE_LATEST)


@api.get("/v1/status", responses={401: ERRORS[401]})
async def status(worker: TheWorker):
    """Version, precision profile, in-flight work and how far the stream is ahead."""
    return worker.status()


@api.post("/v1/sessions", response_model=models.SessionOpened, responses=SESSION_ERRORS)
async def open_session(req: models.OpenSession, worker: TheWorker):
    """Open a multi-turn session on a prompt: chat messages (rendered with the chat template),
    text or token ids. Its ids are kept exactly from here on (rollout_service/sessions.py)."""
    return await worker.api.open_session(req)


@api.post("/v1/sessions/{session_id}/turn", response_model=models.TurnResult, responses=SESSION_ERRORS)
async def session_turn(session_id: str, req: models.Turn, worker: TheWorker):
    """Append a non-model message (tokenized once, now), then sample the model's next turn on
    every id so far; answers the turn's ids, behavior log-probs and versions."""
    return await worker.api.session_turn(session_id, req)


@api.post("/v1/sessions/{session_id}/finish", response_model=models.Episode, responses=SESSION_ERRORS)
async def finish_session(session_id: str, worker: TheWorker, req: models.Finish | None = None):
    """Close the session with a reward (or none: the caller scores it); answers the episode:
    ids, loss mask, behavior log-probs and versions per token."""
    return worker.api.finish_session(session_id, req or models.Finish())


@api.post("/v1/chat/completions", responses=SESSION_ERRORS)
async def chat_completions(req: ChatRequest, worker: TheWorker, x_session_id: SessionHeader = None):
    """OpenAI's chat completion; with a session id, the session's next turn."""
    return await worker.api.chat_completion(req, x_session_id)


@api.get("/v1/models", responses={401: ERRORS[401]})
async def models_list(request: Request):
    """OpenAI's model list: the one model this worker serves (what a client's ``model`` may name)."""
    return model_list(*request.app.state.model)


@api.post("/v1/completions", responses=SESSION_ERRORS)
async def completions(req: CompletionRequest, worker: TheWorker, x_session_id: SessionHeader = None):
    """OpenAI's text completion; with a session id, a plain session's next turn."""
    return await worker.api.completion(req, x_session_id)


async def generate(req: GenerateRequest, worker: TheWorker):
    """Sample ``n`` responses to one prompt (token ids, or text the worker tokenizes).

    For multi-turn use, send the whole conversation as ``prompt_token_ids`` built from
    earlier responses' ``tokens``: re-tokenizing their text can give other ids."""
    return await worker.api.generate(req)


def with_body(endpoint, model: type[BaseModel]):
    """A copy of ``endpoint`` taking its ``req`` as ``model``. FastAPI reads a body's model from
    the endpoint's annotations, and ``/v1/generate``'s states this worker's limits
    (``request_model``), known only with its config: so each app registers its own copy."""
    route = types.FunctionType(endpoint.__code__, endpoint.__globals__, endpoint.__name__, endpoint.__defaults__,
                               endpoint.__closure__)
    route.__annotations__ = {**endpoint.__annotations__, "req": model}  # a class, not a string: FastAPI reads it as is
    route.__doc__, route.__qualname__ = endpoint.__doc__, endpoint.__qualname__
    return route


async def invalid_request(request: Request, exc: RequestValidationError):
    """FastAPI's own 422, rendered so that no input can break it (``json_safe``); a body that is
    not JSON at all is a 400, as ``ERRORS`` and the README say (FastAPI answers it 422)."""
    errors = exc.errors()
    unreadable = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if unreadable is not None:
        why = (unreadable.get("ctx") or {}).get("error", "JSON decode error")
        return refusal(request, 400, json_safe(f"body is not JSON: {why} at character {unreadable['loc'][-1]}"))
    return refusal(request, 422, json_safe(errors))


def refusal(request: Request, status: int, detail, headers: dict | None = None) -> JSONResponse:
    """Every error answer: ``detail``, and OpenAI's error object on OpenAI's routes (openai_api.error_body)."""
    return JSONResponse(error_body(request.url.path, status, detail), status_code=status, headers=headers)


async def http_error(request: Request, exc: StarletteHTTPException):
    """A raised HTTPException (a 4xx naming its field, a 404 session), answered as :func:`refusal` does."""
    return refusal(request, exc.status_code, json_safe(exc.detail), getattr(exc, "headers", None))


TOKEN_ROUTES = "/v1/"  # every route under it needs the token (``api`` and /v1/generate); probes and docs do not


def refused_from_header(request: Request) -> JSONResponse | None:
    """What the header alone refuses: 401 without the bearer token on a token route, 411 without
    a Content-Length, 413 over ``rollout.max_body_bytes``; None to read on."""
    state = request.app.state
    if request.url.path.startswith(TOKEN_ROUTES) and not bearer_carries(request.headers.get("authorization"),
                                                                         state.api_token):
        refused = wrong_token()
        return refusal(request, 401, refused.detail, refused.headers)
    max_body_bytes = state.worker.limits.max_body_bytes
    length = request.headers.get("content-length")
    if request.method in ("POST", "PUT", "PATCH") and length is None:
        return refusal(request, 411, "Content-Length required")
    if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
        return refusal(request, 413, f"body larger than {max_body_bytes} bytes")
    return None


async def gate(request: Request, call_next):
    """Every request passes here before any of its body is read (``refused_from_header``): the
    token is checked from the header, so a client without it cannot hold a connection by
    trickling a body (FastAPI reads the body before its dependencies run, ``require_token``
    among them). Every refusal is counted."""
    metrics = request.app.state.worker.metrics
    response = refused_from_header(request) or await call_next(request)
    if response.status_code >= 400:
        metrics.requests_rejected.labels(**metrics.labels, code=str(response.status_code)).inc()
    return response


@asynccontextmanager
async def lifespan(app: FastAPI):
    """The worker starts before the app serves and stops after it has."""
    worker = app.state.worker
    await worker.start()
    try:
        yield
    finally:
        await worker.stop()


def create_app(cfg: RunConfig, worker_id: str = "w0", address: str = "", redis_client=None) -> FastAPI:
    """The routes above over a new ``Worker`` (its engine is built, not started: ``lifespan`` starts it)."""
    worker = Worker(cfg, worker_id, address, redis_client)
    app = FastAPI(title="rlpipe rollout worker", version="1", lifespan=lifespan)
    app.state.worker = worker
    app.state.model = (Path(str(cfg.model.path or "toy")).name, int(time.time()))  # GET /v1/models: id, created
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.state.api_token = api_token()
    app.middleware("http")(gate)
    authorized = [require_token(app.state.api_token)]
    app.include_router(probes)
    app.include_router(api, dependencies=authorized)
    app.router.add_api_route("/v1/generate", with_body(generate, request_model(cfg.rollout, worker.api_share.capacity)),
                             methods=["POST"], response_model=GenerateResponse, dependencies=authorized,
                             route_class_override=TextRoute,
                             responses={c: ERRORS[c] for c in (400, 401, 411, 413, 422, 429, 503)})
    return app
