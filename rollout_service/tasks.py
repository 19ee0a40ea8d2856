"""Tasks: a dataset of prompts plus a reward function, behind one small interface.

A task hands out the prompt for a dataset index (the index comes from the run's shared Redis cursor, so workers never
duplicate or skip a prompt; epochs wrap) and scores the group of responses sampled for it. Three kinds:

- ``arith``: the toy arithmetic task with an exact-match reward, or with ``task.arith_style: worked`` a shown working
  scored by its last number (rlpipe/arith.py);
- ``math``: a JSONL/Parquet file or a named public set (rlpipe/datasets.py), reward 1 when the response's answer
  equals the reference: its last ``\\boxed{}`` (math-verify), or for numeric answers the last boxed answer or else
  the last number; or a Python function named by ``task.reward``;
- ``remote``: such a dataset scored by an HTTP reward server, one POST per group.

``PromptEncoder`` turns a prompt's text into the token ids the engine is given and the record keeps, through the
tokenizer's chat template for instruct models (``task.chat_template``).

reward_info dicts hold only plain values (str, int, float, bool, None): they go into the msgpack trajectory record.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import os
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import httpx
import numpy as np

from rlpipe.arith import ArithmeticProblems
from rlpipe.config import ConfigError, TaskConfig
from rlpipe.datasets import (
    INSTRUCTIONS,
    Row,
    answer_kind,
    is_path,
    last_boxed,
    load_rows,
    shared_questions,
)
from rlpipe.schema import MAX_INFO_ENTRIES, info_problem, info_size_problem, reward_problem

TOKEN_ENV = "RLPIPE_VERIFIER_TOKEN"  # bearer token for the remote verifier, kept out of the (dumped) config
MATH_TIMEOUT_S = 2  # math-verify's per-parse and per-comparison limit (whole seconds: signal.alarm)
MAX_ANSWER_CHARS = 1000  # longer boxed answers score 0 unparsed: sympy time grows fast with size
MAX_ABANDONED = 8  # reward or environment calls left running past their limit, before calls are refused


@dataclass(frozen=True)
class Prompt:
    index: int  # the shared-cursor index this prompt was handed out for (any non-negative int; epochs wrap)
    prompt_id: str  # stable id of the dataset row (the row's id field, else its row number)
    text: str  # the prompt text to tokenize (after the template)
    answer: str  # reference answer ("" if none)
    meta: dict  # extra row fields passed to a remote verifier (may be empty)
    messages: tuple | None = None  # a chat row's messages, its last user turn ``text``; None: the text alone


class RewardError(RuntimeError):
    """Scoring failed (e.g. the remote verifier was unreachable after its retries). The loop gives the prompt back to
    the cursor instead of pushing a wrong reward."""


class RewardUnavailable(RewardError):
    """The reward or environment takes no calls now (too many abandoned ones still run): says
    nothing about the prompt, so it never counts toward dead-lettering it (rollout_service/loop.py)."""


class BadRewardResult(RewardError):
    """A reward or environment answered, with a result no record can take (an int key, a
    reward of 1e39). The same input would likely get it again, so the loop retries its prompt
    as one the engine failed on (skipped after failing twice on a worker), not for ever as
    one whose verifier was away: a few such prompts given back first every time would
    otherwise hold every place in flight."""


def checked_score(reward, info, where: str) -> tuple[float, dict | None]:
    """A reward function's ``(reward, info)`` as a record takes it, or a BadRewardResult naming
    what is wrong (the wire's rules, rlpipe/schema.py): a number within float32's range, an
    info of str keys and plain values. An info over the size bound is dropped for
    ``{"reward_info_dropped": why}``: the reward itself is good, and refusing it would stop a
    run whose reward only says too much."""
    problem = reward_problem(reward)
    if info is not None and not (isinstance(info, dict) and len(info) > MAX_INFO_ENTRIES):  # a huge one: not read
        problem = problem or info_problem(info)
    if problem:
        raise BadRewardResult(f"{where}: {problem}")
    too_big = info_size_problem(info) if info is not None else None
    return float(reward), {"reward_info_dropped": too_big} if too_big else info


class Abandoning:
    """Calls a blocking function in a fresh daemon thread, at most ``running`` at once, and
    waits ``timeout_s`` for it. A call that does not finish in time is abandoned, not waited
    on: Python cannot stop a thread, and in a pool a stuck call kept its thread, so two of
    them held a pool of two and every later call timed out behind them (issue 33 item 12).
    An abandoned thread is counted until it ends; with ``MAX_ABANDONED`` still running, calls
    are refused at once and :attr:`stuck` says why (the worker's /healthz reports it)."""

    def __init__(self, what: str, timeout_s: float, running: int, setting: str):
        self.what, self.timeout_s, self.setting = what, timeout_s, setting
        self.slots = asyncio.Semaphore(running)
        self.abandoned = 0
        self._lock = threading.Lock()

    @property
    def stuck(self) -> str | None:
        if self.abandoned < MAX_ABANDONED:
            return None
        return f"{self.what}: {self.abandoned} calls still running past {self.setting} ({self.timeout_s} s)"

    async def __call__(self, fn, *args):
        if self.stuck:
            raise RewardUnavailable(self.stuck)
        async with self.slots:
            done: Future = Future()

            def run():
                if not done.set_running_or_notify_cancel():
                    return  # given up on before it began
                try:
                    done.set_result(fn(*args))
                except BaseException as e:
                    done.set_exception(e)

            threading.Thread(target=run, name=f"{self.what}-call", daemon=True).start()
            try:
                return await asyncio.wait_for(asyncio.wrap_future(done), self.timeout_s)
            except asyncio.TimeoutError:
                self._abandon(done)
                raise RewardError(f"{self.what}: no result within {self.timeout_s} s ({self.setting})") from None
            except asyncio.CancelledError:
                self._abandon(done)
                raise

    def _abandon(self, done: Future) -> None:
        if done.cancel() or done.done():
            return
        with self._lock:
            self.abandoned += 1
        done.add_done_callback(self._ended)  # at once if it has just ended

    def _ended(self, _: Future) -> None:
        with self._lock:
            self.abandoned -= 1


class Task(Protocol):
    size: int  # rows per epoch

    def prompt(self, index: int) -> Prompt: ...

    async def score(self, prompt: Prompt, responses: list[str]) -> list[tuple[float, dict | None]]: ...

    async def aclose(self) -> None: ...


class ArithTask:
    """The toy task (``task.type: arith``) as a rollout task: rlpipe/arith.py's ``ArithmeticProblems`` in the
    toy's fixed order (the demo relies on it), scored by ``ArithmeticProblems.reward`` for ``task.arith_style``."""

    def __init__(self, cfg: TaskConfig):
        self.task = ArithmeticProblems(digits=cfg.digits, ops=cfg.ops, seed=cfg.seed, size=cfg.size,
                                       style=cfg.arith_style)
        self.size = cfg.size

    def prompt(self, index: int) -> Prompt:
        text, answer = self.task.problem(index)
        return Prompt(index=index, prompt_id=str(index % self.size), text=text, answer=answer, meta={})

    async def score(self, prompt: Prompt, responses: list[str]) -> list[tuple[float, dict | None]]:
        return [(self.task.reward(prompt.answer, r), None) for r in responses]

    async def aclose(self) -> None:
        pass


def answer_format(cfg: TaskConfig) -> str:
    """How responses are read: ``task.answer_format``, or with ``auto`` the dataset's kind (a file's: ``boxed``)."""
    return answer_kind(cfg.dataset) if cfg.answer_format == "auto" else cfg.answer_format


def instruction(cfg: TaskConfig) -> str:
    """``task.instruction``, else for a named dataset the one that asks for answers as they are read."""
    if cfg.instruction is not None:
        return cfg.instruction
    return "" if is_path(cfg.dataset) else INSTRUCTIONS[answer_format(cfg)]


def _with_last_user_turn(messages: tuple | None, text: str, cfg: TaskConfig, n: int) -> tuple | None:
    """A chat row's messages with its last user turn made ``text`` (task.template and task.instruction applied
    to it, as to a text prompt); a chat row needs the chat template to be rendered."""
    if messages is None:
        return None
    if not cfg.chat_template:
        raise ValueError(f"task.chat_template: {cfg.dataset}: row {n}'s prompt is a list of chat messages, which "
                         "only a chat template renders: set task.chat_template: true")
    return (*messages[:-1], {"role": "user", "content": text})


class DatasetTask:
    """Rows of a file in a fresh seeded order every epoch, so each row appears exactly once per epoch and any worker
    handed index ``i`` sees the same prompt."""

    def __init__(self, cfg: TaskConfig, need_answer: bool):
        named = not is_path(cfg.dataset)
        self.raw = load_rows(cfg.dataset, cfg.prompt_field, cfg.answer_field, cfg.id_field, need_answer)
        suffix = instruction(cfg)
        own = () if named else (cfg.prompt_field, cfg.answer_field, cfg.id_field)  # a name's rows keep every field
        self.rows = []
        for n, row in enumerate(self.raw):
            try:
                text = cfg.template.format(**{**row.raw, "prompt": row.question})
            except KeyError as e:
                raise ValueError(f"{cfg.dataset}: row {n}: task.template names field {e.args[0]!r}, which the row "
                                 "lacks") from None
            except (IndexError, ValueError) as e:
                raise ValueError(f"task.template: {e}") from None
            text = f"{text}\n{suffix}" if suffix else text
            self.rows.append((row.id, text, row.answer, {k: v for k, v in row.raw.items() if k not in own},
                              _with_last_user_turn(row.messages, text, cfg, n)))
        self.size = len(self.rows)
        self.seed, self.shuffle = cfg.seed, cfg.shuffle
        self._epoch, self._order = -1, None  # the permutation of the epoch last asked for

    def drop_questions_of(self, other: list[Row]) -> int:
        """Drop the rows whose question is also one of ``other``'s (``eval.drop_shared``: a held-out set
        that shares questions with the training set); returns how many were dropped."""
        shared = {id(e) for _, e in shared_questions(other, self.raw)}
        keep = [i for i, row in enumerate(self.raw) if id(row) not in shared]
        dropped = len(self.raw) - len(keep)
        self.raw, self.rows = [self.raw[i] for i in keep], [self.rows[i] for i in keep]
        self.size = len(self.rows)
        if not self.size:
            raise ValueError("every question of the held-out set is also in the training set")
        return dropped

    def _row(self, index: int) -> int:
        epoch, pos = divmod(index, self.size)
        if not self.shuffle:
            return pos
        if epoch != self._epoch:
            # numpy wants non-negative seed words; this leaves every non-negative seed unchanged.
            self._order = np.random.default_rng([self.seed & (2**64 - 1), epoch]).permutation(self.size)
            self._epoch = epoch
        return int(self._order[pos])

    def prompt(self, index: int) -> Prompt:
        prompt_id, text, answer, meta, messages = self.rows[self._row(index)]
        return Prompt(index=index, prompt_id=prompt_id, text=text, answer=answer, meta=dict(meta), messages=messages)

    async def aclose(self) -> None:
        pass


def _timeout() -> int | None:
    """math-verify times out with signal.alarm, which only the main thread may set (elsewhere it raises)."""
    return MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=4096)
def _parse_gold(answer: str, timeout: int | None) -> list:
    """The parsed reference answer, once per prompt. ``$...$`` makes bare LaTeX (``\\sqrt{2}/2``) parse."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    return parse(f"${answer}$", configs, parsing_timeout=timeout) or parse(answer, configs, parsing_timeout=timeout)


def math_reward(answer: str, response: str) -> tuple[float, dict]:
    """1.0 when the response's last boxed answer is mathematically equal to ``answer``, else 0.0; never raises."""
    boxed = last_boxed(response)
    if boxed is None:
        return 0.0, {"extracted": "", "format_ok": False}
    return _verify(answer, boxed)


def _verify(answer: str, boxed: str) -> tuple[float, dict]:
    """math-verify's verdict on ``boxed`` (a boxed answer's content, or a number) against ``answer``."""
    if len(boxed) > MAX_ANSWER_CHARS:
        return 0.0, {"extracted": "", "format_ok": True, "error": "boxed answer too long"}
    try:
        from math_verify import LatexExtractionConfig, parse, verify

        timeout = _timeout()
        gold = _parse_gold(answer, timeout)
        # Only the last box is parsed: given the whole text, math-verify reads several boxes as one set.
        parsed = parse("\\boxed{" + boxed + "}", [LatexExtractionConfig(boxed_match_priority=0)], parsing_timeout=timeout)
        ok = bool(gold and parsed) and verify(gold, parsed, timeout_seconds=timeout)
    except Exception as e:
        return 0.0, {"extracted": "", "format_ok": False, "error": repr(e)[:200]}
    info = {"extracted": str(parsed[0])[:200] if parsed else "", "format_ok": True}
    if not gold:
        info["error"] = "reference answer does not parse"
    return float(ok), info


# A number as written in free text: "1,234.5", "-3", "0.75". A "-" is its sign only where no word character or
# closing bracket precedes it (in "4-3" the last number is 3, as in rlpipe.arith.last_number).
_NUMBER = re.compile(r"(?:(?<![\w)\]])-)?(?<![\d.,])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def _as_number(text: str) -> float | None:
    """``text`` as a float when it is a plain number ("1,000", "$18", "5.0", "18."), else None."""
    text = text.strip().replace(",", "").removeprefix("\\$").removeprefix("$").rstrip(".")
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def number_reward(answer: str, response: str) -> tuple[float, dict]:
    """For numeric answers (``task.answer_format: number``): the response's answer is its last ``\\boxed{}`` if it
    has one, else its last number; 1.0 when that equals ``answer`` as a number (``1,000`` = ``1000``, ``5.0`` =
    ``5``, relative tolerance 1e-6), a boxed expression (``\\frac{1}{2}``) or a non-numeric reference by
    math-verify; 0.0 when there is no number. Never raises. ``extracted`` is the answer as written, ``boxed`` says
    where it came from."""
    boxed = last_boxed(response)
    text = boxed
    if boxed is None:
        for found in _NUMBER.finditer(response):
            text = found.group()
        if text is None:
            return 0.0, {"extracted": "", "format_ok": False, "boxed": False}
    got, gold = _as_number(text), _as_number(answer)
    if got is None or gold is None:
        reward, info = _verify(answer, text if boxed is not None else text.replace(",", ""))
        return reward, {**info, "extracted": text[:200], "boxed": boxed is not None}
    ok = abs(got - gold) <= 1e-6 * max(1.0, abs(gold))
    return float(ok), {"extracted": text[:200], "format_ok": True, "boxed": boxed is not None}


def any_number_matches(answer: str, response: str) -> bool:
    """Lenient scoring: any number written in ``response`` equals ``answer`` (the strict
    reward reads the last one only). Side by side with the strict score it shows how much
    of an accuracy is the answer's format and how much its arithmetic."""
    gold = _as_number(answer)
    if gold is None:
        return False
    return any((got := _as_number(m.group())) is not None and abs(got - gold) <= 1e-6 * max(1.0, abs(gold))
               for m in _NUMBER.finditer(response))


class PythonReward:
    """``task.reward: "package.module:function"``, a reward written in Python, called as

        function(prompt: str, response: str, answer: str, row: dict) -> float | tuple[float, dict]

    with the prompt text (after template and instruction), one decoded response, the reference answer ("" when the
    row has none) and a copy of the dataset row as read. The reward must lie within +-1e30 (the learner computes in
    float32). The dict, if returned, is the sample's reward_info: str keys, plain values only (str, int, float,
    bool, None), at most 64 entries and 4 KiB (a bigger one is dropped, ``reward_info_dropped`` says why).

    The function is imported once, when the task is made; a failed import is a ConfigError naming the path. Each
    call runs in a thread of its own (:class:`Abandoning`, so a slow reward never holds the threads that push to
    Redis), two at a time, and must return within ``task.reward_timeout_s``. A timeout, an exception or a malformed
    result is a RewardError for the whole group, never a made-up 0: the rollout loop logs it, counts it
    (``rlpipe_rollout_reward_errors_total``) and gives the prompt back, as for a remote verifier that is down. A
    call that timed out cannot be stopped; it is abandoned, its thread finishes in the background."""

    def __init__(self, path: str, timeout_s: float):
        module, _, name = path.partition(":")
        try:
            self.fn = getattr(importlib.import_module(module), name)
        except Exception as e:
            raise ConfigError(f"task.reward: cannot import {path!r}: {type(e).__name__}: {e}") from e
        if not callable(self.fn):
            raise ConfigError(f"task.reward: {path!r} is a {type(self.fn).__name__}, not a function")
        self.path, self.timeout_s = path, timeout_s
        self.calls = Abandoning(f"task.reward {path}", timeout_s, 2, "task.reward_timeout_s")

    async def __call__(self, prompt: str, response: str, answer: str, row: dict) -> tuple[float, dict | None]:
        try:
            out = await self.calls(self.fn, prompt, response, answer, dict(row))
        except RewardError:
            raise
        except Exception as e:
            raise RewardError(f"task.reward {self.path} raised {type(e).__name__}: {e}") from e
        reward, info = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
        return checked_score(reward, info, f"task.reward {self.path}")

    @property
    def stuck(self) -> str | None:
        return self.calls.stuck

    def close(self) -> None:
        pass  # an abandoned call's daemon thread ends with it, or with the process


class MathTask(DatasetTask):
    """A math dataset. Scored by math-verify on the last boxed answer (``task.answer_format: boxed``), by the last
    boxed answer or else the last number (``number``), or by a Python function (``task.reward``)."""

    def __init__(self, cfg: TaskConfig):
        super().__init__(cfg, need_answer=not cfg.reward)
        self.reward = PythonReward(cfg.reward, cfg.reward_timeout_s) if cfg.reward else None
        self.read = number_reward if answer_format(cfg) == "number" else math_reward

    async def score(self, prompt: Prompt, responses: list[str]) -> list[tuple[float, dict | None]]:
        if self.reward is None:
            return [self.read(prompt.answer, r) for r in responses]
        row = self.raw[self._row(prompt.index)].raw
        return [await self.reward(prompt.text, r, prompt.answer, row) for r in responses]

    @property
    def stuck(self) -> str | None:
        """Why scoring cannot go on (its reward's calls are stuck), or None."""
        return self.reward.stuck if self.reward is not None else None

    async def aclose(self) -> None:
        if self.reward is not None:
            self.reward.close()


class RemoteTask(DatasetTask):
    """A dataset scored by an HTTP reward server (one POST per group), retried on transient failures only."""

    def __init__(self, cfg: TaskConfig):
        super().__init__(cfg, need_answer=False)
        self.url, self.timeout_s = cfg.verifier_url, cfg.verifier_timeout_s
        self.retries, self.backoff_s = cfg.verifier_retries, cfg.verifier_backoff_s
        self._client: httpx.AsyncClient | None = None

    async def score(self, prompt: Prompt, responses: list[str]) -> list[tuple[float, dict | None]]:
        body = {"prompt_id": prompt.prompt_id, "prompt": prompt.text, "answer": prompt.answer, "meta": prompt.meta,
                "responses": list(responses)}
        return self._check(await self._post(body), len(responses))

    async def _post(self, body: dict):
        if self._client is None:
            token = os.environ.get(TOKEN_ENV)
            headers = {"Content-Type": "application/json"}
            if token:
                headers["Authorization"] = f"Bearer {token}"
            self._client = httpx.AsyncClient(timeout=self.timeout_s, headers=headers)
        content = json.dumps(body, default=str)  # default=str: Parquet dates and the like in meta
        reason = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                resp = await self._client.post(self.url, content=content)
            except httpx.TransportError as e:  # connection errors and timeouts
                reason = f"{type(e).__name__} {e}".strip()
                continue
            if resp.status_code == 429 or resp.status_code >= 500:
                reason = f"HTTP {resp.status_code}"
                continue
            if not resp.is_success:
                raise RewardError(f"verifier {self.url}: HTTP {resp.status_code}: {resp.text[:200]!r}")
            try:
                return resp.json()
            except ValueError:
                raise RewardError(f"verifier {self.url}: response is not JSON: {resp.text[:200]!r}") from None
        raise RewardError(f"verifier {self.url}: gave up after {self.retries + 1} attempts, last: {reason}")

    def _check(self, data, n: int) -> list[tuple[float, dict | None]]:
        """Reject a malformed reply rather than push made-up rewards."""
        where = f"verifier {self.url}"
        rewards = data.get("rewards") if isinstance(data, dict) else None
        infos = data.get("infos") if isinstance(data, dict) else None
        if not isinstance(rewards, list) or len(rewards) != n:
            raise RewardError(f"{where}: expected 'rewards' to be a list of {n} numbers, got {str(rewards)[:200]}")
        infos = [None] * n if infos is None else infos
        if not isinstance(infos, list) or len(infos) != n:
            raise RewardError(f"{where}: expected 'infos' to be a list of {n} objects or nulls, got {str(infos)[:200]}")
        return [checked_score(reward, info, where) for reward, info in zip(rewards, infos)]

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class PromptEncoder:
    """The token ids of a prompt's text: exactly what the engine is given and the record keeps (``prompt_tokens``).

    Plain (``task.chat_template: false``): ``tokenizer(text)``, with the tokenizer's own special tokens (the toy's
    ``<bos>``). Chat: the text (after ``task.template``) is the user turn, after a system turn when
    ``task.system_prompt`` is set, and the ids are ``apply_chat_template(messages, add_generation_prompt=True,
    tokenize=True)`` taken as they are: transformers tokenizes the rendered string with ``add_special_tokens=False``,
    so the BOS and turn markers are the template's own and nothing is added twice (tokenizing the rendered string
    again with special tokens would put a second BOS in front of a template that writes ``{{ bos_token }}``).
    A chat row (``Prompt.messages``: TRL's conversational format, verl's ``prompt`` column) is rendered as it is,
    its last user turn the formatted text. The reward still reads ``Prompt.text``: a remote verifier gets the
    formatted text, not the rendered chat.

    A tokenizer without a chat template is refused when the encoder is made (at worker start, before the engine),
    with a ConfigError naming ``task.chat_template``.
    """

    def __init__(self, cfg: TaskConfig, tokenizer, source: str = "the model"):
        self.tokenizer = tokenizer
        self.chat, self.system_prompt = cfg.chat_template, cfg.system_prompt
        if self.chat and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"task.chat_template: the tokenizer of {source} has no chat template (a base model? "
                              "set task.chat_template: false, or use a model whose tokenizer_config.json or "
                              "chat_template.jinja has one)")

    def messages(self, text: str, row_messages: tuple | None = None) -> list[dict]:
        """The chat rendered: a chat row's own messages (``Prompt.messages``), else ``text`` as the user turn;
        after ``task.system_prompt`` unless the row has a system turn of its own."""
        turns = list(row_messages) if row_messages else [{"role": "user", "content": text}]
        own_system = turns[0]["role"] == "system"
        return ([{"role": "system", "content": self.system_prompt}] if self.system_prompt and not own_system
                else []) + turns

    def __call__(self, text: str, row_messages: tuple | None = None) -> list[int]:
        if not self.chat:
            return list(self.tokenizer(text)["input_ids"])
        ids = self.tokenizer.apply_chat_template(self.messages(text, row_messages), add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        return [int(i) for i in ids]


def eval_task_config(cfg: TaskConfig, dataset: str) -> TaskConfig:
    """The task of a held-out evaluation: the training task's settings on ``dataset``, rows in file order."""
    return cfg.model_copy(update={"dataset": dataset, "shuffle": False})


def make_task(cfg: TaskConfig) -> Task:
    kinds = {"arith": ArithTask, "math": MathTask, "remote": RemoteTask}
    if cfg.type not in kinds:
        raise ValueError(f"task.type: unknown task {cfg.type!r}")
    return kinds[cfg.type](cfg)
