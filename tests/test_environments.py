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


@pytest.mark.parametrize("expression", ["(((((9**64)**64)**64)**64)**64)", "(9**64)**64", "(10**60)**17",
                                        "*".join(["(9**64)"] * 20), "-(9**64)**17"])
def test_the_calculator_refuses_a_result_too_big_to_compute_before_computing_it(expression):
    """Issue 33 item 13: every exponent was at most 64, yet the result has 6e9 digits; computing
    it held the GIL for hours, where the step's timeout could not stop it. Run in a child, so a
    regression fails here instead of hanging the suite."""
    import subprocess
    import sys

    code = f"from rollout_service.environments import calculate; print(calculate({expression!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.strip()
    assert out == "error: a result over 1000 digits", out


def test_the_calculator_still_computes_results_up_to_its_bound():
    assert calculate("(10**60)**16") == "1" + "0" * 960 and calculate("9**64") == str(9**64)
    assert calculate("2**64*2**64") == str(2**128) and calculate("(9**64)**2 % 1000") == str(9**128 % 1000)


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
    from launch.checks import validate_run
    from rlpipe.config import build_config

    cfg = build_config({}, environ={}, **{"model.path": toy_model_path, "task.environment": "tests.nope:Env"})
    with pytest.raises(ConfigError) as e:
        validate_run(cfg)
    assert "task.environment: cannot import 'tests.nope:Env'" in str(e.value)
    assert f"task.environment: episodes are chat sessions, and {toy_model_path}'s tokenizer has no chat" in str(e.value)


def test_a_toy_taught_to_call_the_calculator_is_refused_without_it_or_without_a_toy(toy_model_path):
    from launch.checks import validate_run
    from rlpipe.config import build_config
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
    from rlpipe.queue import TrajectoryQueue
    from rlpipe.redis_link import connect
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


class IntKeyEnv:
    """For the test below: answers the model's first turn with an info the record cannot take."""

    def __init__(self, answer: str):
        pass

    def reset(self, prompt):
        return [{"role": "user", "content": prompt.text}]

    def step(self, turn: str) -> EnvStep:
        return EnvStep(None, 1.0, True, {3: "three"})


def episode_runner(tmp_path, environment: str, **settings):
    """An EpisodeRunner without an engine: each model turn is ``7`` and ``<eos>``."""
    import asyncio

    from rlpipe.config import build_config
    from rollout_service.engine import SampleResult
    from rollout_service.episodes import EpisodeRunner
    from rollout_service.metrics import RolloutMetrics
    from tests.test_chat_template import build_tokenizer

    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    seven, eos = tokenizer.convert_tokens_to_ids(["7", "<eos>"])

    class Engine:
        version = 0

        async def generate(self, ids, n, **kw):
            await asyncio.sleep(0)
            return [SampleResult(np.asarray([seven, eos], np.int32), np.asarray([-0.5, -0.5], np.float32), "stop",
                                 None)], 0, 0

    cfg = build_config({}, environ={}, **{"task.environment": environment, "sampling.max_tokens": 4, **settings})
    return EpisodeRunner(cfg, tokenizer, Engine(), RolloutMetrics("w0", "fp32"))


def test_an_environment_info_no_record_can_take_fails_the_group_naming_why(tmp_path):
    """Issue 33 item 12, for environments: an int key in a step's info reached the push, where
    msgpack's reader refused it and the prompt's lease was kept."""
    import asyncio

    from rollout_service.tasks import BadRewardResult

    runner = episode_runner(tmp_path, "tests.test_environments:IntKeyEnv")
    prompt = Prompt(index=0, prompt_id="p0", text="1+1=", answer="2", meta={})
    with pytest.raises(BadRewardResult, match=r"task\.environment tests\.test_environments:IntKeyEnv: reward_info "
                                              r"key 3 is a int, not a str"):
        asyncio.run(runner.group(prompt, 2, 0))


def test_an_episodes_routes_are_one_row_per_token_each_from_the_turn_that_first_forwarded_it(tmp_path):
    """Routing replay for multi-turn episodes (issue 36): every turn's request forwards the whole
    session so far, and the sample keeps one row per token but the last (P + L - 1, as a
    single-turn sample): a model token's row from its own turn, a context token's (and the
    turn before's last token's) from the next turn's prefill."""
    import asyncio

    from rollout_service.engine import SampleResult

    runner = episode_runner(tmp_path, "retry")  # "7" is never right: three turns, two "-" messages between
    seven, eos = runner.sessions.tokenizer.convert_tokens_to_ids(["7", "<eos>"])
    calls = []

    class RoutedEngine:
        version = 0

        async def generate(self, ids, n, **kw):
            rows = len(ids) + 2 - 1  # the request's P + L - 1 forwarded tokens
            routes = np.stack([np.full(rows, len(calls)), np.arange(rows)], -1)[:, None, :].astype(np.uint8)
            calls.append(len(ids))
            return [SampleResult(np.asarray([seven, eos], np.int32), np.asarray([-0.5, -0.5], np.float32), "stop",
                                 None, routes=routes)], 0, 0

    runner.engine = RoutedEngine()
    prompt = Prompt(index=0, prompt_id="p0", text="1+1=", answer="2", meta={})
    prompt_ids, samples, _, _ = asyncio.run(runner.group(prompt, 1, 0))
    (sample,) = samples
    assert len(calls) == 3 and sample.reward_info["tries"] == 3
    routes = sample.routes
    assert routes.shape == (len(prompt_ids) + len(sample.tokens) - 1, 1, 2)
    assert np.array_equal(routes[:, 0, 1], np.arange(len(routes)))  # every row in place, none twice
    ends = np.asarray(calls[:-1]) + 2 - 1  # a turn's request forwards its P ids and its tokens but the last
    turn_of_row = np.searchsorted(ends, np.arange(len(routes)), side="right")
    assert np.array_equal(routes[:, 0, 0], turn_of_row), (calls, routes[:, 0, 0])


def test_hung_environment_steps_are_abandoned_and_never_hold_the_loops_threads(tmp_path):
    """A step that never ends is abandoned after task.environment_timeout_s. It held a thread
    of the event loop's default pool, the one every Redis call of the loop runs in (six on a
    2-core machine): a few hung steps froze the worker's pushes, leases and heartbeat."""
    import asyncio
    import threading

    from rollout_service.tasks import MAX_ABANDONED, RewardError

    runner = episode_runner(tmp_path, "calculator", **{"task.environment_timeout_s": 0.1})
    release = threading.Event()

    async def go():
        try:
            for _ in range(MAX_ABANDONED):
                with pytest.raises(RewardError, match=r"0\.1 s \(task\.environment_timeout_s\)"):
                    await runner._step(lambda turn: release.wait(), "turn")
                assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 5) == "free"
            assert f"{MAX_ABANDONED} calls still running past task.environment_timeout_s" in runner.stuck
            with pytest.raises(RewardError, match="calls still running"):
                await runner._step(lambda turn: "never called", "turn")
        finally:
            release.set()  # before asyncio.run waits for its default pool's threads

    asyncio.run(go())
