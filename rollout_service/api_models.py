"""What ``/v1/generate`` and ``/v1/sessions`` take and give (rollout_service/app.py serves them;
the OpenAI-shaped routes' models are in rollout_service/openai_api.py).

The schema states the ranges the engine really takes (vLLM's ``SamplingParams`` checks),
narrowed to this worker's configured limits (``request_model``); a request outside them
gets a 422 naming the field.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from fastapi import HTTPException
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, create_model, field_validator,
                      model_validator)


def _integral(value):
    """JSON Schema's ``integer`` includes ``19.0``: take it as 19 (strict mode alone would
    refuse what the schema allows). ``19.5``, NaN and the infinities stay refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _unicode(text: str) -> str:
    """JSON's ``"\\ud800"`` decodes to a lone surrogate, which is no character (the tokenizer
    raised TypeError on it: a 500), and so do bytes that are not UTF-8 (``TextRoute``).
    Refused here, naming the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid UTF-8 text: a lone surrogate or undecodable byte at character {e.start}") from None
    return text


MAX_JSON_DEPTH = 32  # the nesting a free-form field (reward_info, tools, a message's extra keys) may have


def _json(value):
    """A free-form JSON value the worker keeps, renders or sends back (``reward_info``, ``tools``,
    a message's extra keys), checked as the typed fields are: its text valid UTF-8 (keys too),
    its numbers finite, and nested at most ``MAX_JSON_DEPTH`` deep. A lone surrogate or NaN in
    one, or 300 levels of it, failed only when the answer was rendered: a 500, and a finish
    that lost its session (issue 33 item 16)."""
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
            for key in node if isinstance(node, dict) else ():
                _unicode(key)
            stack += [(child, depth + 1) for child in (node.values() if isinstance(node, dict) else node)]
        elif isinstance(node, str):
            _unicode(node)
        elif isinstance(node, float) and not math.isfinite(node):
            raise ValueError("NaN or an infinity (JSON has neither)")
    return value


Int = Annotated[int, BeforeValidator(_integral)]
Text = Annotated[str, AfterValidator(_unicode)]
Json = Annotated[Any, AfterValidator(_json)]
JsonObject = Annotated[dict, AfterValidator(_json)]
Float = Annotated[float, Field(allow_inf_nan=False)]
MIN_TEMPERATURE = 0.01  # vLLM raises any temperature in (0, 0.01) to 0.01 (SamplingParams._MAX_TEMP)


class Sampling(BaseModel):
    """The sampling parameters /v1/generate, session turns and the OpenAI routes share, so each
    is checked one way. Ranges are vLLM's own (SamplingParams._verify_args), so the engine never
    refuses what the schema allows."""

    # strict: the types the schema states, no coercion (lax mode would take `true` as 1).
    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: Float = Field(1.0, ge=0, le=2, description="0 = greedy; else at least 0.01 (vLLM would raise "
                               "a lower one to 0.01, and the log-probs would not be of the temperature asked for)",
                               json_schema_extra={"not": {"exclusiveMinimum": 0, "exclusiveMaximum": MIN_TEMPERATURE}})
    top_p: Float = Field(1.0, gt=0, le=1)
    top_k: Int = Field(-1, ge=-1, le=2**31 - 1, description="-1 or 0: off")
    max_tokens: Int = Field(16, ge=1)
    min_tokens: Int = Field(0, ge=0, description="no end-of-sequence before this many tokens; at most max_tokens")
    seed: Int | None = Field(None, ge=0, lt=2**31)
    stop: list[Annotated[Text, Field(min_length=1)]] | None = Field(None, max_length=16)

    @field_validator("temperature")
    @classmethod
    def _no_silent_clamp(cls, t):
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}: vLLM would sample at "
                             f"{MIN_TEMPERATURE} instead")
        return t

    @field_validator("min_tokens")
    @classmethod
    def _min_within_max(cls, min_tokens, info):
        if info.data.get("max_tokens") is not None and min_tokens > info.data["max_tokens"]:
            raise ValueError(f"must not exceed max_tokens ({info.data['max_tokens']})")
        return min_tokens

    def sampling(self, max_tokens: int | None = None) -> dict:
        """The engine's keyword arguments (``RolloutEngine.generate``); ``max_tokens`` overrides."""
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                    max_tokens=max_tokens or self.max_tokens, min_tokens=self.min_tokens, seed=self.seed,
                    stop=self.stop)


class GenerateRequest(Sampling):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "oneOf": [{"required": ["prompt"]}, {"required": ["prompt_token_ids"]}]})

    # Typed without None so the schema says what the service accepts; absent = None.
    # request_model() narrows n, max_tokens and min_tokens further.
    prompt_token_ids: list[Int] = Field(None, description="prompt as token ids (exactly one of this and prompt)")
    prompt: Text = Field(None, description="prompt as text, tokenized by the worker")
    n: Int = Field(1, ge=1)

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


def request_model(limits, api_sequences: int) -> type[GenerateRequest]:
    """``GenerateRequest`` with this worker's configured limits in its schema, so the
    served OpenAPI document states them: ``n`` within ``max_n`` and the sequences the API
    may hold at all (``ApiShare``), ``max_tokens`` within ``max_new_tokens`` and the model
    length (vLLM refuses a prompt that leaves no room for one token). (Rules that span
    fields, such as prompt plus max_tokens within the model length, are checked in the
    handler.)"""
    max_tokens = min(limits.max_new_tokens, limits.max_model_len - 1)
    return create_model(
        "GenerateRequest", __base__=GenerateRequest,
        prompt_token_ids=(list[Annotated[Int, Field(ge=0, lt=2**31)]], Field(
            None, min_length=1, max_length=limits.max_prompt_tokens,
            description="prompt as token ids (exactly one of this and prompt)")),
        n=(Int, Field(1, ge=1, le=max(1, min(limits.max_n, api_sequences)))),
        max_tokens=(Int, Field(16, ge=1, le=max_tokens)),
        min_tokens=(Int, Field(0, ge=0, le=max_tokens,
                               description="no end-of-sequence before this many tokens; at most max_tokens")),
    )


class Choice(BaseModel):
    tokens: list[int] = Field(description="the response token ids exactly as sampled (never re-tokenized)")
    logprobs: list[float] = Field(description="behavior log-prob of each token, after temperature/top-p/top-k")
    versions: list[int] | None = Field(description="weights version of each token; only when an update "
                                       "happened during this request")
    finish_reason: str = Field(description="stop, length or abort")
    text: str = Field(description="the tokens decoded, for reading; train on the tokens")
    cached_tokens: int = Field(0, description="prompt tokens read from the prefix cache instead of forwarded "
                               "(only KV of the weights this request started on)")


class GenerateResponse(BaseModel):
    prompt_token_ids: list[int]
    choices: list[Choice]
    policy_version: int = Field(description="weights version when generation started")
    policy_version_end: int = Field(description="weights version when the last token was sampled")
    precision: str


def bad_request(field: str, msg: str) -> HTTPException:
    """A 422 in FastAPI's own error shape, naming the offending field."""
    return HTTPException(status_code=422, detail=[{"loc": ["body", field], "msg": msg, "type": "value_error"}])


def max_tokens_within(asked: int | None, min_tokens: int, limit: int, room: int, room_in: str,
                      field: str = "max_tokens") -> int:
    """The ``max_tokens`` a request samples with, by the one rule every route keeps (docs/rollout.md,
    "The API"): one the request asks for is taken as it is or refused, never changed.
    Above ``rollout.max_new_tokens`` (``limit``) or the ``room`` the prompt leaves (``room_in``
    says where), a 422 names ``field``; absent, ``limit`` cut to the room. /v1/chat/completions
    cut 10**12 to the 2 tokens left and answered 200 while /v1/generate refused it (issue 33
    item 6). ``min_tokens`` above the result is a 422 naming it (the engine's refusal named
    only "sampling")."""
    if asked is not None and asked > limit:
        raise bad_request(field, f"{asked} exceeds rollout.max_new_tokens ({limit})")
    if asked is not None and asked > room:
        raise bad_request(field, f"{asked} exceeds the {room} tokens left {room_in}")
    max_tokens = min(limit, room) if asked is None else asked
    if min_tokens > max_tokens:
        given = "" if asked is not None else ", none given: rollout.max_new_tokens cut to the room left"
        raise bad_request("min_tokens", f"must not exceed max_tokens ({max_tokens}{given})")
    return max_tokens



class ContentPart(BaseModel):
    """An OpenAI content part: text only, as the model reads only text. Its ``text`` must be a
    string: a number was rendered as its Python repr, an image part silently dropped. Other
    keys (``cache_control``...) are dropped: only the text is read."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"] = "text"
    text: Text


class Message(BaseModel):
    """A chat message as the chat template reads it (OpenAI's shape: ``tool_call_id``, ``name``,
    ``tool_calls`` and other keys pass through to the template, each a checked ``Json`` value)."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, Json] = Field(init=False)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[ContentPart] | None = Field(None, description="text, or OpenAI text content parts "
                                                     "(their 'text' joined)")

    def for_template(self) -> dict:
        """The message as a dict, its content as one string (templates expect text)."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "".join(part.text for part in self.content)
        out.setdefault("content", "")
        return out


class OpenSession(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    messages: list[Message] | None = Field(None, min_length=1, description="a chat prompt, rendered with the "
                                           "chat template (without its generation prompt: the first turn adds it)")
    tools: list[JsonObject] | None = Field(None, description="tool definitions (OpenAI's shape) the template "
                                           "renders")
    prompt: Text | None = Field(None, min_length=1, description="a plain-text prompt (no template)")
    prompt_token_ids: list[Annotated[Int, Field(ge=0)]] | None = Field(None, min_length=1,
                                                                       description="a prompt as token ids")

    @model_validator(mode="after")
    def _one_prompt(self):
        if sum(x is not None for x in (self.messages, self.prompt, self.prompt_token_ids)) != 1:
            raise ValueError("give exactly one of 'messages', 'prompt' and 'prompt_token_ids'")
        if self.tools is not None and self.messages is None:
            raise ValueError("'tools' need a chat session ('messages')")
        return self


class SessionOpened(BaseModel):
    session_id: str
    prompt_token_ids: list[int] = Field(description="the prompt's ids, as every turn's generation sees them first")


class Turn(Sampling):
    """A session turn: optionally append context (a chat ``message`` in a chat session; ``text``
    or ``token_ids`` in a plain one), then sample the model's turn on every id so far."""

    message: Message | None = Field(None, description="chat sessions: a tool result, user turn... to append first")
    text: Text | None = Field(None, min_length=1, description="plain sessions: text to append first")
    token_ids: list[Annotated[Int, Field(ge=0)]] | None = Field(None, min_length=1,
                                                                description="plain sessions: ids to append first")
    max_tokens: Int | None = Field(None, ge=1, description="at most rollout.max_new_tokens and the room "
                                   "rollout.session_max_tokens leaves (more: 422); absent, rollout.max_new_tokens "
                                   "cut to that room")

    @model_validator(mode="after")
    def _one_context(self):
        if sum(x is not None for x in (self.message, self.text, self.token_ids)) > 1:
            raise ValueError("give at most one of 'message', 'text' and 'token_ids'")
        return self


class TurnResult(BaseModel):
    session_id: str
    turn: int = Field(description="this turn's number, from 1")
    text: str = Field(description="the turn decoded, for reading; train on the ids")
    token_ids: list[int] = Field(description="the turn exactly as sampled")
    logprobs: list[float] = Field(description="behavior log-prob of each of the turn's tokens")
    versions: list[int] = Field(description="weights version each token was sampled with")
    finish_reason: str
    context_token_ids: list[int] = Field(description="ids appended before the turn (message, template markers, "
                                         "the previous turn's closing tokens): context, mask 0")
    total_tokens: int = Field(description="ids the session holds now")
    policy_version: int
    policy_version_end: int
    cached_tokens: int = Field(0, description="ids read from the prefix cache instead of forwarded: the "
                               "session's earlier turns, kept under the weights its first turn started on")


class Finish(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    reward: Float | None = Field(None, description="the episode's reward; none: the caller scores the episode")
    reward_info: JsonObject | None = Field(None, description="anything JSON, sent back with the episode (at most "
                                           f"{MAX_JSON_DEPTH} levels deep)")


class Episode(BaseModel):
    """A whole episode, token-exact: what a trajectory record's sample is made from."""

    session_id: str
    token_ids: list[int] = Field(description="prompt, context and model turns, exactly as held")
    mask: list[int] = Field(description="per token: 1 = sampled by the model (trains), 0 = prompt or context")
    logprobs: list[float] = Field(description="per token: behavior log-prob for model tokens, 0 for context")
    versions: list[int] = Field(description="per token: the weights version a model token was sampled with; a "
                                "context token carries the version in force when it was appended")
    prompt_length: int
    turns: int
    finish_reasons: list[str] = Field(description="each model turn's")
    policy_version: int = Field(description="the oldest version among the model's tokens (staleness counts it)")
    policy_version_end: int
    reward: float | None
    reward_info: dict | None
