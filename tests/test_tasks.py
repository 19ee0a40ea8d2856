"""Tasks: math-verify rewards, dataset loading and epoch order, a real HTTP verifier, and the task config."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import string
import threading
import time

import pytest

from rlpipe.config import ConfigError, TaskConfig, build_config
from rlpipe.data_files import read_rows
from rlpipe.task_config import task_config
from rollout_service.tasks import (
    ArithTask,
    MathTask,
    RemoteTask,
    RewardError,
    make_task,
    math_reward,
)

# --- math rewards -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gold, response, reward", [
    ("1/2", r"so the answer is \boxed{\frac{1}{2}}", 1.0),
    ("1/2", r"\boxed{0.5}", 1.0),
    ("1/2", r"\boxed{\dfrac12}", 1.0),
    (r"\frac{3}{4}", r"\boxed{0.75}", 1.0),
    (r"\sqrt{2}/2", r"\boxed{\frac{1}{\sqrt{2}}}", 1.0),
    (r"\sqrt{8}", r"\boxed{2\sqrt{2}}", 1.0),
    ("x^2+2x+1", r"\boxed{(x+1)^2}", 1.0),
    ("x^2+2x+1", r"\boxed{(x-1)^2}", 0.0),
    (r"2\pi", r"\boxed{\pi \cdot 2}", 1.0),
    ("3", r"\boxed{3.0}", 1.0),
    ("3", r"\boxed{4}", 0.0),
    ("10", r"\boxed{10.000}", 1.0),
    ("1000", r"\boxed{1,000}", 1.0),
    ("-7", r"\boxed{-7}", 1.0),
    ("-7", r"\boxed{7}", 0.0),
    (r"50\%", r"\boxed{0.5}", 1.0),
    ("1/3", r"\boxed{0.333333}", 1.0),  # math-verify rounds to 6 places...
    ("1/3", r"\boxed{0.333}", 0.0),  # ...so a coarser decimal is wrong
    ("5", r"\boxed{5 \text{ cm}}", 1.0),
    (r"\{1,2\}", r"\boxed{\{2,1\}}", 1.0),
    ("(0,1]", r"\boxed{(0, 1]}", 1.0),
    ("[0,1]", r"\boxed{(0,1)}", 0.0),
    ("3", r"first \boxed{4}, no wait: \boxed{3}", 1.0),  # the last box counts
    ("4", r"first \boxed{4}, no wait: \boxed{3}", 0.0),
])
def test_math_reward_table(gold, response, reward):
    got, info = math_reward(gold, response)
    assert got == reward, info
    assert info["format_ok"] is True and "error" not in info
    assert set(info) == {"extracted", "format_ok"} and isinstance(info["extracted"], str) and info["extracted"]


@pytest.mark.parametrize("response", [
    "The answer is 3.",  # no box
    r"\boxed{3",  # unbalanced
    r"\boxed{\frac{3}{1}",
    "",
    "}}}{{{\\boxed",
    "".join(random.Random(0).choice(string.printable) for _ in range(100_000)),  # 100 KB of garbage
    "\\boxed{" + "9" * 100_000 + "}",  # a 100 KB answer
])
def test_malformed_responses_score_zero_fast(response):
    t0 = time.perf_counter()
    reward, info = math_reward("3", response)
    assert reward == 0.0 and info["extracted"] == ""
    assert all(isinstance(v, (str, bool)) for v in info.values())
    assert time.perf_counter() - t0 < 1.0


def test_a_runaway_comparison_times_out_in_the_main_thread():
    t0 = time.perf_counter()
    assert math_reward("3", r"\boxed{9^{9^{9^{9}}}}")[0] == 0.0
    assert time.perf_counter() - t0 < 10


def test_math_reward_works_off_the_main_thread():
    """signal.alarm raises outside the main thread, so no timeouts may be passed there."""
    out = []
    thread = threading.Thread(target=lambda: out.append(math_reward("1/2", r"\boxed{0.5}")))
    thread.start()
    thread.join(30)
    assert out and out[0][0] == 1.0, out


# --- datasets ---------------------------------------------------------------------------------------------------

ROWS = [{"id": f"q{i}", "prompt": f"What is {i}+{i}?", "answer": 2 * i, "level": i % 3} for i in range(7)]


def write_jsonl(path, rows, extra=""):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n" + extra)
    return path


def math_cfg(path, **kw) -> TaskConfig:
    return task_config(type="math", dataset=str(path), **kw)


def test_jsonl_and_parquet_give_the_same_prompts(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS, extra="\n  \n")  # blank lines are skipped
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    template = "Level {level}. {prompt}"
    a, b = MathTask(math_cfg(jsonl, template=template)), MathTask(math_cfg(tmp_path / "d.parquet", template=template))
    assert a.size == b.size == 7
    assert [a.prompt(i) for i in range(21)] == [b.prompt(i) for i in range(21)]
    p = a.prompt(3)
    assert p.index == 3 and p.text == f"Level {ROWS[int(p.prompt_id[1:])]['level']}. {ROWS[int(p.prompt_id[1:])]['prompt']}"
    assert p.answer == str(2 * int(p.prompt_id[1:]))  # int answers become strings
    assert p.meta == {"level": int(p.prompt_id[1:]) % 3}


def test_rows_without_ids_use_the_row_number(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}])
    task = MathTask(math_cfg(path, shuffle=False))
    assert [(task.prompt(i).prompt_id, task.prompt(i).text) for i in range(3)] == [("0", "a"), ("1", "b"), ("0", "a")]


@pytest.mark.parametrize("content, kw, match", [
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n', {}, r"d\.jsonl: line 2"),
    ('{"prompt": "a", "answer": "1"}\n[1, 2]\n', {}, r"d\.jsonl: line 2: expected a JSON object"),
    ('{"question": "a", "answer": "1"}\n', {}, "'prompt'"),
    ('{"question": "a", "answer": "1"}\n', {"prompt_field": "query"}, "'query'"),
    ('{"prompt": "a"}\n', {}, "'answer'"),
    ('{"prompt": "a", "answer": "1"}\n', {"template": "{prompt} in {topic}"}, "'topic'"),
    ("", {}, "empty dataset"),
    ("\n\n", {}, "empty dataset"),
])
def test_bad_datasets_are_named(tmp_path, content, kw, match):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        MathTask(math_cfg(path, **kw))


def test_unknown_extension(tmp_path):
    path = tmp_path / "d.txt"
    path.write_text("prompt,answer\na,1\n")
    with pytest.raises(ValueError, match=r"'\.txt'"):
        read_rows(path)


def test_remote_rows_need_no_answer(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "write a poem"}])
    task = RemoteTask(task_config(type="remote", dataset=str(path), verifier_url="http://127.0.0.1:1/"))
    assert task.prompt(0).answer == ""


def epochs(task, n_epochs=3):
    ids = [task.prompt(i).prompt_id for i in range(n_epochs * task.size)]
    return [ids[e * task.size : (e + 1) * task.size] for e in range(n_epochs)]


def test_every_epoch_holds_every_row_once_in_a_fresh_order(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    file_order = [r["id"] for r in ROWS]
    shuffled = epochs(MathTask(math_cfg(path, seed=3)))
    assert all(sorted(e) == sorted(file_order) for e in shuffled)
    assert len({tuple(e) for e in shuffled}) == 3 and file_order not in shuffled
    assert epochs(MathTask(math_cfg(path, shuffle=False))) == [file_order] * 3
    assert epochs(MathTask(math_cfg(path, seed=4))) != shuffled  # the seed picks the order


def test_prompts_are_a_pure_function_of_the_index(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    a, b = MathTask(math_cfg(path)), MathTask(math_cfg(path))
    indices = list(range(40)) + [10**9 + 5]
    jumbled = indices[:]
    random.Random(1).shuffle(jumbled)  # b jumps between epochs, so its cached permutation keeps changing
    expected = {i: a.prompt(i) for i in indices}
    assert {i: b.prompt(i) for i in jumbled} == expected


def test_math_task_scores_a_group(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Half of one?", "answer": "1/2"}])
    task = make_task(math_cfg(path))
    assert isinstance(task, MathTask)
    scored = asyncio.run(task.score(task.prompt(0), [r"\boxed{0.5}", r"\boxed{2}", "1/2"]))
    assert [r for r, _ in scored] == [1.0, 0.0, 0.0]
    assert [i["format_ok"] for _, i in scored] == [True, True, False]


def test_arith_task_keeps_the_toy_order():
    task = make_task(task_config())
    assert isinstance(task, ArithTask) and task.size == 4096
    p = task.prompt(4096 + 5)
    assert (p.prompt_id, p.text, p.answer, p.index) == ("5", *task.task.problem(5), 4096 + 5)
    scored = asyncio.run(task.score(p, [p.answer, p.answer + "1", f" {p.answer} "]))
    assert scored == [(1.0, None), (0.0, None), (1.0, None)]


# --- remote verifier --------------------------------------------------------------------------------------------


def remote_task(tmp_path, url, **kw) -> RemoteTask:
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "r1", "prompt": "Say hi", "answer": "hi", "lang": "en"}])
    kw = {"verifier_timeout_s": 2.0, "verifier_backoff_s": 0.01, **kw}
    return make_task(task_config(type="remote", dataset=str(path), verifier_url=url, **kw))


def score(task, responses=("a", "bbb")):
    async def go():
        try:
            return await task.score(task.prompt(0), list(responses))
        finally:
            await task.aclose()

    return asyncio.run(go())


def test_remote_success_sends_the_group_in_one_request(tmp_path, verifier, monkeypatch):
    monkeypatch.delenv("RLPIPE_VERIFIER_TOKEN", raising=False)
    assert score(remote_task(tmp_path, verifier.url)) == [(1.0, None), (3.0, {"len": 3})]
    assert len(verifier.seen) == 1
    headers, body = verifier.seen[0]
    assert body == {"prompt_id": "r1", "prompt": "Say hi", "answer": "hi", "meta": {"lang": "en"}, "responses": ["a", "bbb"]}
    assert "Authorization" not in headers


def test_remote_sends_the_bearer_token(tmp_path, verifier, monkeypatch):
    monkeypatch.setenv("RLPIPE_VERIFIER_TOKEN", "s3cret")
    score(remote_task(tmp_path, verifier.url))
    assert verifier.seen[0][0]["Authorization"] == "Bearer s3cret"


def test_remote_retries_transient_failures(tmp_path, verifier):
    verifier.plan = ["503", "429"]
    assert score(remote_task(tmp_path, verifier.url)) == [(1.0, None), (3.0, {"len": 3})]
    assert len(verifier.seen) == 3


def test_remote_gives_up_after_its_retries(tmp_path, verifier):
    verifier.plan = ["503"] * 10
    with pytest.raises(RewardError, match=r"/score.*3 attempts.*HTTP 503"):
        score(remote_task(tmp_path, verifier.url, verifier_retries=2))
    assert len(verifier.seen) == 3


def test_remote_client_errors_are_not_retried(tmp_path, verifier):
    verifier.plan = ["400"]
    with pytest.raises(RewardError, match=r"HTTP 400.*bad request"):
        score(remote_task(tmp_path, verifier.url))
    assert len(verifier.seen) == 1


def test_remote_timeouts_are_retried_then_fail(tmp_path, verifier):
    verifier.plan = ["sleep"] * 3
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"2 attempts.*Timeout"):
        score(remote_task(tmp_path, verifier.url, verifier_timeout_s=0.2, verifier_retries=1))
    assert len(verifier.seen) == 2 and time.perf_counter() - t0 < 2


def test_remote_unreachable_server(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RewardError, match=r"2 attempts.*Connect"):
        score(remote_task(tmp_path, f"http://127.0.0.1:{port}/", verifier_retries=1))


@pytest.mark.parametrize("mode, match", [
    ("badjson", "not JSON"),
    ("short", "list of 2 numbers"),
    ("nan", "not a finite number"),
    ("str", "not a finite number"),
    ("nested", "plain values"),
])
def test_remote_malformed_replies_raise(tmp_path, verifier, mode, match):
    verifier.plan = [mode]
    with pytest.raises(RewardError, match=match):
        score(remote_task(tmp_path, verifier.url))
    assert len(verifier.seen) == 1


# --- config -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task, field", [
    ({"type": "math"}, "task.dataset"),
    ({"type": "remote"}, "task.dataset"),
    ({"type": "remote", "dataset": "d.jsonl"}, "task.verifier_url"),
    ({"type": "remote", "dataset": "d.jsonl", "verifier_url": "http://x", "verifier_timeout_s": 0}, "task.verifier_timeout_s"),
    ({"type": "arith", "verifier_retries": -1}, "task.verifier_retries"),
    ({"type": "regex"}, "task.type"),
])
def test_task_config_errors_name_the_field(task, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        build_config({"task": task}, environ={})


def test_task_config_defaults_and_a_valid_math_config():
    assert build_config({}, environ={}).task.type == "arith"
    cfg = build_config({"task": {"type": "math", "dataset": "d.parquet", "shuffle": False}}, environ={})
    assert (cfg.task.prompt_field, cfg.task.answer_field, cfg.task.template) == ("prompt", "answer", "{prompt}")


def test_arith_style_config():
    cfg = build_config({"task": {"arith_style": "worked"}}, environ={})
    assert cfg.task.arith_style == "worked"
    assert asyncio.run(ArithTask(cfg.task).score(ArithTask(cfg.task).prompt(0), ["1 2 3", ""])) == [(0.0, None)] * 2
    with pytest.raises(ConfigError, match=r"task\.arith_style"):
        build_config({"task": {"arith_style": "essay"}}, environ={})
    with pytest.raises(ConfigError, match=r"task\.arith_style: only for task\.type 'arith'"):
        build_config({"task": {"type": "math", "dataset": "d.jsonl", "arith_style": "worked"}}, environ={})


def test_worked_style_needs_room_for_its_longest_answer():
    from launch.checks import validate_run

    with pytest.raises(ConfigError, match=r"sampling\.max_tokens: task\.arith_style 'worked' needs at least 20"):
        validate_run(build_config({"task": {"arith_style": "worked"}}, environ={}))  # the default 8 tokens
    validate_run(build_config({"task": {"arith_style": "worked"}, "sampling": {"max_tokens": 32}}, environ={}))
    validate_run(build_config({}, environ={}))  # the demo's default is untouched
