"""In-turn tools (``task.tool``): a tool whose output is written into the model's own message.

A model that was never taught a call syntax rarely starts one (a 135M model told it may write
``<calc>45*4</calc>`` did so in 3 of 475 greedy answers), but it writes equations all the time:
"The total bill was 45 * 4 = 190 dollars". An in-turn tool meets it there. Generation pauses at
one of the tool's stop strings; the tool reads the message so far and may write text after it
(" 180"); generation goes on from there, in the same message, up to ``max_calls`` times.

What the tool writes is environment tokens: tokenized once, when written, appended to the ids
the engine continues from, and kept in the sample token for token with mask 0 and no behaviour
log-prob, so the learner trains on exactly the ids the engine saw and never on the tool's.
Each pause is a new engine request on every id so far (vLLM's prefix cache keeps the repeat
prefill cheap); weight updates that land between them show in the per-token versions.

A tool is a class with ``stop`` (the strings that pause generation) and ``write(text) -> str |
None`` (the text to append after the message so far, which ends at a stop string; None: nothing,
go on). One is made per answer. The built-in ``calculator`` is :class:`InlineCalculator`; a
user's loads by import path, ``"package.module:Class"`` (called with no arguments).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

import numpy as np

from rollout_service.environments import calculate, load_factory

# The arithmetic an expression may hold: digits, a decimal point, + - * /, brackets, spaces, and
# commas that group thousands (1,200).
EXPRESSION_CHARS = re.compile(r"[\d.,+\-*/() \t]*$")
THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
PLAIN_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div)


def trailing_expression(text: str) -> str | None:
    """The arithmetic expression ``text`` ends with (``text`` itself ends at the ``=`` it is
    followed by, which is not part of it), or None: the longest suffix of arithmetic
    characters that parses as a sum, difference, product or quotient of numbers (a bare number
    is not a calculation). Thousands separators are dropped first ("1,200" reads 1200)."""
    tail = EXPRESSION_CHARS.search(text).group(0)
    for start in range(len(tail)):
        candidate = THOUSANDS.sub("", tail[start:]).strip()
        if not candidate or not (candidate[0].isdigit() or candidate[0] in "(-."):
            continue
        try:
            node = ast.parse(candidate, mode="eval").body
        except SyntaxError:
            continue
        if _plain_arithmetic(node) and isinstance(node, ast.BinOp):
            return candidate
    return None


def _plain_arithmetic(node) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, (ast.USub, ast.UAdd)) and _plain_arithmetic(node.operand)
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, PLAIN_OPS) and _plain_arithmetic(node.left) and _plain_arithmetic(node.right)
    return False


def format_value(value: str) -> str | None:
    """A calculator value as the tool writes it: an integer as is, else rounded to at most 4
    decimal places with trailing zeros dropped (10/4 -> 2.5, 10/3 -> 3.3333); None for an error."""
    if value.startswith("error"):
        return None
    number = float(value)
    if number.is_integer():
        return str(int(number))
    return f"{number:.4f}".rstrip("0").rstrip(".")


class InlineCalculator:
    """The built-in in-turn calculator (``task.tool: calculator``): generation pauses at ``=``;
    when the message before it ends in an arithmetic expression (:func:`trailing_expression`), its
    value (:func:`format_value`) is written after the ``=``, led by a space unless the message
    already ends in one. At most ``max_calls`` values an answer; after that ``=`` no longer pauses."""

    stop = ("=",)

    def __init__(self, max_calls: int = 6):
        self.max_calls, self.calls = max_calls, 0

    def write(self, text: str) -> str | None:
        body = text.rstrip()
        if not body.endswith("="):
            return None
        expression = trailing_expression(body[:-1])
        value = format_value(calculate(expression)) if expression else None
        if value is None:
            return None
        self.calls += 1
        return ("" if text != body or text.endswith(" ") else " ") + value


BUILT_IN = {"calculator": InlineCalculator}


def load_tool(path: str):
    """The tool factory ``task.tool`` names (a built-in's name or ``"package.module:Class"``), or
    a ConfigError naming the key."""
    return load_factory(path, BUILT_IN, "task.tool")


@dataclass
class ToolAnswer:
    """One answer written with an in-turn tool: the engine's tokens and the tool's, in order."""

    tokens: np.ndarray  # (L,) int32
    logprobs: np.ndarray  # (L,) float32, 0 on the tool's tokens
    mask: np.ndarray  # (L,) uint8: 1 sampled, 0 written by the tool
    versions: np.ndarray  # (L,) int32: the weights each token was sampled under (the tool's: the engine's then)
    finish_reason: str
    calls: int  # values the tool wrote
    v0: int
    v1: int


async def answer_with_tool(engine, tokenizer, prompt_ids: list[int], tool, max_tokens: int, seed: int | None,
                           **sampling) -> ToolAnswer:
    """Sample one answer to ``prompt_ids``, pausing at the tool's stop strings for it to write
    (module docstring). ``max_tokens`` bounds the answer's tokens, the tool's included."""
    tokens, logprobs, mask, versions = [], [], [], []
    special = set(tokenizer.all_special_ids)
    finish, v_first, v_last, pause, salt = "length", None, None, 0, None
    while len(tokens) < max_tokens:
        stop = list(tool.stop) if getattr(tool, "calls", 0) < getattr(tool, "max_calls", 1 << 30) else None
        results, v0, v1 = await engine.generate(prompt_ids + tokens, n=1, max_tokens=max_tokens - len(tokens),
                                                seed=None if seed is None else (seed + pause) % 2**31, stop=stop,
                                                cache_salt=salt, **sampling)
        res, pause = results[0], pause + 1
        salt = salt or getattr(res, "cache_salt", None)  # each pause reads the answer's KV so far (prefix_cache.py)
        v_first, v_last = v0 if v_first is None else v_first, v1
        new = [int(t) for t in res.tokens]
        tokens += new
        logprobs += [float(x) for x in res.logprobs]
        mask += [1] * len(new)
        versions += [int(v) for v in res.versions] if res.versions is not None else [v0] * len(new)
        finish = res.finish_reason
        # A pause is a stop string's stop: an end-of-sequence token also stops with "stop".
        if finish != "stop" or not stop or not new or new[-1] in special:
            break
        written = tool.write(tokenizer.decode(tokens, skip_special_tokens=True))
        if written:
            ids = [int(i) for i in tokenizer(written, add_special_tokens=False)["input_ids"]]
            ids = ids[:max_tokens - len(tokens)]
            tokens += ids
            logprobs += [0.0] * len(ids)
            mask += [0] * len(ids)
            versions += [engine.version] * len(ids)
        finish = "length"  # unless a later request ends the answer
    return ToolAnswer(np.asarray(tokens, dtype=np.int32), np.asarray(logprobs, dtype=np.float32),
                      np.asarray(mask, dtype=np.uint8), np.asarray(versions, dtype=np.int32), finish,
                      getattr(tool, "calls", 0), v_first if v_first is not None else engine.version,
                      v_last if v_last is not None else engine.version)
