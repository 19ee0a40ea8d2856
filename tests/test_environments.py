"""The environment protocol and the built-in calculator tool task (rollout_service/environments.py),
without an engine: the calculator's arithmetic and its refusals, an episode's steps and
rewards, and loading a user's environment by import path."""

from __future__ import annotations

import pytest

from rlpipe.config import ConfigError
from rollout_service.environments import CalculatorEnv, EnvStep, calculate, load_environment
from rollout_service.tasks import Prompt


@pytest.mark.parametrize(("expression", "value"), [("47*38", "1786"), (" (2+3)*-4 ", "-20"), ("7/2", "3.5"),
                                                    ("8/2", "4"), ("2**10 % 1000", "24"), ("17//5", "3")])
def test_the_calculator_computes_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(("expression", "why"), [("__import__('os').system('true')", "only numbers"),
                                                 ("x + 1", "only numbers"), ("1/0", "division by zero"),
                                                 ("9**9**9", "exponent over"), ("1+" * 150 + "1", "longer than"),
                                                 ("2 +", "error"), ("True + 1", "only numbers")])
def test_the_calculator_refuses_what_is_not_arithmetic_with_a_reason(expression, why):
    out = calculate(expression)
    assert out.startswith("error") and why in out, out


def test_a_calculator_episode_calls_the_tool_then_answers():
    env = CalculatorEnv("1786")
    messages = env.reset(Prompt(index=0, prompt_id="p0", text="What is 47*38?", answer="1786", meta={}))
    assert messages[-1] == {"role": "user", "content": "What is 47*38?"} and "<calc>" in messages[0]["content"]
    first = env.step("Let me compute. <calc>47*38</calc>")
    assert first == EnvStep({"role": "tool", "content": "<result>1786</result>"}, 0.0, False, {"calls": 1})
    last = env.step("The answer is 1786.")
    assert (last.observation, last.reward, last.done, last.info) == (None, 1.0, True, {"calls": 1})
    assert CalculatorEnv("1786").step("1787").reward == 0.0  # answered without the tool, wrongly
    assert CalculatorEnv("-20").step("so it is -20").reward == 1.0


def test_an_episode_over_its_calls_ends_unrewarded():
    env = CalculatorEnv("3", max_calls=2)
    assert not env.step("<calc>1+1</calc>").done and not env.step("<calc>1+2</calc>").done
    over = env.step("<calc>1+2</calc> 3")
    assert over.done and over.reward == 0.0 and over.info["over_calls"]


class EchoEnv:
    """A user's environment, loaded by import path in the test below."""

    def __init__(self, answer: str):
        self.answer = answer

    def reset(self, prompt):
        return [{"role": "user", "content": prompt.text}]

    def step(self, turn: str) -> EnvStep:
        return EnvStep(None, float(turn == self.answer), True)


def test_a_users_environment_loads_by_import_path_and_a_bad_path_names_the_key():
    assert load_environment("calculator") is CalculatorEnv
    factory = load_environment("tests.test_environments:EchoEnv")
    assert factory("yes").step("yes").reward == 1.0
    with pytest.raises(ConfigError, match=r"^task\.environment: cannot import 'tests\.nope:Env'"):
        load_environment("tests.nope:Env")
    with pytest.raises(ConfigError, match=r"task\.environment: .* not a class or function"):
        load_environment("rollout_service.environments:MAX_EXPONENT")
