"""OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions`` over the worker.

An agent framework that speaks OpenAI drives a token-exact episode unmodified: it opens a
session (``POST /v1/sessions``), then sends its usual requests with the session id in the
``X-Session-Id`` header or in the body (the ``openai`` client's ``extra_body={"session_id":
...}``). Each request carries the whole conversation, as OpenAI clients do; the session
appends only the messages beyond those it holds (tokenized once, rollout_service/sessions.py)
and ignores the client's copies of earlier ones, its own ids being the truth. The model's
turn is sampled on the session's ids and kept.

Without a session id these routes are a plain, stateless OpenAI-compatible server.

Answers have OpenAI's shape plus extension fields: ``prompt_token_ids`` and ``session_id`` at
the top, and per choice the turn's ``token_ids``, ``behavior_logprobs`` and ``versions``.
Unknown request keys are ignored (clients send many); ``stream`` and ``n`` > 1 within a session
are refused, naming the field. ``GET /v1/models`` lists the one model, which many clients ask
first, and an error on these routes has OpenAI's ``{"error": {message, type, param, code}}``
beside rlpipe's own ``detail`` (:func:`error_body`).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated

from fastapi import HTTPException
from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from rollout_service.api_models import Int, JsonObject, Message, Sampling, Text, bad_request

SESSION_HEADER = "X-Session-Id"
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


def error_body(path: str, status: int, detail) -> dict:
    """The JSON of an error answer: ``{"detail": ...}`` (FastAPI's, which rlpipe's clients read) and, on
    OpenAI's routes, OpenAI's ``error`` object too, so an OpenAI client shows the message and the field."""
    body = {"detail": detail}
    if not path.startswith(OPENAI_PATHS):
        return body
    param = None
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):  # validation errors: loc, msg
        loc = [str(x) for x in detail[0].get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        message = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body')}: {e.get('msg', '')}"
                            for e in detail if isinstance(e, dict))
    else:
        message = str(detail)
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {**body, "error": {"message": message, "type": kind, "param": param, "code": None}}


def model_list(model_id: str, created: int) -> dict:
    """``GET /v1/models``: the worker's one model, as OpenAI lists models."""
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "rlpipe"}]}


StopText = Annotated[Text, Field(min_length=1)]


class OpenAIRequest(Sampling):
    """What the two routes share; ``max_tokens`` (or ``max_completion_tokens``) defaults to
    ``rollout.max_new_tokens``, cut to the room the model length leaves; one given beyond
    either is refused (``api_models.max_tokens_within``)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: Text = Field("", description="echoed back; the worker serves its one model")
    n: Int = Field(1, ge=1)
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens")
    stop: StopText | Annotated[list[StopText], Field(max_length=16)] | None = Field(
        None, description="a string or up to 16 (OpenAI's shape)")
    stream: bool = Field(False, description="not supported: must be false")
    logprobs: bool | Int | None = Field(None, description="also answer OpenAI's logprobs (the sampled tokens' "
                                        "only; no alternatives)")
    session_id: Text | None = Field(None, description="a session to continue (or the X-Session-Id header)")
    _max_tokens_field: str = PrivateAttr("max_tokens")  # the name the client gave it, for a refusal to name

    @field_validator("stop")
    @classmethod
    def _listed(cls, stop):
        """OpenAI's ``stop`` may be one string; the engine takes a list."""
        return [stop] if isinstance(stop, str) else stop

    @model_validator(mode="after")
    def _supported(self):
        if self.stream:
            raise ValueError("stream: streaming is not supported; send stream=false")
        if self.n > 1 and self.temperature == 0:
            raise ValueError("n: greedy sampling (temperature 0) gives one distinct sample: n must be 1")
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self._max_tokens_field = "max_completion_tokens"
        self.max_tokens = self.max_tokens or self.max_completion_tokens
        return self

    @property
    def max_tokens_field(self) -> str:
        return self._max_tokens_field


class ChatRequest(OpenAIRequest):
    messages: list[Message] = Field(min_length=1)
    tools: list[JsonObject] | None = None


class CompletionRequest(OpenAIRequest):
    prompt: Text | list[Annotated[Int, Field(ge=0)]] = Field(description="text or token ids; in a session, "
                                                             "what to append before the model's turn")


def session_of(req: OpenAIRequest, header: str | None) -> str | None:
    if header and req.session_id and header != req.session_id:
        raise bad_request("session_id", f"differs from the {SESSION_HEADER} header")
    return header or req.session_id


def logprobs_content(tokenizer, tokens: list[int], logprobs: list[float]) -> dict:
    """OpenAI's ``logprobs`` object for a choice (no alternatives: ``top_logprobs`` empty)."""
    pieces = tokenizer.convert_ids_to_tokens(tokens)
    return {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode("utf-8", "replace")), "top_logprobs": []}
                        for p, lp in zip(pieces, logprobs)]}


def choice(tokenizer, index: int, chat: bool, text: str, tokens: list[int], logprobs: list[float],
           versions: list[int], finish_reason: str, want_logprobs: bool) -> dict:
    """One OpenAI choice plus the extension fields that make it trainable."""
    body = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    return {"index": index, **body, "finish_reason": finish_reason,
            "logprobs": logprobs_content(tokenizer, tokens, logprobs) if want_logprobs else None,
            "token_ids": tokens, "behavior_logprobs": logprobs, "versions": versions}


def response(req: OpenAIRequest, chat: bool, prompt_ids: list[int], choices: list[dict], session_id: str | None,
             v0: int, v1: int) -> dict:
    """OpenAI's response object around ``choices``."""
    completion = sum(len(c["token_ids"]) for c in choices)
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": req.model, "choices": choices,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
                      "total_tokens": len(prompt_ids) + completion},
            "session_id": session_id, "prompt_token_ids": prompt_ids, "policy_version": v0, "policy_version_end": v1}


def new_messages(session, req: ChatRequest) -> list[dict]:
    """The request's messages beyond those the session holds (the client's copies of the held
    ones are not read: the session's ids are the truth), after checking their roles line up."""
    held = session.messages
    if held is None:
        raise bad_request("messages", "a plain session (opened with a prompt): use /v1/completions")
    sent = [m.for_template() for m in req.messages]
    if len(sent) < len(held) or any(a["role"] != b["role"] for a, b in zip(sent, held)):
        raise HTTPException(409, f"messages: the session holds {len(held)} messages (roles "
                            f"{[m['role'] for m in held]}); send the whole conversation, then the new ones")
    if req.tools is not None and req.tools != session.tools:
        raise HTTPException(409, "tools: differ from the session's (the template renders them in its prompt)")
    return sent[len(held):]
