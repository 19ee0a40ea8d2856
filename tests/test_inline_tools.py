"""The in-turn calculator (rollout_service/inline_tools.py): what it reads and writes, and the
answer it builds: the engine's tokens exactly as sampled, the tool's as masked environment
tokens, every request continuing from every id so far."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from rlpipe.config import ConfigError
from rollout_service.inline_tools import InlineCalculator, answer_with_tool, format_value, load_tool, \
    trailing_expression


@pytest.mark.parametrize("text, expression", [
    ("The total bill was 45 * 4 ", "45 * 4"),
    ("costs $45*4", "45*4"),
    ("he had 1,200 + 5 ", "1200 + 5"),
    ("so (3 + 4) * 2 ", "(3 + 4) * 2"),
    ("of (3 + 4 ", "3 + 4"),  # an unclosed bracket is not part of it
    ("3 apples. 12 - 2 ", "12 - 2"),  # a sentence's full stop is not part of it
    ("x ", None), ("5 ", None),  # no calculation
    ("2**10 ", None), ("7 % 2 ", None),  # not + - * /
])
def test_the_expression_before_the_equals_sign(text, expression):
    assert trailing_expression(text) == expression


def test_the_calculator_writes_values_after_an_equals_sign_and_counts_them():
    calc = InlineCalculator(max_calls=6)
    assert calc.write("The total bill was 45 * 4 =") == " 180"
    assert calc.write("then 7 - 2 = ") == "5"  # already spaced
    assert calc.write("10 / 3 =") == " 3.3333"
    assert calc.write("x =") is None and calc.write("3 / 0 =") is None and calc.write("no sign") is None
    assert calc.calls == 3
    assert [format_value(v) for v in ("12", "2.5", "2.50000", "error: x")] == ["12", "2.5", "2.5", None]


def test_a_tool_path_that_does_not_import_names_the_key():
    assert load_tool("calculator") is InlineCalculator
    with pytest.raises(ConfigError, match="task.tool"):
        load_tool("nosuchmodule:Tool")


class CharTokenizer:
    """One id per character; id 0 is the end-of-sequence token."""

    all_special_ids = [0]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


class ScriptedEngine:
    """Continues a prompt with scripted text: stops after a stop string as vLLM does (the token
    that completes it is the last one), or at max_tokens, else ends with end-of-sequence."""

    def __init__(self, script: list[str]):
        self.script, self.calls, self.version = list(script), [], 3

    async def generate(self, ids, n, max_tokens, seed=None, stop=None, **sampling):
        self.calls.append((list(ids), stop, max_tokens, seed))
        text = self.script.pop(0)
        tokens = [ord(c) for c in text][:max_tokens]
        cut = min((text.index(s) + len(s) for s in stop or () if s in text), default=None)
        if cut is not None and cut <= max_tokens:
            tokens, finish = tokens[:cut], "stop"
        elif len(text) < max_tokens:
            tokens, finish = tokens + [0], "stop"
        else:
            finish = "length"
        result = SimpleNamespace(tokens=np.asarray(tokens), logprobs=np.full(len(tokens), -0.5), versions=None,
                                 finish_reason=finish)
        return [result], self.version, self.version


def run(coro):
    return asyncio.run(coro)


def test_an_answer_keeps_the_sampled_tokens_and_masks_the_written_ones():
    engine = ScriptedEngine(["It is 45 * 4 = and more", " dollars, 2 + 3 = and", " so 185."])
    prompt = [ord(c) for c in "Q:"]
    a = run(answer_with_tool(engine, CharTokenizer(), prompt, InlineCalculator(), 64, seed=10, temperature=0.5))
    text = CharTokenizer().decode(a.tokens)
    assert text == "It is 45 * 4 = 180 dollars, 2 + 3 = 5 so 185."
    written = "".join(chr(t) for t, m in zip(a.tokens, a.mask) if not m)
    assert written == " 180 5"
    assert (a.logprobs[a.mask == 0] == 0).all() and (a.logprobs[a.mask == 1] == -0.5).all()
    assert a.calls == 2 and a.finish_reason == "stop" and a.tokens[-1] == 0
    # Each request continued from every id so far, the tool's included, with its own seed.
    so_far = prompt + [ord(c) for c in "It is 45 * 4 = 180"]
    assert engine.calls[1][0] == so_far and engine.calls[1][1] == ["="]
    assert [c[3] for c in engine.calls] == [10, 11, 12]
    assert sum(c[2] for c in engine.calls[:1]) == 64 and engine.calls[1][2] == 64 - len("It is 45 * 4 = 180")


def test_an_answer_is_bounded_by_max_tokens_with_the_tools_tokens_counted():
    engine = ScriptedEngine(["1 + 1 =", "x" * 100])
    a = run(answer_with_tool(engine, CharTokenizer(), [1], InlineCalculator(), 12, seed=None, temperature=0.0))
    assert len(a.tokens) == 12 and a.finish_reason == "length"
    assert CharTokenizer().decode(a.tokens) == "1 + 1 = 2" + "xxx"


def test_past_its_calls_the_equals_sign_no_longer_pauses():
    engine = ScriptedEngine(["1 + 1 =", " and 2 + 2 = 4."])
    a = run(answer_with_tool(engine, CharTokenizer(), [1], InlineCalculator(max_calls=1), 64, seed=0,
                             temperature=0.0))
    assert engine.calls[1][1] is None and a.calls == 1
    assert CharTokenizer().decode(a.tokens) == "1 + 1 = 2 and 2 + 2 = 4."


def test_an_end_of_sequence_after_an_equals_sign_ends_the_answer():
    engine = ScriptedEngine(["so 3 + 4"])  # ends with <eos> (id 0), never pauses
    a = run(answer_with_tool(engine, CharTokenizer(), [1], InlineCalculator(), 64, seed=0, temperature=0.0))
    assert len(engine.calls) == 1 and a.calls == 0 and a.mask.all()


def test_a_launch_refuses_a_tool_it_cannot_run():
    from launch.checks import tool_problems
    from rlpipe.config import build_config

    def problems(**task):
        return tool_problems(build_config({"task": {"type": "math", "dataset": "mawps:singleop", **task}}, environ={}))

    assert problems(tool="calculator") == []
    assert any("task.tool: cannot import" in p for p in problems(tool="nosuch.module:Tool"))
    assert any("task.environment" in p for p in problems(tool="calculator", environment="calculator"))
    no_tool = build_config({"task": {"type": "math", "dataset": "mawps:singleop"}, "eval": {"without_tool": True}},
                           environ={})
    assert tool_problems(no_tool) == ["eval.without_tool: only with task.tool"]


class EchoTask:
    """Rows whose answer is 180; a response scores ``reward`` when its last number is 180."""

    size = 2

    def __init__(self, reward: float = 1.0):
        self.reward = reward

    def prompt(self, i):
        return SimpleNamespace(text=f"Q{i}", answer="180", prompt_id=str(i), messages=None)

    async def score(self, prompt, texts):
        return [(self.reward if t.rstrip(".").split()[-1:] == ["180"] else 0.0, None) for t in texts]


class Encoder:
    tokenizer = CharTokenizer()

    def __call__(self, text, row_messages=None):
        return [ord(c) for c in text]


def evaluated(script: list[str], reward: float = 1.0, **task) -> dict:
    from rlpipe.config import build_config
    from rollout_service.evals import EvalRunner

    cfg = build_config({"task": {"type": "math", "dataset": "mawps:singleop", **task},
                        "eval": {"every": 1, "dataset": "mawps:singleeq", "samples": 0, "size": 2, "concurrency": 1,
                                 "without_tool": bool(task)}, "sampling": {"max_tokens": 64},
                        "rollout": {"max_model_len": 512}}, environ={})
    runner = EvalRunner(cfg, "w0", ScriptedEngine(script), None, EchoTask(reward), Encoder())
    return run(runner.score_rows())


def test_held_out_answers_are_written_with_the_tool_and_again_without_it():
    # Row 0: with the tool 45 * 4 = 180 (right); without it the model's own 190 (wrong). Row 1: wrong both ways.
    res = evaluated(["45 * 4 =", " in all, 180.", "45 * 4 = 190.", "I do not know.", "no."], tool="calculator")
    assert res["pass_at_1"] == 0.5 and res["rows_right"] == [0]
    assert res["pass_at_1_without_tool"] == 0.0 and res["rows_right_without_tool"] == []
    assert res["tool_calls"] == 1 and res["rows_using_tool"] == 1


def test_a_reward_above_one_counts_as_one_held_out_answer_right():
    res = evaluated(["180.", "7."], reward=3.0)  # Wilson's interval of a proportion above 1 raised ValueError
    assert res["pass_at_1"] == 0.5 and 0 <= res["pass_at_1_low"] <= 0.5 <= res["pass_at_1_high"] <= 1
