"""What the worker's API requests get: ``/v1/generate``, the sessions' routes and the
OpenAI-shaped ones (rollout_service/app.py's routes call :class:`ApiRequests` as ``worker.api``).

Each request is checked against the limits (422 naming the field), its text tokenized off the
event loop, and sampled through :meth:`ApiRequests.sample`, the one way API requests reach the
engine, within the API's share of it (rollout_service.worker.ApiShare: 429 beyond).

The Worker (rollout_service/worker.py) was one 340-line class doing two jobs: running the
worker (start-up, SIGTERM's drain, shutdown, the probes and ``/v1/status``) and answering the
API's requests. The second is here, over the worker's state, which it reads at each request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import HTTPException

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
    from rollout_service.worker import Worker


class ApiRequests:
    """The API's requests over one worker: its engine, limits, tokenizer and sessions (the
    last two exist from ``Worker.start``)."""

    def __init__(self, worker: Worker):
        self.worker = worker

    @property
    def limits(self):
        return self.worker.limits

    @property
    def tokenizer(self):
        return self.worker.tokenizer

    @property
    def sessions(self):
        return self.worker.sessions

    def check_ready(self) -> None:
        """503 before the worker has started, and once its engine has died."""
        if not self.worker.started or self.worker.engine.errored:
            raise HTTPException(503, "engine not ready")

    async def sample(self, prompt_ids: list[int], n: int, sampling: dict):
        """The one way API requests reach the engine (``/v1/generate``, sessions, the OpenAI
        routes): within the API's share of it (``ApiShare``: 429 beyond), an engine refusal as a
        422 naming the field. Returns ``(samples, version_at_start, version_at_end)``."""
        from rollout_service.engine import InvalidRequest

        self.check_ready()
        try:
            with self.worker.api_share.hold(n):
                return await self.worker.engine.generate(prompt_ids, n=n, **sampling)
        except InvalidRequest as e:
            raise bad_request(e.field, str(e)) from None

    async def sample_one(self, prompt_ids: list[int], sampling: dict):
        results, v0, v1 = await self.sample(prompt_ids, 1, sampling)
        return results[0], v0, v1

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        """``req``'s ``n`` samples, within the API's share of the engine (``ApiShare``)."""
        self.check_ready()
        prompt_ids = await self._prompt_ids(req)
        results, v0, v1 = await self.sample(prompt_ids, req.n, req.sampling())
        return GenerateResponse(
            prompt_token_ids=list(prompt_ids),
            choices=[Choice(tokens=r.tokens.tolist(), logprobs=r.logprobs.tolist(),
                            versions=None if r.versions is None else r.versions.tolist(),
                            finish_reason=r.finish_reason, cached_tokens=r.cached_tokens,
                            text=self.tokenizer.decode(r.tokens, skip_special_tokens=True)) for r in results],
            policy_version=v0, policy_version_end=v1, precision=self.worker.profile.precision,
        )

    # -- sessions and the OpenAI-shaped routes (rollout_service/sessions.py, openai_api.py) ------
    async def open_session(self, req: OpenSession) -> SessionOpened:
        """A new session (not while draining: it could not finish; open ones may)."""
        self.check_ready()
        if self.worker.draining:
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

        self.check_ready()
        session_id = session_of(req, session_header)
        if session_id is None:
            messages = [m.for_template() for m in req.messages]
            return await self._stateless(req, True, await self.sessions.off_loop(self._chat_ids, messages, req.tools))
        session = self.sessions.get(session_id)
        return await self._session_turn(req, True, session, new_messages(session, req), None)

    async def completion(self, req: CompletionRequest, session_header: str | None) -> dict:
        """A text completion: stateless, or a plain session's next turn (``prompt`` appended first)."""
        from rollout_service.openai_api import session_of

        self.check_ready()
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
