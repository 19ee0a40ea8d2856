"""What ``/v1/generate`` takes and gives (rollout_service/app.py serves it).

The schema states the ranges the engine really takes (vLLM's ``SamplingParams`` checks),
narrowed to this worker's configured limits (``request_model``); a request outside them
gets a 422 naming the field.
"""

from __future__ import annotations

from typing import Annotated

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


Int = Annotated[int, BeforeValidator(_integral)]
Text = Annotated[str, AfterValidator(_unicode)]
Float = Annotated[float, Field(allow_inf_nan=False)]
MIN_TEMPERATURE = 0.01  # vLLM raises any temperature in (0, 0.01) to 0.01 (SamplingParams._MAX_TEMP)


class GenerateRequest(BaseModel):
    # strict: the types the schema states, no coercion (lax mode would take `true` as 1).
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "oneOf": [{"required": ["prompt"]}, {"required": ["prompt_token_ids"]}]})

    # Typed without None so the schema says what the service accepts; absent = None.
    # The ranges are vLLM's own (SamplingParams._verify_args), so the engine never refuses
    # what the schema allows; request_model() narrows n, max_tokens and min_tokens further.
    prompt_token_ids: list[Int] = Field(None, description="prompt as token ids (exactly one of this and prompt)")
    prompt: Text = Field(None, description="prompt as text, tokenized by the worker")
    temperature: Float = Field(1.0, ge=0, le=2, description="0 = greedy; else at least 0.01 (vLLM would raise "
                               "a lower one to 0.01, and the log-probs would not be of the temperature asked for)",
                               json_schema_extra={"not": {"exclusiveMinimum": 0, "exclusiveMaximum": MIN_TEMPERATURE}})
    n: Int = Field(1, ge=1)
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

    @field_validator("min_tokens")
    @classmethod
    def _min_within_max(cls, min_tokens, info):
        if "max_tokens" in info.data and min_tokens > info.data["max_tokens"]:
            raise ValueError(f"must not exceed max_tokens ({info.data['max_tokens']})")
        return min_tokens


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


class GenerateResponse(BaseModel):
    prompt_token_ids: list[int]
    choices: list[Choice]
    policy_version: int = Field(description="weights version when generation started")
    policy_version_end: int = Field(description="weights version when the last token was sampled")
    precision: str


def bad_request(field: str, msg: str) -> HTTPException:
    """A 422 in FastAPI's own error shape, naming the offending field."""
    return HTTPException(status_code=422, detail=[{"loc": ["body", field], "msg": msg, "type": "value_error"}])

