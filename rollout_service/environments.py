"""Environments: what answers the model between its turns in a multi-turn episode (the
agentic-sessions issue). An environment is reset on a prompt row, and stepped on each of
the model's turns; it returns an observation (a chat message the session appends, token
for token once), a reward and whether the episode is over:

    class MyEnv:
        def reset(self, prompt: Prompt) -> list[dict]: ...     # the opening chat messages
        def step(self, turn: str) -> EnvStep: ...               # after each model turn

A user's environment loads by import path (``"package.module:Class"``), like ``task.reward``;
the class is called with the prompt row's answer and returns a fresh environment per
episode. Steps run in a thread (an environment may call a sandbox or a service), bounded
by the caller.

Built in: :class:`CalculatorEnv`, a task that needs a tool. The model may write
``<calc>47*38</calc>``; the environment evaluates the expression (arithmetic only, parsed,
never ``eval``) and answers ``<result>1786</result>`` as a tool message; the first turn
without a call is the answer, scored 1 when its last number equals the reference. A turn
that is a bare expression (``47*38``, nothing else) is a call too, answered with the bare
value: the call syntax of a model that has no ``<`` to write, like the toy
(configs/toy-calculator.yaml).
"""

from __future__ import annotations

import ast
import importlib
import math
import operator
import re
from dataclasses import dataclass, field
from typing import Protocol

from rlpipe.arith import last_number
from rlpipe.config import ConfigError


@dataclass
class EnvStep:
    observation: dict | None  # a chat message ({"role": "tool", "content": ...}); None when done
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)  # plain values, for the sample's reward_info


class Environment(Protocol):
    def reset(self, prompt) -> list[dict]: ...

    def step(self, turn: str) -> EnvStep: ...


CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
BARE_CALL = re.compile(r"[\d\s.()]*\d[\s)]*[-+*/][\s(]*\d[\d\s.()+\-*/]*")  # an operator between numbers, nothing else
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64  # 2**64 is still quick; 9**9**9 is not
# An integer result's digits, bounded before it is computed: each power below MAX_EXPONENT is
# quick, but (((((9**64)**64)**64)**64)**64) has 6e9 digits and held the GIL for hours, where
# no timeout can stop it (issue 33 item 13). Python prints at most 4300 digits anyway.
MAX_DIGITS = 1000


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses), or
    ``error: <why>``: what a calculator shows, never an exception into the episode."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as e:
        return f"error: {type(e).__name__}" if not str(e) else f"error: {e}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value)


def _evaluate(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent over {MAX_EXPONENT}")
        if _result_digits(node.op, left, right) > MAX_DIGITS:
            raise ValueError(f"a result over {MAX_DIGITS} digits")
        return _OPS[type(node.op)](left, right)
    raise ValueError("only numbers and + - * / // % ** ( )")


def _digits(x) -> float:
    """About how many decimal digits an integer has (floats overflow instead: 0)."""
    return math.log10(abs(x)) if isinstance(x, int) and x else 0.0


def _result_digits(op: ast.operator, left, right) -> float:
    """The digits of ``left op right`` estimated from its operands', before computing it
    (a power: exponent * log10(base))."""
    if isinstance(op, ast.Pow):
        return right * _digits(left) if isinstance(right, int) and right > 0 else 0.0
    if isinstance(op, ast.Mult):
        return _digits(left) + _digits(right)
    return max(_digits(left), _digits(right)) + 1


class CalculatorEnv:
    """The built-in tool task (module docstring). ``max_calls`` bounds the calls in one
    episode; past it the episode ends with reward 0, as an answer never given."""

    INSTRUCTION = ("You may use a calculator: write <calc>expression</calc> and wait for its <result>. "
                   "When you know the answer, reply with the number alone.")

    def __init__(self, answer: str, max_calls: int = 3):
        self.answer, self.max_calls, self.calls = answer, max_calls, 0

    def reset(self, prompt) -> list[dict]:
        return [{"role": "system", "content": self.INSTRUCTION}, {"role": "user", "content": prompt.text}]

    def step(self, turn: str) -> EnvStep:
        expression, reply = call_in(turn)
        if expression is None:  # the answer
            reward = float(last_number(turn) is not None and last_number(turn) == last_number(self.answer))
            return EnvStep(None, reward, True, {"calls": self.calls})
        self.calls += 1
        if self.calls > self.max_calls:
            return EnvStep(None, 0.0, True, {"calls": self.calls, "over_calls": True})
        return EnvStep({"role": "tool", "content": reply.format(calculate(expression))}, 0.0, False,
                       {"calls": self.calls})


def call_in(turn: str) -> tuple[str | None, str]:
    """The calculator call in a model turn, and the form of its reply: ``<calc>expr</calc>``
    anywhere (answered ``<result>value</result>``), or a turn that is a bare expression
    (answered with the value alone); ``(None, "")`` for a turn without a call."""
    call = CALL.search(turn)
    if call is not None:
        return call.group(1), "<result>{}</result>"
    if BARE_CALL.fullmatch(turn.strip()):
        return turn.strip(), "{}"
    return None, ""


class RetryEnv:
    """The built-in multi-turn task without a tool (``task.environment: retry``): the
    environment says whether the answer is right, and a wrong one may be tried again, up
    to ``tries`` answers. The reward is 1 for a right answer at the first try, halved for
    each try after, and 0 when none was right. Its message, ``-``, fits the toy's
    vocabulary (configs/toy-retry.yaml)."""

    def __init__(self, answer: str, tries: int = 3):
        self.answer, self.tries, self.tried = last_number(answer), tries, 0

    def reset(self, prompt) -> list[dict]:
        return [{"role": "user", "content": prompt.text}]

    def step(self, turn: str) -> EnvStep:
        self.tried += 1
        if self.answer is not None and last_number(turn) == self.answer:
            return EnvStep(None, 0.5 ** (self.tried - 1), True, {"tries": self.tried})
        if self.tried >= self.tries:
            return EnvStep(None, 0.0, True, {"tries": self.tried})
        return EnvStep({"role": "tool", "content": "-"}, 0.0, False)


BUILT_IN = {"calculator": CalculatorEnv, "retry": RetryEnv}


def load_factory(path: str, built_in: dict, key: str):
    """The class or function ``path`` names: a built-in's name (a key of ``built_in``) or
    ``"package.module:Name"``; a failed import, or a name that is not callable, is a ConfigError
    naming the config ``key``."""
    if path in built_in:
        return built_in[path]
    module, _, name = path.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except Exception as e:
        raise ConfigError(f"{key}: cannot import {path!r}: {type(e).__name__}: {e}") from e
    if not callable(factory):
        raise ConfigError(f"{key}: {path!r} is a {type(factory).__name__}, not a class or function")
    return factory


def load_environment(path: str):
    """The environment factory named by ``path`` (``"package.module:Class"``, or
    a built-in's name, :data:`BUILT_IN`): called with a prompt row's answer, it returns a
    fresh environment for one episode. A failed import is a ConfigError naming the path."""
    return load_factory(path, BUILT_IN, "task.environment")
