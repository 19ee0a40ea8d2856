"""Multi-turn sessions: token-exact episodes an agent drives turn by turn.

A session holds the exact token ids of one episode: the prompt, each model turn exactly as
sampled (its end-of-turn token too, when sampled), and each appended message tokenized ONCE,
when it is appended, through the chat template's incremental form: the template renders the
history without and with the new messages, and only the text it adds (the new messages, the
previous model turn's closing markers the model did not sample, and the generation prompt) is
tokenized. Earlier ids are never re-tokenized, so the behavior log-probs stay those of the ids
the learner will train on (re-tokenizing a rendered history can merge a sampled "1","2" into
"12" and silently break the importance weights).

Every turn generates on all ids so far. Sessions are bounded (``rollout.max_sessions``,
``session_max_turns``, ``session_max_tokens``, ``session_idle_timeout_s``); each refusal is a
4xx whose detail starts with the config key it hit, and an idle session is given back (removed
and counted), never kept forever. The API's text is rendered and tokenized off the event
loop (``Sessions.start_off_loop``, ``turn``: rollout_service/tokenizing.py), and text that
cannot fit in ``session_max_tokens`` is refused from its bytes before it is tokenized.

The store is independent of the engine: it samples through a ``sample`` coroutine (the
worker's, the same plumbing as ``/v1/generate``), so tests can drive it with a fake.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from fastapi import HTTPException

from rollout_service.api_models import Episode, Finish, Turn, TurnResult, bad_request, max_tokens_within
from rollout_service.tokenizing import OffLoop, TokenBound

EXPIRED_REMEMBERED = 4096  # expired ids kept to tell "expired" from "never existed" in a 404


def load_chat_template(setting: str, tokenizer) -> str | None:
    """``rollout.chat_template``: the template text itself (it has Jinja's ``{{`` or ``{%``), else
    a file holding it, or '' for the tokenizer's own (None when it has none). A path that is not
    a file is a ConfigError, not a template that renders the path."""
    from rlpipe.config import ConfigError

    if not setting:
        return getattr(tokenizer, "chat_template", None)
    if "{{" in setting or "{%" in setting:
        return setting
    try:
        return Path(setting).read_text()
    except OSError as e:
        raise ConfigError(f"rollout.chat_template: neither a template nor a readable file: {e}") from None


@dataclass
class Session:
    id: str
    ids: list[int]
    prompt_length: int
    messages: list[dict] | None  # chat sessions: the history the template renders; None: plain
    tools: list | None = None
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    last_turn: list[int] | None = None  # the last model turn's ids while it is the newest thing held
    routes: np.ndarray | None = None  # routing replay: one row of experts per id held but the last
    touched: float = field(default_factory=time.monotonic)
    busy: bool = False
    held_bytes: int = 0  # messages and tools as JSON, and the model's turns' text (rollout.session_max_bytes)
    # the prefix-cache salt of its first turn, which every later turn keeps, so that each reads the
    # KV of the turns before it (rollout_service/prefix_cache.py); None before the first turn
    cache_salt: str | None = None

    def append(self, ids: list[int], mask: int, logprobs: list[float] | None, versions: list[int]) -> None:
        self.ids += ids
        self.mask += [mask] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += versions

    def add_routes(self, rows: np.ndarray) -> None:
        """A turn's routes (routing replay): one row per token its request forwarded (every id
        held before it, its context, and its tokens but the last). A row is kept from the turn
        that first forwarded its token: a model token's from its own turn, as it was sampled; a
        context token's, and the previous turn's last token's, from the next turn's prefill."""
        held = 0 if self.routes is None else len(self.routes)
        self.routes = rows if self.routes is None else np.concatenate([self.routes, rows[held:]])


class ChatTemplate:
    """The chat template and its incremental form (what it adds for new messages)."""

    def __init__(self, tokenizer, template: str | None):
        self.tokenizer, self.template = tokenizer, template

    def render(self, messages: list[dict], tools: list | None, generation_prompt: bool) -> str:
        if not self.template:
            raise bad_request("messages", "this worker's tokenizer has no chat template: set rollout.chat_template")
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, chat_template=self.template,
                                                      add_generation_prompt=generation_prompt, tokenize=False)
        except Exception as e:  # a template's raise_exception (e.g. roles out of order), or a Jinja error
            raise bad_request("messages", f"the chat template refused them: {e}") from None

    def encode(self, text: str) -> list[int]:
        """Text the template rendered: its markers are the template's own, nothing is added."""
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]] if text else []

    def suffix(self, session: Session, new: list[dict]) -> str:
        """The text the template adds after the session's history for ``new`` messages and the
        generation prompt, led by the closing markers of the last model turn that the model did
        not sample itself (a turn cut by max_tokens lacks its end-of-turn token)."""
        held, tools = session.messages, session.tools
        before = self.render(held, tools, False)
        after = self.render(held + new, tools, True)
        if not after.startswith(before):
            raise bad_request("messages", "rollout.chat_template: the template renders the earlier turns "
                              "differently once these messages follow, so it has no incremental form to append")
        closing = ""
        if session.last_turn is not None:
            opened = self.render(held[:-1], tools, True)  # where the model's turn began
            rendered_turn = before[len(opened):] if before.startswith(opened) else None
            content = held[-1]["content"]
            if rendered_turn is None or not rendered_turn.startswith(content):
                raise bad_request("messages", "rollout.chat_template: the template rewrites the model's turn, "
                                  "so its closing markers cannot be found")
            closing = self.unsampled_closing(rendered_turn[len(content):], session.last_turn)
        return closing + after[len(before):]

    def unsampled_closing(self, rest: str, tokens: list[int]) -> str:
        """What of ``rest`` (the markers the template closes the model's turn with) the model did
        not sample: ``rest`` less its longest start that the turn's sampled ending already is.
        Matched as token ids, never as characters: a turn cut on the toy's ``<pad>`` shares
        the character "<" with the ``<eos>`` the template closes with, and the closing became
        the text "eos>" (ChatML's ``<|im_start|>`` against ``<|im_end|>`` would leave "end|>"),
        so the turn was never closed (issue 33 item 5)."""
        ending, closing = self.sampled_ending(tokens), self.encode(rest)
        for n in range(min(len(ending), len(closing)), 0, -1):
            if ending[-n:] == closing[:n]:
                # The matched ids are special tokens: each one's token is exactly its text in ``rest``.
                sampled = "".join(self.tokenizer.convert_ids_to_tokens(closing[:n]))
                if not rest.startswith(sampled):
                    raise bad_request("messages", "rollout.chat_template: the model's sampled end-of-turn "
                                      "tokens do not read back as the template's closing text")
                return rest[len(sampled):]
        return rest

    def sampled_ending(self, tokens: list[int]) -> list[int]:
        """The special tokens the model ended its turn with (its end-of-turn token); special
        tokens inside the turn are not part of its rendered content or its closing."""
        special = set(self.tokenizer.all_special_ids)
        start = len(tokens)
        while start > 0 and tokens[start - 1] in special:
            start -= 1
        return list(tokens[start:])


class Sessions:
    """The worker's open sessions. ``sample(ids, sampling)`` -> ``(SampleResult, v0, v1)``;
    ``off_loop`` runs their text work (the API's: its threads; the rollout loop's episodes: none)."""

    def __init__(self, limits, tokenizer, template: str | None, sample, version, metrics=None,
                 off_loop: OffLoop | None = None):
        self.limits, self.tokenizer, self.sample, self.version = limits, tokenizer, sample, version
        self.chat = ChatTemplate(tokenizer, template)
        self.bound = TokenBound(tokenizer)
        self.off_loop = off_loop or OffLoop(threads=0)
        self.metrics = metrics
        self.open: dict[str, Session] = {}
        self.expired: OrderedDict[str, float] = OrderedDict()
        self.max_tokens = min(limits.session_max_tokens or limits.max_model_len, limits.max_model_len)
        if metrics is not None:  # the API's store and the rollout loop's (rollout_service/episodes.py)
            metrics.session_stores.append(self)
            metrics.sessions_open.set_function(lambda: sum(len(store.open) for store in metrics.session_stores))

    # -- bounds ---------------------------------------------------------------------
    def refuse(self, code: int, limit: str, why: str) -> HTTPException:
        """A refusal naming the config key of the limit it hit, counted by that key."""
        if self.metrics is not None:
            self.metrics.sessions_refused.labels(**self.metrics.labels, limit=limit).inc()
        return HTTPException(code, f"rollout.{limit}: {why}", headers={"Retry-After": "1"} if code == 429 else None)

    def expire(self, now: float | None = None) -> int:
        """Give back every session idle past ``session_idle_timeout_s``; returns how many."""
        now = time.monotonic() if now is None else now
        idle = [s for s in self.open.values() if not s.busy and now - s.touched > self.limits.session_idle_timeout_s]
        for s in idle:
            del self.open[s.id]
            self.expired[s.id] = now
            if self.metrics is not None:
                self.metrics.sessions_expired.inc()
        while len(self.expired) > EXPIRED_REMEMBERED:
            self.expired.popitem(last=False)
        return len(idle)

    async def reap(self) -> None:
        """Expire idle sessions in the background, so abandoned ones are given back even when no
        request comes (the worker runs this for its lifetime)."""
        period = min(max(self.limits.session_idle_timeout_s / 4, 0.25), 30)
        while True:
            await asyncio.sleep(period)
            self.expire()

    def get(self, session_id: str) -> Session:
        """The open session ``session_id``, or 404 saying whether it expired or never existed."""
        self.expire()
        session = self.open.get(session_id)
        if session is None:
            if session_id in self.expired:
                raise self.refuse(404, "session_idle_timeout_s", f"session {session_id} was given back after "
                                  f"{self.limits.session_idle_timeout_s:g}s idle")
            raise HTTPException(404, f"no session {session_id} on this worker (finished, or never opened here)")
        if session.busy:
            raise HTTPException(409, f"session {session_id}: a request on it is running; send turns one at a time")
        return session

    # -- the three operations ----------------------------------------------------------
    def start(self, messages: list[dict] | None, tools: list | None, prompt: str | None,
              prompt_ids: list[int] | None) -> Session:
        """Open a session on a chat prompt (rendered without a generation prompt: the first turn
        adds it, after any messages it brings), a text prompt, or ids; its text is tokenized on
        the caller's thread (the API's: :meth:`start_off_loop`)."""
        self.check_room()
        return self._opened(self.prompt_ids(messages, tools, prompt, prompt_ids), messages, tools)

    async def start_off_loop(self, messages: list[dict] | None, tools: list | None, prompt: str | None,
                             prompt_ids: list[int] | None) -> Session:
        """:meth:`start`, its text rendered and tokenized off the event loop (``off_loop``)."""
        self.check_room()
        ids = await self.off_loop(self.prompt_ids, messages, tools, prompt, prompt_ids)
        self.check_room()  # others may have opened meanwhile
        return self._opened(ids, messages, tools)

    def check_room(self) -> None:
        """429 with ``max_sessions`` open (idle ones expired first)."""
        self.expire()
        if len(self.open) >= self.limits.max_sessions:
            raise self.refuse(429, "max_sessions", f"{len(self.open)} sessions are open on this worker; finish one")

    def prompt_ids(self, messages: list[dict] | None, tools: list | None, prompt: str | None,
                   prompt_ids: list[int] | None) -> list[int]:
        """A new session's prompt ids, refused (409) when they leave no room to sample: from the
        text's bytes, before it is tokenized, when they already say so (``TokenBound``)."""
        text = self.chat.render(messages, tools, False) if messages is not None else prompt
        if text is not None:
            too_long = self.bound.over(text, self.max_tokens - 1)
            if too_long:
                raise self.refuse(409, "session_max_tokens", f"the prompt {too_long}: no room to sample within "
                                  f"{self.max_tokens}")
        if messages is not None:
            ids = self.chat.encode(text)
        elif prompt is not None:
            ids = [int(i) for i in self.tokenizer(prompt)["input_ids"]]  # as /v1/generate tokenizes text
        else:
            ids = list(prompt_ids)
        self.check_ids(ids, "prompt_token_ids")
        if len(ids) >= self.max_tokens:
            raise self.refuse(409, "session_max_tokens", f"the prompt's {len(ids)} tokens leave no room to sample "
                              f"within {self.max_tokens}")
        return ids

    def check_bytes(self, held: int, new: list | None, what: str) -> int:
        """The bytes of ``new`` (messages or tools, as JSON); 409 naming ``session_max_bytes``
        when ``held`` and they are more than a session may hold."""
        added = len(json.dumps(new, ensure_ascii=False).encode()) if new else 0
        if held + added > self.limits.session_max_bytes:
            raise self.refuse(409, "session_max_bytes", f"{what} would hold {held + added} bytes of messages and "
                              f"tools, past the {self.limits.session_max_bytes} a session may")
        return added

    def _opened(self, ids: list[int], messages: list[dict] | None, tools: list | None) -> Session:
        held = self.check_bytes(0, messages, "the session")
        session = Session(uuid.uuid4().hex, [], len(ids), messages, tools,
                          held_bytes=held + self.check_bytes(held, tools, "the session"))
        session.append(ids, 0, None, [self.version()] * len(ids))
        self.open[session.id] = session
        return session

    def context(self, session: Session, req: Turn | None, new_messages: list[dict]) -> list[int]:
        """The ids to append before the next model turn, tokenized once, now; text that leaves
        no room to sample is refused (409) from its bytes before it is tokenized when they say so."""
        if session.messages is None:
            if new_messages:
                raise bad_request("message", "a plain session takes 'text' or 'token_ids', not messages")
            if req is not None and req.token_ids is not None:
                self.check_ids(req.token_ids, "token_ids")
                return list(req.token_ids)
            text = req.text if req is not None and req.text else ""
        elif req is not None and (req.text is not None or req.token_ids is not None):
            raise bad_request("text", "a chat session takes a 'message'")
        else:
            text = self.chat.suffix(session, new_messages)
        too_long = self.bound.over(text, self.max_tokens - len(session.ids) - 1)
        if too_long:
            raise self.refuse(409, "session_max_tokens", f"session {session.id} holds {len(session.ids)} ids and the "
                              f"text to append {too_long}: no room to sample within {self.max_tokens}")
        return self.chat.encode(text)

    async def turn(self, session: Session, req: Turn, new_messages: list[dict] | None = None,
                   max_tokens_field: str | None = "max_tokens") -> TurnResult:
        """Append the context, sample the model's turn on every id so far, and keep both; on any
        failure the session is left as it was. ``max_tokens_field``: the name the request gave
        its max_tokens (OpenAI's ``max_completion_tokens``), for a refusal to name; None for the
        rollout loop's own episodes, whose ``sampling.max_tokens`` is cut to the room left (the
        episode's budget ends its last turn as max_tokens ends an answer; HTTP requests are
        refused instead, ``max_tokens_within``)."""
        new_messages = new_messages if new_messages is not None else (
            [req.message.for_template()] if req.message is not None else [])
        turns = len(session.finish_reasons)
        if turns >= self.limits.session_max_turns:
            raise self.refuse(409, "session_max_turns", f"session {session.id} has had its {turns} turns")
        added = self.check_bytes(session.held_bytes, new_messages, f"session {session.id}")
        session.busy = True
        try:
            context = await self.off_loop(self.context, session, req, new_messages)
            room = self.max_tokens - len(session.ids) - len(context)
            if room < 1:
                raise self.refuse(409, "session_max_tokens", f"session {session.id} holds {len(session.ids)} ids "
                                  f"and {len(context)} more to append: no room to sample within {self.max_tokens}")
            asked = req.max_tokens if max_tokens_field or req.max_tokens is None else min(req.max_tokens, room)
            max_tokens = max_tokens_within(asked, req.min_tokens, self.limits.max_new_tokens, room,
                                           f"in session {session.id}: {self.max_tokens} (rollout.session_max_tokens) "
                                           f"less its {len(session.ids)} ids and {len(context)} to append",
                                           max_tokens_field or "max_tokens")
            result, v0, v1 = await self.sample(session.ids + context,
                                               {**req.sampling(max_tokens), "cache_salt": session.cache_salt})
        finally:
            session.busy, session.touched = False, time.monotonic()
        session.held_bytes += added
        return self.keep(session, context, new_messages, result, v0, v1)

    def keep(self, session: Session, context: list[int], new_messages: list[dict], result, v0: int,
             v1: int) -> TurnResult:
        """Commit a sampled turn: the context (mask 0), then the tokens exactly as sampled (mask 1)."""
        tokens = [int(t) for t in result.tokens]
        versions = [int(v) for v in result.versions] if result.versions is not None else [v0] * len(tokens)
        session.append(context, 0, None, [self.version()] * len(context))
        session.append(tokens, 1, [float(x) for x in result.logprobs], versions)
        if getattr(result, "routes", None) is not None:
            session.add_routes(result.routes)
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        session.held_bytes += len(text.encode())
        if session.messages is not None:
            session.messages = session.messages + new_messages + [{"role": "assistant", "content": text}]
        session.last_turn = tokens
        session.cache_salt = session.cache_salt or getattr(result, "cache_salt", None)
        session.finish_reasons.append(result.finish_reason)
        if self.metrics is not None:
            self.metrics.session_context_tokens.inc(len(context))
        return TurnResult(session_id=session.id, turn=len(session.finish_reasons), text=text, token_ids=tokens,
                          logprobs=[float(x) for x in result.logprobs], versions=versions,
                          finish_reason=result.finish_reason, context_token_ids=context,
                          total_tokens=len(session.ids), policy_version=v0, policy_version_end=v1,
                          cached_tokens=getattr(result, "cached_tokens", 0))

    def finish(self, session: Session, req: Finish) -> Episode:
        """Close the session and hand back its whole episode. The session is given back only once
        the episode is built and renders as JSON: a finish that fails keeps it open, so that a
        corrected one can still have the episode (a reward_info the answer could not carry lost
        it: a 500, then a 404)."""
        model_versions = [v for v, m in zip(session.versions, session.mask) if m] or [self.version()]
        episode = Episode(session_id=session.id, token_ids=session.ids, mask=session.mask, logprobs=session.logprobs,
                          versions=session.versions, prompt_length=session.prompt_length,
                          turns=len(session.finish_reasons), finish_reasons=session.finish_reasons,
                          policy_version=min(model_versions), policy_version_end=max(model_versions),
                          reward=req.reward, reward_info=req.reward_info)
        try:  # the caller's part of it (the rest is the session's own ids and numbers)
            episode.model_dump_json(include={"reward_info"})
        except ValueError as e:  # PydanticSerializationError among them
            raise bad_request("reward_info", f"cannot be sent back as JSON: {e}") from None
        del self.open[session.id]
        if self.metrics is not None:
            self.metrics.sessions_finished.inc()
            self.metrics.session_turns.observe(len(session.finish_reasons))
        return episode

    def check_ids(self, ids: list[int], field_name: str) -> None:
        vocab = len(self.tokenizer)
        if any(t < 0 or t >= vocab for t in ids):
            raise bad_request(field_name, f"token ids must be in [0, {vocab})")
