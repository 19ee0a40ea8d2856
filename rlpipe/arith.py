"""The toy task: small-number arithmetic (``"37+45="`` -> ``"82"``) and its reward.

A task definition only (standard library), so the rollout workers' task code and the
config's checks use it without the toy model builder (launch/toy.py), which warm-starts
its model on these problems. :class:`ArithmeticProblems` holds the problems and the
reward; the rollout workers' task over them (prompts, scoring) is
``rollout_service.tasks.ArithTask``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

ARITH_STYLES = ("answer", "worked")


@dataclass(frozen=True)
class ArithmeticProblems:
    """A fixed, seeded list of ``size`` problems ``a<op>b=`` with operands below 10**digits.

    Problem ``i`` is a pure function of ``(seed, i % size)``: every worker that is handed
    index ``i`` by the shared cursor sees the same prompt, and epochs wrap.

    ``style`` is what a response looks like. ``answer``: just the answer, exact match, so a
    response is at most a few tokens. ``worked``: the response may show its work (column by
    column for ``+``/``-``, partial products for ``*``: ``47+38=`` -> ``7+8=15 4+3+1=8 85``)
    and the reward reads only the last number, so response length is free to grow (seed 001's
    length surge needs room to happen; a degenerate policy can babble and still end right).
    """

    digits: int = 2
    ops: str = "+"
    seed: int = 0
    size: int = 4096
    style: str = "answer"

    def __post_init__(self):
        if self.style not in ARITH_STYLES:
            raise ValueError(f"arith style {self.style!r}: one of {', '.join(ARITH_STYLES)}")

    def operands(self, index: int) -> tuple[int, str, int]:
        """``(a, op, b)`` of dataset index ``index``."""
        rng = random.Random(f"arith:{self.seed}:{index % self.size}")
        hi = 10**self.digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        op = self.ops[rng.randrange(len(self.ops))]
        if op == "-" and b > a:
            a, b = b, a  # keep answers non-negative
        return a, op, b

    def problem(self, index: int) -> tuple[str, str]:
        """Return ``(prompt, answer)`` for dataset index ``index``."""
        a, op, b = self.operands(index)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return f"{a}{op}{b}=", str(value)

    def target(self, index: int) -> str:
        """The response a correct policy writes for index ``index`` (the warm start trains on it)."""
        a, op, b = self.operands(index)
        answer = self.problem(index)[1]
        return answer if self.style == "answer" else " ".join([*worked_steps(a, op, b), answer])

    def max_target_chars(self) -> int:
        """The longest target over the dataset: the response length a run must allow."""
        return max(len(self.target(i)) for i in range(self.size))

    def reward(self, answer: str, response: str) -> float:
        """``answer``: 1.0 for an exact match of the response text. ``worked``: 1.0 when the
        last number in the response equals the answer. Else 0.0."""
        if self.style == "answer":
            return 1.0 if response.strip() == answer else 0.0
        return 1.0 if last_number(response) == answer else 0.0


def worked_steps(a: int, op: str, b: int) -> list[str]:
    """The working for ``a op b``, written in the tokenizer's alphabet (digits, ``+-*=``, space).

    ``+``: each column from the right, with the carry (``7+8=15 4+3+1=8``). ``-``: each column
    with the borrow taken from the next (``17-8=9 3-3=0``). ``*``: the partial product of each
    digit of ``b`` (``47*8=376 47*30=1410``).
    """
    if op == "*":
        return [f"{a}*{int(d) * 10**i}={a * int(d) * 10**i}" for i, d in enumerate(reversed(str(b)))]
    width = max(len(str(a)), len(str(b)))
    xs, ys = str(a).zfill(width)[::-1], str(b).zfill(width)[::-1]
    steps, carry = [], 0
    for x, y in zip(map(int, xs), map(int, ys)):
        if op == "+":
            total = x + y + carry
            steps.append(f"{x}+{y}{'+1' if carry else ''}={total}")
            carry = total // 10
        else:
            top = x - carry
            carry = int(top < y)
            top += 10 * carry
            steps.append(f"{top}-{y}={top - y}")
    return steps


_NUMBER = re.compile(r"(?<![0-9])-?[0-9]+")


def last_number(text: str) -> str | None:
    """The last number in ``text`` as written, canonical (``007`` -> ``7``), or None when there
    is none. A ``-`` counts as its sign only where no digit precedes it: in ``4-3`` the last
    number is ``3``, in ``4 -3`` it is ``-3``."""
    match = None
    for match in _NUMBER.finditer(text):
        pass
    return None if match is None else str(int(match.group()))
