"""The environment protocol and the built-in calculator tool task (rollout_service/environments.py),
without an engine: the calculator's arithmetic and its refusals, an episode's steps and
rewards, and loading a user's environment by import path."""

from __future__ import annotations

import numpy as np
import pytest

from rlpipe.config import ConfigError
from rollout_service.environments import CalculatorEnv, EnvStep, RetryEnv, calculate, load_environment
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


@pytest.mark.parametrize("turn, call", [("37*48", "37*48"), (" 37 * 48\n", "37 * 48"), ("(3+4)*5", "(3+4)*5"),
                                        ("1776", None), ("-5", None), ("37*48=1776", None), ("12-", None),
                                        ("the answer is 3*4", None), ("", None)])
def test_a_bare_expression_is_a_call_answered_with_the_bare_value(turn, call):
    """The toy's call syntax (it has no ``<`` to write): a turn that is an expression and
    nothing else, answered with the value alone; any other turn is an answer."""
    step = CalculatorEnv("1776").step(turn)
    if call is None:
        assert step.done and step.info == {"calls": 0}
    else:
        assert step == EnvStep({"role": "tool", "content": calculate(call)}, 0.0, False, {"calls": 1})


def test_an_episode_over_its_calls_ends_unrewarded():
    env = CalculatorEnv("3", max_calls=2)
    assert not env.step("<calc>1+1</calc>").done and not env.step("<calc>1+2</calc>").done
    over = env.step("<calc>1+2</calc> 3")
    assert over.done and over.reward == 0.0 and over.info["over_calls"]


def test_a_retry_episode_judges_each_answer_and_halves_the_reward_per_try():
    first = RetryEnv("82")
    assert first.reset(Prompt(index=0, prompt_id="p0", text="37+45=", answer="82", meta={})) == [
        {"role": "user", "content": "37+45="}]
    assert first.step("82") == EnvStep(None, 1.0, True, {"tries": 1})
    later = RetryEnv("82")
    assert later.step("81") == EnvStep({"role": "tool", "content": "-"}, 0.0, False)
    assert later.step("8 2").observation is not None  # the last number is 2
    assert later.step("082") == EnvStep(None, 0.25, True, {"tries": 3})
    never = RetryEnv("82", tries=2)
    never.step("1")
    assert never.step("2") == EnvStep(None, 0.0, True, {"tries": 2})


class EchoEnv:
    """A user's environment, loaded by import path in the test below."""

    def __init__(self, answer: str):
        self.answer = answer

    def reset(self, prompt):
        return [{"role": "user", "content": prompt.text}]

    def step(self, turn: str) -> EnvStep:
        return EnvStep(None, float(turn == self.answer), True)


def test_a_users_environment_loads_by_import_path_and_a_bad_path_names_the_key():
    assert load_environment("calculator") is CalculatorEnv and load_environment("retry") is RetryEnv
    factory = load_environment("tests.test_environments:EchoEnv")
    assert factory("yes").step("yes").reward == 1.0
    with pytest.raises(ConfigError, match=r"^task\.environment: cannot import 'tests\.nope:Env'"):
        load_environment("tests.nope:Env")
    with pytest.raises(ConfigError, match=r"task\.environment: .* not a class or function"):
        load_environment("rollout_service.environments:MAX_EXPONENT")


class EvenOddEnv:
    """For the loop test below: an even prompt's episode ends after the model's second turn
    (reward 1), an odd one's never ends (the session's turn limit cuts it). The tool result
    stays within the toy's vocabulary."""

    def __init__(self, answer: str):
        self.turns = 0

    def reset(self, prompt):
        self.even = prompt.index % 2 == 0
        return [{"role": "user", "content": prompt.text}]

    def step(self, turn: str) -> EnvStep:
        self.turns += 1
        if self.even and self.turns == 2:
            return EnvStep(None, 1.0, True, {"even": True})
        return EnvStep({"role": "tool", "content": "7" * self.turns}, 0.0, False)


def test_environment_problems_are_refused_at_launch_naming_the_key(toy_model_path):
    from rlpipe.config import build_config, validate_run

    cfg = build_config({}, environ={}, **{"model.path": toy_model_path, "task.environment": "tests.nope:Env"})
    with pytest.raises(ConfigError) as e:
        validate_run(cfg)
    assert "task.environment: cannot import 'tests.nope:Env'" in str(e.value)
    assert f"task.environment: episodes are chat sessions, and {toy_model_path}'s tokenizer has no chat" in str(e.value)


def test_a_toy_taught_to_call_the_calculator_is_refused_without_it_or_without_a_toy(toy_model_path):
    from rlpipe.config import build_config, validate_run
    from rlpipe.paths import SMOLLM2

    calculator = {"task.environment": "calculator", "model.toy_tool_calls": 0.25,
                  "rollout.chat_template": "configs/toy-chat.jinja"}
    validate_run(build_config({}, environ={}, **calculator))
    validate_run(build_config({}, environ={}, **{**calculator, "model.path": toy_model_path}))  # the toy, built
    for key, value, why in [("task.environment", "retry", "only task.environment: calculator answers"),
                            ("task.environment", "", "only task.environment: calculator answers"),
                            ("model.path", SMOLLM2, f"only a toy model is warm-started, and model.path is "
                                                     f"{SMOLLM2}")]:
        with pytest.raises(ConfigError, match=f"model.toy_tool_calls: .*{why}"):
            validate_run(build_config({}, environ={}, **{**calculator, key: value}))


@pytest.mark.slow
def test_the_rollout_loop_drives_episodes_through_sessions_and_pushes_masked_samples(redis_server, toy_model_path,
                                                                                      tmp_path):
    """A worker with ``task.environment``: each of a prompt's samples is an episode of model turns
    and tool results, pushed as one sample with its loss mask; an episode the session's turn
    limit cuts ends unrewarded, naming the limit."""
    from transformers import AutoTokenizer

    from learner.policy import load_policy
    from rlpipe.queue import TrajectoryQueue, connect
    from tests.conftest import WorkerHarness, start_worker, stop_worker, wait_for
    from tests.test_sessions import TOY_TEMPLATE

    cfg, proc, address = start_worker(redis_server.url, toy_model_path, tmp_path, **{
        "task.environment": "tests.test_environments:EvenOddEnv", "rollout.chat_template": TOY_TEMPLATE,
        "rollout.session_max_turns": 3, "sampling.n": 2, "sampling.max_tokens": 4, "sampling.temperature": 1.0,
        "learner.groups_per_step": 4})
    q = TrajectoryQueue(connect(redis_server.url), cfg.run_id)
    try:
        WorkerHarness(cfg, proc, address, q.r).sync(load_policy(toy_model_path))
        wait_for(lambda: q.r.xlen(q.keys.traj) >= 4, 180, interval=0.5, what="4 groups")
    finally:
        stop_worker(proc)
    records = [e.record for e in q._decode(q.r.xrange(q.keys.traj))]
    tok = AutoTokenizer.from_pretrained(toy_model_path)
    parities = set()
    for rec in records:
        even = rec.prompt_index % 2 == 0
        parities.add(even)
        assert tok.decode(rec.prompt_tokens).startswith("<bos>")
        for s in rec.samples:
            mask = s.mask.astype(bool)
            runs = np.flatnonzero(np.diff(np.r_[0, mask.astype(int)]) == 1)  # starts of model turns
            assert s.reward_info["turns"] == len(runs) == (2 if even else 3), (rec.prompt_index, s.reward_info)
            assert s.reward == (1.0 if even else 0.0)
            assert (s.reward_info.get("truncated") == "rollout.session_max_turns") == (not even)
            assert np.all(s.logprobs[~mask] == 0) and np.all(s.logprobs[mask] <= 0)
            context = tok.decode(s.tokens[~mask])
            assert context.startswith("=") and "%7" in context  # the generation prompt, then the tool's result
            assert len(s.tokens) == len(s.mask) and s.finish_reason in ("stop", "length")
    assert parities == {True, False}, [r.prompt_index for r in records]
