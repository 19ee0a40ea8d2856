"""Token-exact multi-turn sessions (rollout_service/sessions.py) and the OpenAI-compatible routes
(rollout_service/openai_api.py).

- In process, with a scripted engine: the store keeps every sampled id as sampled and tokenizes
  only the text a new message adds, where re-tokenizing the rendered history gives other ids
  (a real BPE tokenizer's " hel","lo" coming back as " hello"; the toy's "1",<bos>,"2" as "12").
- Against a live standalone worker (real vLLM engine on the toy model, a bearer token): open,
  turn and finish with masks, log-probs and versions; each limit refused with a 4xx naming its
  config key; an idle session given back; the official ``openai`` client driving a 3-turn
  episode through ``/v1/chat/completions`` with a session id, and statelessly without one.
"""

from __future__ import annotations

import asyncio
from functools import lru_cache
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from rlpipe.config import build_config
from tests.conftest import standalone_worker, wait_for

TOKEN = "sessions-token-7c1e"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
IDLE_S = 4.0
# A chat template within the toy's vocabulary (digits, + - * = %, space): a tool definition renders
# as "*", a user turn as its text, a tool result after "%", the generation prompt (and a model turn's header) as "=", and a
# model turn ends with <eos>. "<bos>12+30=" is then exactly the toy's arithmetic prompt.
TOY_TEMPLATE = ("{{ bos_token }}{% if tools %}{% for t in tools %}*{% endfor %}{% endif %}"
                "{% for m in messages %}{% if m.role == 'assistant' %}={{ m.content }}{{ eos_token }}"
                "{% elif m.role == 'tool' %}%{{ m.content }}{% else %}{{ m.content }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}={% endif %}")
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}]


# -- the store in process, with a scripted engine -------------------------------------------
class SpyTokenizer:
    """A real tokenizer that records every text it is asked to tokenize."""

    def __init__(self, tokenizer):
        self.inner, self.texts = tokenizer, []

    def __call__(self, text, **kw):
        self.texts.append(text)
        return self.inner(text, **kw)

    def __len__(self):
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def scripted(turns: list[list[int]], seen: list[list[int]]):
    """A ``sample`` that answers the scripted turns in order (log-prob -0.5 each, version 7)."""
    async def sample(prompt_ids, sampling):
        seen.append(list(prompt_ids))
        tokens = turns[len(seen) - 1]
        result = SimpleNamespace(tokens=np.asarray(tokens, dtype=np.int32),
                                 logprobs=np.full(len(tokens), -0.5, dtype=np.float32), versions=None,
                                 finish_reason="stop" if tokens[-1] in (2, 100_000) else "length")
        return result, 7, 7
    return sample


def store(tokenizer, template, turns, seen, **limits):
    from rollout_service.sessions import Sessions

    cfg = SimpleNamespace(**{"max_sessions": 4, "session_max_turns": 8, "session_max_tokens": None,
                             "max_model_len": 4096, "max_new_tokens": 16, "session_idle_timeout_s": 60.0,
                             "session_max_bytes": 2 << 20, **limits})
    return Sessions(cfg, tokenizer, template, scripted(turns, seen), lambda: 7)


def run_turn(sessions, session, message=None, **kw):
    from rollout_service.api_models import Message, Turn

    req = Turn(message=Message(**message) if message else None, **kw)
    return asyncio.run(sessions.turn(session, req))


def test_bpe_split_kept_as_sampled_and_only_new_text_tokenized(real_model_path):
    """SmolLM2's BPE: the model samples " hel","lo" then <|im_end|>; re-tokenizing the history
    gives one " hello" token. The session keeps the two ids, adds the template's closing "\\n"
    the model did not sample (as context), and tokenizes only each new message's text."""
    from transformers import AutoTokenizer

    tok = SpyTokenizer(AutoTokenizer.from_pretrained(real_model_path))
    hel, lo, hello = (tok.inner.encode(t, add_special_tokens=False) for t in (" hel", "lo", " hello"))
    assert len(hel) == len(lo) == len(hello) == 1 and hel + lo != hello  # the split is a real non-canonical one
    end = tok.inner.convert_tokens_to_ids("<|im_end|>")
    turns, seen = [hel + lo + [end], hel + lo + [end]], []
    sessions = store(tok, tok.inner.chat_template, turns, seen)
    user = [{"role": "user", "content": "say hi"}]
    session = sessions.start(user, None, None, None)
    prompt = list(session.ids)
    first = run_turn(sessions, session)
    second = run_turn(sessions, session, {"role": "tool", "content": "42", "tool_call_id": "c1"})

    render = tok.inner.apply_chat_template
    gen = render(user, tokenize=False, add_generation_prompt=True)[len(render(user, tokenize=False)):]
    assert first.context_token_ids == tok.inner.encode(gen, add_special_tokens=False)
    history = user + [{"role": "assistant", "content": " hello"}]
    tool = [{"role": "tool", "content": "42", "tool_call_id": "c1"}]
    added = render(history + tool, tokenize=False, add_generation_prompt=True)[len(render(history, tokenize=False)):]
    assert second.context_token_ids == tok.inner.encode("\n" + added, add_special_tokens=False)
    assert session.ids == prompt + first.context_token_ids + turns[0] + second.context_token_ids + turns[1]
    assert seen[1] == session.ids[:len(session.ids) - len(turns[1])]  # the second turn sampled on every id so far
    assert session.mask == [0] * (len(prompt) + len(first.context_token_ids)) + [1] * 3 + \
        [0] * len(second.context_token_ids) + [1] * 3
    # Nothing said earlier was tokenized again: after the prompt, only the new text went in (and the
    # template's closing of the model's turn, alone, to compare its ids with the sampled ending).
    assert tok.texts[1:] == [gen, "<|im_end|>\n", "\n" + added]
    # Re-tokenizing the rendered history merges the sampled split: other ids, and other log-probs.
    retokenized = render(history + tool + [{"role": "assistant", "content": " hello"}], tokenize=True,
                         return_dict=False)
    assert hello[0] in retokenized and session.ids[:len(retokenized)] != retokenized


def test_chatml_turn_cut_on_another_special_token_still_gets_its_whole_closing(real_model_path):
    """SmolLM2's ChatML closes a model turn with "<|im_end|>\\n". A turn cut by max_tokens on
    <|im_start|> (a special token, not part of the rendered content) shares "<|im_" with it:
    compared as characters the closing became the text "end|>\\n", five ordinary ids, and
    the turn was never closed (issue 33 item 5). Compared as ids, the whole closing is appended."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model_path)
    hel, lo = (tok.encode(t, add_special_tokens=False) for t in (" hel", "lo"))
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    turns, seen = [hel + lo + [start], hel + lo + [end]], []
    sessions = store(tok, tok.chat_template, turns, seen)
    user = [{"role": "user", "content": "say hi"}]
    session = sessions.start(user, None, None, None)
    run_turn(sessions, session, max_tokens=3)
    second = run_turn(sessions, session, {"role": "user", "content": "again"})
    history = user + [{"role": "assistant", "content": " hello"}]
    render = tok.apply_chat_template
    added = render(history + [{"role": "user", "content": "again"}], tokenize=False,
                   add_generation_prompt=True)[len(render(history, tokenize=False)):]
    assert second.context_token_ids[:2] == [end] + tok.encode("\n", add_special_tokens=False)
    assert second.context_token_ids == tok.encode("<|im_end|>\n" + added, add_special_tokens=False)


def test_toy_turn_cut_on_pad_gets_its_eos_as_context(toy_model_path):
    """The toy's template closes a model turn with <eos> (id 2); a turn cut by max_tokens on
    <pad> (id 0) shares the character "<" with it. Compared as characters, the closing became
    the text "eos>", which the toy's vocabulary has no ids for: nothing was appended and the
    session held ..., 0, 5, 14, 5, 17 where docs/agents.md promises ..., 0, 2, 5, 14, 5, 17."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_model_path)
    turns, seen = [[8, 0], [8, 2]], []  # "4",<pad> cut by length; then "4",<eos>
    sessions = store(tok, TOY_TEMPLATE, turns, seen)
    session = sessions.start([{"role": "user", "content": "2+2"}], None, None, None)
    run_turn(sessions, session, max_tokens=2)
    second = run_turn(sessions, session, {"role": "user", "content": "1+1"})
    assert second.context_token_ids == [2, 5, 14, 5, 17]  # <eos>, then "1+1="
    assert session.ids[-len(turns[1]) - 6:] == [0, 2, 5, 14, 5, 17] + turns[1]


def test_toy_turn_cut_without_its_end_gets_the_closing_token_as_context(toy_model_path):
    """The toy (one character a token): a turn cut by max_tokens lacks <eos>, which the template
    closes model turns with: it is appended, masked out, before the next message. A sampled
    "1",<bos>,"2" reads "12" and would come back from the text as "1","2"."""
    from transformers import AutoTokenizer

    tok = SpyTokenizer(AutoTokenizer.from_pretrained(toy_model_path))
    turns, seen = [[5, 1, 6], [8, 2]], []  # "1",<bos>,"2" cut by length; then "4",<eos>
    sessions = store(tok, TOY_TEMPLATE, turns, seen)
    session = sessions.start([{"role": "user", "content": "12+30"}], TOOLS, None, None)
    assert session.ids == [1, 16, 5, 6, 14, 7, 4]  # "<bos>*12+30": the tool rendered, no generation prompt yet
    first = run_turn(sessions, session, max_tokens=3)
    second = run_turn(sessions, session, {"role": "tool", "content": "5"})
    assert first.text == "12" and first.context_token_ids == [17]  # "="
    assert second.context_token_ids == [2, 18, 9, 17]  # <eos> (the closing the cut turn lacked), "%5="
    assert session.ids[-len(turns[1]):] == turns[1] and session.mask[-2:] == [1, 1]
    assert session.mask[session.ids.index(2)] == 0  # the appended <eos> is context
    retokenized = tok.inner.encode("<bos>*12+30=12<eos>%5=", add_special_tokens=False)
    assert retokenized != session.ids[:len(retokenized)]  # the text lost the sampled <bos>
    assert all("12+30" not in t for t in tok.texts[1:])  # the prompt was never tokenized again


def test_a_turns_max_tokens_is_taken_or_refused_never_cut(toy_model_path):
    """Issue 33 item 6, in the store: a turn's max_tokens above rollout.max_new_tokens (16) or
    the room rollout.session_max_tokens (12) leaves is a 422 naming the field, and nothing is
    kept (it was cut to the room, silently); left out, the turn gets the room. The rollout
    loop's own episodes (max_tokens_field None) still have sampling.max_tokens cut to it. A
    min_tokens above the max_tokens sampled with names min_tokens (the engine named
    "sampling", item 7)."""
    from fastapi import HTTPException
    from transformers import AutoTokenizer

    from rollout_service.api_models import Turn

    tok = AutoTokenizer.from_pretrained(toy_model_path)
    asked = []

    async def sample(prompt_ids, sampling):
        asked.append(sampling["max_tokens"])
        return SimpleNamespace(tokens=np.asarray([8]), logprobs=np.zeros(1), versions=None,
                               finish_reason="length"), 0, 0

    sessions = store(tok, TOY_TEMPLATE, [], [], session_max_tokens=12)
    sessions.sample = sample
    session = sessions.start([{"role": "user", "content": "1+1"}], None, None, None)  # 4 ids, "=" to append: room 7

    def refused(req: Turn, field: str) -> str:
        with pytest.raises(HTTPException) as e:
            asyncio.run(sessions.turn(session, req))
        assert e.value.status_code == 422 and e.value.detail[0]["loc"] == ["body", field], e.value.detail
        return e.value.detail[0]["msg"]

    assert "7 tokens left" in refused(Turn(max_tokens=8), "max_tokens")
    assert "rollout.max_new_tokens (16)" in refused(Turn(max_tokens=10**12), "max_tokens")
    assert "max_tokens (7" in refused(Turn(min_tokens=8), "min_tokens")
    assert session.ids == [1, 5, 14, 5] and asked == []  # nothing sampled, nothing kept
    asyncio.run(sessions.turn(session, Turn(max_tokens=7)))  # exactly the room: taken as it is
    asyncio.run(sessions.turn(session, Turn()))  # left out: the room, 12 - 6 held - <eos>,"=" to append
    asyncio.run(sessions.turn(session, Turn(max_tokens=16), None, max_tokens_field=None))  # the loop's: cut
    assert asked == [7, 4, 1]


def test_one_request_at_a_time_and_a_failed_turn_leaves_the_session_as_it_was(toy_model_path):
    """A second request on a session while a turn runs gets 409; a turn the engine refuses
    commits nothing (its context is not kept either)."""
    from fastapi import HTTPException
    from transformers import AutoTokenizer

    from rollout_service.api_models import Turn

    tok = AutoTokenizer.from_pretrained(toy_model_path)
    gate, outcomes = None, []

    async def sample(prompt_ids, sampling):
        await gate.wait()
        if len(outcomes) == 0:
            outcomes.append("refused")
            raise HTTPException(429, "busy")
        return SimpleNamespace(tokens=np.asarray([8, 2]), logprobs=np.zeros(2), versions=None,
                               finish_reason="stop"), 0, 0

    sessions = store(tok, TOY_TEMPLATE, [], [])
    sessions.sample = sample
    session = sessions.start([{"role": "user", "content": "1+1"}], None, None, None)

    async def scenario():
        nonlocal gate
        gate = asyncio.Event()
        first = asyncio.ensure_future(sessions.turn(session, Turn()))
        await asyncio.sleep(0)
        with pytest.raises(HTTPException) as busy:
            sessions.get(session.id)
        gate.set()
        with pytest.raises(HTTPException) as refused:
            await first
        kept = list(session.ids)
        result = await sessions.turn(sessions.get(session.id), Turn())
        return busy.value, refused.value, kept, result

    busy, refused, kept, result = asyncio.run(scenario())
    assert busy.status_code == 409 and refused.status_code == 429
    assert kept == [1, 5, 14, 5]  # "<bos>1+1": the refused turn's "=" was not kept
    assert result.context_token_ids == [17] and session.ids == kept + [17, 8, 2]


def test_episode_versions_show_an_update_between_and_inside_turns(toy_model_path):
    """Turn 1 sampled under version 3; an update lands before turn 2, another inside it (the
    engine's per-token versions): the episode carries each model token's version, context tokens
    the version in force when appended, and its policy_version is the oldest model token's."""
    from transformers import AutoTokenizer

    from rollout_service.api_models import Finish, Turn

    tok = AutoTokenizer.from_pretrained(toy_model_path)
    engine_version = [3]
    answers = [(SimpleNamespace(tokens=np.asarray([8, 2]), logprobs=np.zeros(2), versions=None,
                                finish_reason="stop"), 3, 3),
               (SimpleNamespace(tokens=np.asarray([5, 6, 2]), logprobs=np.zeros(3),
                                versions=np.asarray([4, 5, 5]), finish_reason="stop"), 4, 5)]

    async def sample(prompt_ids, sampling):
        answer = answers.pop(0)
        engine_version[0] = answer[2]
        return answer

    sessions = store(tok, TOY_TEMPLATE, [], [])
    sessions.sample, sessions.version = sample, lambda: engine_version[0]
    session = sessions.start([{"role": "user", "content": "1+1"}], None, None, None)
    asyncio.run(sessions.turn(session, Turn()))
    engine_version[0] = 4  # an update between the turns
    asyncio.run(sessions.turn(session, Turn(message={"role": "user", "content": "+2"})))
    episode = sessions.finish(session, Finish(reward=0.5))
    model = [v for v, m in zip(episode.versions, episode.mask) if m]
    assert model == [3, 3, 4, 5, 5]
    assert (episode.policy_version, episode.policy_version_end) == (3, 5)
    assert episode.versions[:4] == [3, 3, 3, 3]  # the prompt, appended under version 3
    assert episode.reward == 0.5 and session.id not in sessions.open


def test_the_chat_template_setting(tmp_path, toy_model_path):
    from transformers import AutoTokenizer

    from rlpipe.config import ConfigError
    from rollout_service.sessions import load_chat_template

    tok = AutoTokenizer.from_pretrained(toy_model_path)
    assert load_chat_template("", tok) is None  # the toy's tokenizer has none
    assert load_chat_template(TOY_TEMPLATE, tok) == TOY_TEMPLATE
    (tmp_path / "t.jinja").write_text(TOY_TEMPLATE)
    assert load_chat_template(str(tmp_path / "t.jinja"), tok) == TOY_TEMPLATE
    with pytest.raises(ConfigError, match="rollout.chat_template"):
        load_chat_template(str(tmp_path / "missing.jinja"), tok)


# -- a live worker ----------------------------------------------------------------------------
def test_junk_on_every_turn_is_held_only_up_to_the_sessions_byte_bound(toy_model_path):
    """A field the template never reads, just under the body limit, sent on every turn, was kept in
    the session's history each time: about 5x its size in memory, 66 MiB a session. Now what a
    session holds (messages and tools as JSON, the model's turns) is bounded by
    rollout.session_max_bytes: the turn that would pass it is refused (409, naming the key) and
    commits nothing, the session's memory stays within a few times the bound, and a turn
    without junk still runs on it."""
    import tracemalloc

    from fastapi import HTTPException
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_model_path)
    bound = 64 << 10
    sessions = store(tok, TOY_TEMPLATE, [[8, 2]] * 8, [], session_max_bytes=bound)
    session = sessions.start([{"role": "user", "content": "1+1"}], None, None, None)
    junk = {"role": "user", "content": "2+2", "note": "x" * (30 << 10)}
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    accepted = 0
    with pytest.raises(HTTPException) as refused:
        for _ in range(8):
            run_turn(sessions, session, junk)
            accepted += 1
    grew = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert refused.value.status_code == 409 and "session_max_bytes" in refused.value.detail
    assert accepted == 2 and session.held_bytes <= bound
    assert grew < 4 * bound, grew  # the refused turn kept nothing
    held, turns = session.held_bytes, len(session.finish_reasons)
    result = run_turn(sessions, session, {"role": "user", "content": "3+3"})  # the steady state: it still serves
    assert result.turn == turns + 1 and session.held_bytes > held


@pytest.fixture(scope="module")
def live(toy_model_path, tmp_path_factory):
    """A standalone worker (no Redis) with a token, the toy chat template and small session
    limits; yields its base URL. One engine for the whole module."""
    run_dir = tmp_path_factory.mktemp("sessions")
    (run_dir / "template.jinja").write_text(TOY_TEMPLATE)
    cfg = build_config({}, environ={}, **{
        "model.path": toy_model_path, "rollout.precision": "fp32", "rollout.max_inflight_groups": 2,
        "rollout.chat_template": str(run_dir / "template.jinja"), "rollout.max_sessions": 3,
        "rollout.session_max_turns": 3, "rollout.session_max_tokens": 48, "rollout.max_new_tokens": 8,
        "rollout.session_idle_timeout_s": IDLE_S})
    with standalone_worker(cfg, run_dir, "sessions", TOKEN) as base:
        yield base


def post(base, path, body=None, **kw):
    return httpx.post(f"{base}{path}", json={} if body is None else body, headers={**AUTH, **kw.pop("headers", {})},
                      timeout=60, **kw)


@lru_cache(maxsize=1)
def toy_tokenizer():
    from transformers import AutoTokenizer

    from launch.toy import ensure_toy_model
    from tests.conftest import TOY_SPEC

    return AutoTokenizer.from_pretrained(str(ensure_toy_model(TOY_SPEC, log=lambda m: None)))


def toy_ids(text: str) -> list[int]:
    """The toy's ids for text the template rendered: one character a token, specials by name."""
    return toy_tokenizer().encode(text, add_special_tokens=False)


def metric(base: str, name: str) -> float:
    """The sum of a metric's series in /metrics."""
    lines = [ln for ln in httpx.get(f"{base}/metrics").text.splitlines() if ln.startswith(name + "{")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


def closing(turn: dict) -> list[int]:
    """What the template closes a model turn with and the model did not sample: its <eos>."""
    return [] if turn["token_ids"] and turn["token_ids"][-1] == 2 else [2]


def test_open_turn_finish_token_exact(live):
    opened = post(live, "/v1/sessions", {"messages": [{"role": "user", "content": "12+30"}], "tools": TOOLS})
    assert opened.status_code == 200, opened.text
    sid, prompt = opened.json()["session_id"], opened.json()["prompt_token_ids"]
    assert prompt == toy_ids("<bos>*12+30")
    finished_before, turns_before = metric(live, "rlpipe_sessions_finished_total"), metric(live, "rlpipe_session_turns_count")
    turns, contexts = [], []
    for message in (None, {"role": "tool", "content": "5"}, {"role": "user", "content": "+1"}):
        resp = post(live, f"/v1/sessions/{sid}/turn", {"message": message, "temperature": 1.0, "max_tokens": 4, "seed": 3})
        assert resp.status_code == 200, resp.text
        turn = resp.json()
        assert len(turn["token_ids"]) == len(turn["logprobs"]) == len(turn["versions"]) >= 1
        assert all(lp <= 0 for lp in turn["logprobs"]) and turn["versions"] == [0] * len(turn["token_ids"])
        # The context is what the template adds, tokenized by itself: the previous turn's closing
        # <eos> when the model did not sample it, the message, the generation prompt.
        expected = toy_ids("=") if message is None else (
            closing(turns[-1]) + toy_ids(("%" if message["role"] == "tool" else "") + message["content"] + "="))
        assert turn["context_token_ids"] == expected
        turns.append(turn)
        contexts.append(expected)
    over = post(live, f"/v1/sessions/{sid}/turn", {"max_tokens": 2})
    assert over.status_code == 409 and over.json()["detail"].startswith("rollout.session_max_turns"), over.text
    episode = post(live, f"/v1/sessions/{sid}/finish", {"reward": 1.0}).json()
    ids, mask = list(prompt), [0] * len(prompt)
    for context, turn in zip(contexts, turns):
        ids += context + turn["token_ids"]
        mask += [0] * len(context) + [1] * len(turn["token_ids"])
    assert episode["token_ids"] == ids and episode["mask"] == mask and episode["prompt_length"] == len(prompt)
    assert [lp for lp, m in zip(episode["logprobs"], mask) if m] == [lp for t in turns for lp in t["logprobs"]]
    assert episode["turns"] == 3 and episode["reward"] == 1.0 and episode["policy_version"] == 0
    assert len(episode["versions"]) == len(ids)
    assert metric(live, "rlpipe_sessions_finished_total") == finished_before + 1
    assert metric(live, "rlpipe_session_turns_count") == turns_before + 1
    gone = post(live, f"/v1/sessions/{sid}/turn", {})
    assert gone.status_code == 404 and sid in gone.json()["detail"]


def test_each_limit_is_refused_naming_its_config_key(live):
    sids = [post(live, "/v1/sessions", {"prompt_token_ids": [1, 5, 14, 5, 17]}).json()["session_id"] for _ in range(3)]
    refused = post(live, "/v1/sessions", {"prompt": "1+1="})
    assert refused.status_code == 429 and refused.json()["detail"].startswith("rollout.max_sessions"), refused.text
    assert metric(live, "rlpipe_sessions_refused_total") >= 1
    for sid in sids:
        assert post(live, f"/v1/sessions/{sid}/finish").status_code == 200
    # session_max_tokens (48): a 47-token prompt leaves room for one token, then none.
    assert post(live, "/v1/sessions", {"prompt_token_ids": [5] * 48}).json()["detail"].startswith(
        "rollout.session_max_tokens")
    sid = post(live, "/v1/sessions", {"prompt_token_ids": [5] * 47}).json()["session_id"]
    over = post(live, f"/v1/sessions/{sid}/turn", {"max_tokens": 8})  # asked for more than the room: refused
    assert over.status_code == 422 and over.json()["detail"][0]["loc"] == ["body", "max_tokens"], over.text
    one = post(live, f"/v1/sessions/{sid}/turn", {"min_tokens": 1})  # none asked for: the room
    assert one.status_code == 200 and len(one.json()["token_ids"]) == 1 and one.json()["total_tokens"] == 48
    full = post(live, f"/v1/sessions/{sid}/turn", {"max_tokens": 1})
    assert full.status_code == 409 and full.json()["detail"].startswith("rollout.session_max_tokens"), full.text
    assert post(live, f"/v1/sessions/{sid}/finish").json()["turns"] == 1
    # a plain session takes text, not messages; an unknown id is a 404 saying so
    assert post(live, "/v1/sessions/nope/turn", {}).status_code == 404
    assert "no session nope" in post(live, "/v1/sessions/nope/finish").json()["detail"]


def test_idle_session_is_given_back(live):
    expired, open_before = metric(live, "rlpipe_sessions_expired_total"), metric(live, "rlpipe_sessions_open")
    sid = post(live, "/v1/sessions", {"prompt": "2+2="}).json()["session_id"]
    assert metric(live, "rlpipe_sessions_open") == open_before + 1
    # No request comes: the reaper gives it back on its own.
    wait_for(lambda: metric(live, "rlpipe_sessions_expired_total") > expired, IDLE_S + 5, interval=0.25,
             what="the idle session to be given back")
    assert metric(live, "rlpipe_sessions_open") == open_before
    late = post(live, f"/v1/sessions/{sid}/turn", {})
    assert late.status_code == 404 and late.json()["detail"].startswith("rollout.session_idle_timeout_s"), late.text


def test_openai_client_drives_a_three_turn_episode(live):
    """The official client, unmodified: the whole conversation every call, the session id in a
    header or in extra_body; the session keeps the ids token-exactly."""
    import openai

    client = openai.OpenAI(base_url=f"{live}/v1", api_key=TOKEN, max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "12+30"}]
    sid = post(live, "/v1/sessions", {"messages": messages, "tools": TOOLS}).json()["session_id"]
    ways = [{"extra_headers": {"X-Session-Id": sid}}, {"extra_body": {"session_id": sid}},
            {"extra_headers": {"X-Session-Id": sid}}]
    answers, expected = [], toy_ids("<bos>*12+30")
    for i, (way, new) in enumerate(zip(ways, ([], [{"role": "tool", "content": "5", "tool_call_id": "c1"}],
                                              [{"role": "user", "content": "-2"}]))):
        messages += new
        try:
            r = client.chat.completions.create(model="toy", messages=messages, tools=TOOLS, max_tokens=4,
                                               temperature=1.0, seed=i, logprobs=True, **way)
        except openai.APIStatusError as e:
            raise AssertionError(f"turn {i + 1}: {e.response.text}") from None
        choice = r.choices[0]
        assert r.object == "chat.completion" and choice.message.role == "assistant" and r.model == "toy"
        assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
        assert r.usage.completion_tokens == len(choice.token_ids) and r.model_extra["session_id"] == sid
        assert [c.logprob for c in choice.logprobs.content] == choice.behavior_logprobs
        text = "".join(("%" if m["role"] == "tool" else "") + m["content"] for m in new)
        expected += (closing(answers[-1]) if answers else []) + toy_ids(text + "=") + choice.token_ids
        assert r.model_extra["prompt_token_ids"] + choice.token_ids == expected
        answers.append({"token_ids": choice.token_ids})
        messages.append({"role": "assistant", "content": choice.message.content})
    episode = post(live, f"/v1/sessions/{sid}/finish", {}).json()
    assert episode["token_ids"] == expected and episode["turns"] == 3 and episode["reward"] is None
    assert sum(episode["mask"]) == sum(len(a["token_ids"]) for a in answers)


def test_stateless_openai_completions(live):
    import openai

    client = openai.OpenAI(base_url=f"{live}/v1", api_key=TOKEN, max_retries=0, timeout=60)
    open_before = metric(live, "rlpipe_sessions_open")
    r = client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "12+30"}], max_tokens=4,
                                       n=2, temperature=1.0)
    assert len(r.choices) == 2 and r.model_extra["session_id"] is None
    assert r.model_extra["prompt_token_ids"] == toy_ids("<bos>12+30=")
    assert r.usage.prompt_tokens == 7 and all(1 <= len(c.token_ids) <= 4 for c in r.choices)
    c = client.completions.create(model="toy", prompt="12+30=", max_tokens=3, temperature=0)
    assert c.object == "text_completion" and isinstance(c.choices[0].text, str)
    assert c.model_extra["prompt_token_ids"] == [1] + toy_ids("12+30=")  # text tokenized as /v1/generate does
    assert metric(live, "rlpipe_sessions_open") == open_before  # nothing kept
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live}/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model="toy", messages=[{"role": "user", "content": "1"}])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "1"}],
                                       extra_headers={"X-Session-Id": "missing"})
    # what many clients ask first, and errors in OpenAI's shape: the client reads the field and the message
    listed = client.models.list().data
    assert len(listed) == 1 and listed[0].owned_by == "rlpipe" and listed[0].id
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.chat.completions.create(model=listed[0].id, messages=[{"role": "user", "content": "1"}],
                                       max_tokens=10**12)
    assert refused.value.param == "max_tokens" and refused.value.type == "invalid_request_error"
    assert "exceeds rollout.max_new_tokens" in refused.value.message
    plain = post(live, "/v1/generate", {"prompt": "1", "max_tokens": 10**12})  # rlpipe's own routes: detail only
    assert plain.status_code == 422 and set(plain.json()) == {"detail"}


# -- one rule for max_tokens, and malformed requests, on every route (issue 33 items 6 and 7) --------
HUGE = 10**12
CHAT = [{"role": "user", "content": "12+30"}]


# Each route that samples, as (path, body, headers, session): the body without max_tokens, and the
# kind of session it continues, opened just before it is used (the live worker gives a session back
# after IDLE_S idle, which a loaded machine can reach between requests).
ROUTES = [("/v1/generate", {"prompt": "12+30="}, None),
          ("/v1/chat/completions", {"messages": CHAT}, None),
          ("/v1/completions", {"prompt": "12+30="}, None),
          ("/v1/sessions/{sid}/turn", {}, "plain"),
          ("/v1/chat/completions", {"messages": CHAT}, "chat"),
          ("/v1/completions", {"prompt": "1"}, "plain")]


def on_a_session(live, path: str, kind: str | None) -> tuple[str, dict, str | None]:
    """``path`` and the headers to send to it, on a new session of ``kind`` (None: stateless)."""
    if kind is None:
        return path, {}, None
    prompt = {"messages": CHAT} if kind == "chat" else {"prompt_token_ids": [1, 5, 14, 5, 17]}
    sid = post(live, "/v1/sessions", prompt).json()["session_id"]
    return (path.format(sid=sid), {}, sid) if "{sid}" in path else (path, {"X-Session-Id": sid}, sid)


def test_max_tokens_beyond_a_limit_is_refused_alike_on_every_route(live):
    """rollout.max_new_tokens is 8, the model length 64, rollout.session_max_tokens 48. A
    max_tokens of 10**12 was a 422 on /v1/generate and a 200 cut to the room on
    /v1/chat/completions; now every route refuses it with a 422 naming the field it came in
    (OpenAI's max_completion_tokens too), and so one within max_new_tokens but beyond the room
    the prompt leaves. Left out, each route samples."""
    for template, body, kind in ROUTES:
        path, headers, sid = on_a_session(live, template, kind)
        try:
            for field in ("max_tokens", "max_completion_tokens") if "completions" in path else ("max_tokens",):
                resp = post(live, path, {**body, field: HUGE}, headers=headers)
                assert resp.status_code == 422, (path, field, resp.text)
                assert resp.json()["detail"][0]["loc"] == ["body", field], (path, field, resp.text)
            resp = post(live, path, {**body, "max_tokens": 2, "temperature": 1.0}, headers=headers)
            assert resp.status_code == 200, (path, resp.text)
        finally:
            if sid:
                post(live, f"/v1/sessions/{sid}/finish")
    # Within max_new_tokens, beyond the room the prompt leaves in the model length (64); /v1/generate
    # cannot get there, its prompts being within rollout.max_prompt_tokens (48).
    long = "1+" * 30  # 60 characters: 61 or 62 ids with <bos> and the generation prompt
    for path, body in (("/v1/completions", {"prompt": long}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]})):
        resp = post(live, path, {**body, "max_tokens": 8})
        assert resp.status_code == 422 and resp.json()["detail"][0]["loc"] == ["body", "max_tokens"], resp.text
        assert "tokens left in the model length 64" in resp.json()["detail"][0]["msg"], resp.text
    left_out = post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": long}]})
    assert left_out.status_code == 200 and 1 <= len(left_out.json()["choices"][0]["token_ids"]) <= 2


def test_malformed_requests_are_refused_naming_what_is_wrong_on_every_route(live):
    """A body that is not JSON is a 400 (docs/rollout.md's rule; it was a 422); a min_tokens above
    the max_tokens sampled with names min_tokens (it named ["body", "sampling"]); a content part
    whose text is not a string is a 422 naming it (it was rendered as its Python repr)."""
    for path in ("/v1/generate", "/v1/sessions", "/v1/sessions/any/turn", "/v1/sessions/any/finish",
                 "/v1/chat/completions", "/v1/completions"):  # the body is read before the session is looked up
        resp = httpx.post(f"{live}{path}", content=b'{"prompt": "1+1=", ', timeout=60,
                          headers={**AUTH, "content-type": "application/json"})
        assert resp.status_code == 400 and "not JSON" in resp.json()["detail"], (path, resp.text)
    for template, body, kind in (("/v1/chat/completions", {"messages": CHAT, "min_tokens": 9}, None),
                                 ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 2,
                                                           "min_tokens": 3}, None),
                                 ("/v1/completions", {"prompt": "1+1=", "min_tokens": 9}, None),
                                 ("/v1/sessions/{sid}/turn", {"min_tokens": 9}, "chat"),
                                 ("/v1/chat/completions", {"messages": CHAT, "min_tokens": 9}, "chat")):
        path, headers, sid = on_a_session(live, template, kind)
        resp = post(live, path, body, headers=headers)
        if sid:
            post(live, f"/v1/sessions/{sid}/finish")
        assert resp.status_code == 422 and resp.json()["detail"][0]["loc"] == ["body", "min_tokens"], resp.text
    for part in ({"type": "text", "text": 12}, {"type": "text", "text": ["12"]}, {"type": "text"},
                 {"type": "image_url", "image_url": {"url": "http://x/y.png"}}):
        message = {"role": "user", "content": [part]}
        for path in ("/v1/chat/completions", "/v1/sessions"):
            resp = post(live, path, {"messages": [message]})
            assert resp.status_code == 422, (path, part, resp.text)
            assert any("content" in map(str, e["loc"]) for e in resp.json()["detail"]), resp.text
    parts = [{"type": "text", "text": "12"}, {"type": "text", "text": "+30"}]
    ok = post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}], "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["prompt_token_ids"] == toy_ids("<bos>12+30="), ok.text


# -- lone surrogates, deep nesting and junk (issue 33 item 16) --------------------------------------
LONE = '"\\ud800"'  # JSON's escape for a lone surrogate: json.loads takes it, UTF-8 has no encoding for it
DEEP = '{"a":' * 300 + "1" + "}" * 300


def raw_post(base: str, path: str, body: str, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{base}{path}", content=body.encode(), timeout=60,
                      headers={**AUTH, "content-type": "application/json", **(headers or {})})


def test_lone_surrogates_and_deep_nesting_are_422s_naming_the_field_and_a_failed_finish_keeps_the_episode(live):
    """A lone surrogate in ``model``, ``session_id``, a content part, a message's extra key or
    ``tools``, and a ``reward_info`` with one, with NaN or nested 300 deep, each got a 500 (the
    answer could not be rendered) or was kept to break a template later; now each is a 422
    naming the field. A finish refused so keeps the session: a corrected one gets the episode
    (it was given back before the answer failed, and the corrected finish got 404)."""
    chat, part = '[{"role":"user","content":"12+30"}]', '[{"role":"user","content":[{"type":"text","text":%s}]}]'
    cases = [("/v1/chat/completions", '{"model":%s,"messages":%s}' % (LONE, chat), "model"),
             ("/v1/completions", '{"model":%s,"prompt":"1"}' % LONE, "model"),
             ("/v1/chat/completions", '{"session_id":%s,"messages":%s}' % (LONE, chat), "session_id"),
             ("/v1/completions", '{"session_id":%s,"prompt":"1"}' % LONE, "session_id")]
    for path in ("/v1/chat/completions", "/v1/sessions"):
        cases += [(path, '{"messages":%s}' % (part % LONE), "content"),
                  (path, '{"messages":[{"role":"user","content":"1","name":%s}]}' % LONE, "name"),
                  (path, '{"messages":%s,"tools":[{"function":{"description":%s}}]}' % (chat, LONE), "tools"),
                  (path, '{"messages":%s,"tools":[%s]}' % (chat, DEEP), "tools")]
    for path, body, field in cases:
        resp = raw_post(live, path, body)
        assert resp.status_code == 422, (path, body[:80], resp.text)
        assert any(field in map(str, e["loc"]) for e in resp.json()["detail"]), (path, body[:80], resp.text)
    path, headers, sid = on_a_session(live, "/v1/sessions/{sid}/turn", "chat")
    resp = raw_post(live, path, '{"message":{"role":"tool","content":"5","tool_call_id":%s}}' % LONE)
    assert resp.status_code == 422 and resp.json()["detail"][0]["loc"][-1] == "tool_call_id", resp.text
    for info in ('{"a":%s}' % LONE, '{%s:1}' % LONE, DEEP, '{"a":NaN}'):
        resp = raw_post(live, f"/v1/sessions/{sid}/finish", '{"reward":1.0,"reward_info":%s}' % info)
        assert resp.status_code == 422 and resp.json()["detail"][0]["loc"] == ["body", "reward_info"], resp.text
    episode = post(live, f"/v1/sessions/{sid}/finish", {"reward": 1.0, "reward_info": {"a": {"b": [1, "x"]}}})
    assert episode.status_code == 200, episode.text
    assert episode.json()["session_id"] == sid and episode.json()["reward_info"] == {"a": {"b": [1, "x"]}}


def junk_body(shape: str, size: int = 1 << 20) -> str:
    """A request of about ``size`` bytes, nearly all of it small arrays or objects in a free-form place."""
    junk = "[" + ",".join(["[]"] * ((size - 200) // 3)) + "]"
    if shape == "extra key":
        return '{"messages":[{"role":"user","content":"1","x":%s}]}' % junk
    if shape == "tools":
        return '{"messages":[{"role":"user","content":"1"}],"tools":%s}' % junk.replace("[]", "{}")
    return '{"messages":[{"role":"user","content":[{"type":"text","text":"1","x":%s}]}]}' % junk


def test_a_body_of_small_arrays_is_refused_before_it_is_parsed():
    """Parsed, 1 MiB of small arrays or objects costs some 20 times its size in Python objects
    (the worker took 50-200 MB per such request in a message's extra keys or in tools); now a
    body is counted before it is parsed, and one holding more than the API takes is a 413 at
    the cost of a few times its size."""
    import tracemalloc

    from fastapi import HTTPException

    from rollout_service.app import TextRequest

    limits = build_config({}, environ={}).rollout
    app = SimpleNamespace(state=SimpleNamespace(worker=SimpleNamespace(limits=limits)))
    for shape in ("extra key", "tools", "content part"):
        body = junk_body(shape).encode()

        async def receive(body=body):
            return {"type": "http.request", "body": body, "more_body": False}

        request = TextRequest({"type": "http", "method": "POST", "headers": [], "app": app}, receive)
        tracemalloc.start()
        try:
            with pytest.raises(HTTPException) as refused:
                asyncio.run(request.json())
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert refused.value.status_code == 413 and "arrays and objects" in refused.value.detail
        assert peak < 8 * len(body), (shape, peak)


def test_junk_in_extra_keys_and_tools_is_refused_and_text_is_not_counted(live):
    """On the worker: such bodies get 413 on every route that takes messages; brackets and commas
    inside strings are text, not counted (a reward_info note of 600 kB of them is read, and the
    unknown session is what is refused)."""
    for shape in ("extra key", "tools", "content part"):
        for path in ("/v1/chat/completions", "/v1/sessions"):
            resp = raw_post(live, path, junk_body(shape, 1 << 19))
            assert resp.status_code == 413 and "arrays and objects" in resp.json()["detail"], (shape, path, resp.text)
    note = "[{,\\\"" * 120_000
    resp = raw_post(live, "/v1/sessions/nope/finish", '{"reward_info":{"note":"%s"}}' % note)
    assert resp.status_code == 404, resp.text
