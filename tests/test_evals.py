"""Held-out evaluation's bookkeeping on a real Redis: the learner's requests and results
(learner/evals.py), the workers' claim of requests (rollout_service/evals.py), and the
held-out rows never being training rows. The evaluation itself, on a real engine, runs
in tests/test_real_model.py."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest

from launch.checks import validate_run
from learner.evals import Evals
from learner.metrics import LearnerMetrics, read_jsonl
from rlpipe import registry
from rlpipe.config import ConfigError, build_config
from rlpipe.datasets import load_rows, question_key
from rlpipe.keys import Keys
from rollout_service.evals import GROUP, EvalRunner, make_eval_task, wilson_interval
from tests.conftest import free_run_id


def eval_config(**over):
    return build_config({}, environ={}, run_id=free_run_id("eval"), **{
        "task.type": "math", "task.dataset": "mawps:singleop", "eval.every": 2, "eval.dataset": "mawps:singleeq",
        "eval.drop_shared": True, **over})


def result(version: int, pass_at_1: float = 0.25, rows: int = 8) -> dict:
    low, high = wilson_interval(pass_at_1 * rows, rows)
    return {"dataset": "mawps:singleeq", "requested_version": version, "step": version, "version": version,
            "version_end": version, "rows": rows, "skipped_rows": 0, "pass_at_1": pass_at_1, "pass_at_1_low": low,
            "pass_at_1_high": high, "k": 0, "mean_at_k": None, "seconds": 1.0, "worker": "w0"}


def publish(r, keys: Keys, res: dict) -> None:
    r.xadd(keys.eval_results, {"result": json.dumps(res)})


def test_the_wilson_interval_matches_its_formula_and_known_values():
    assert wilson_interval(0, 24) == pytest.approx((0.0, 0.1380), abs=1e-4)
    assert wilson_interval(50, 100) == pytest.approx((0.4038, 0.5962), abs=1e-4)
    p, n, z = 0.1, 256, 1.96
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert wilson_interval(25.6, 256) == pytest.approx((centre - half, centre + half))


def test_the_learner_asks_once_per_version_and_logs_each_result_once_across_a_restart(r, tmp_path):
    cfg = eval_config()
    keys = Keys(cfg.run_id)
    metrics = LearnerMetrics(tmp_path / "metrics.jsonl", run_name=cfg.run_id)
    evals = Evals(cfg, r, keys, metrics)
    assert [evals.due(s) for s in range(5)] == [True, False, True, False, True]
    evals.request(0, 0)
    evals.request(0, 0)  # again (a restarted learner at the same version): not asked twice
    evals.request(2, 2)
    assert [int(f[b"version"]) for _, f in r.xrange(keys.eval_requests)] == [0, 2]

    publish(r, keys, result(0, 0.125))
    assert [res["version"] for res in evals.poll(step=1)] == [0]
    assert evals.poll(step=1) == []
    value = metrics.registry.get_sample_value("rlpipe_eval_accuracy", {"dataset": "mawps:singleeq",
                                                                        "metric": "pass@1", "run_id": cfg.run_id})
    assert value == 0.125

    publish(r, keys, result(2, 0.5))
    restarted = Evals(cfg, r, keys, LearnerMetrics(tmp_path / "metrics.jsonl", run_name=cfg.run_id))
    assert [res["version"] for res in restarted.poll(step=3)] == [2]  # not version 0 again
    logged = read_jsonl(tmp_path / "metrics.jsonl", kind="eval")
    assert [(e["version"], e["logged_at_step"]) for e in logged] == [(0, 1), (2, 3)]
    assert read_jsonl(tmp_path / "metrics.jsonl") == []  # no step rows: evaluations are their own kind


def test_the_learner_waits_at_the_end_for_the_last_versions_evaluation(r, tmp_path):
    cfg = eval_config(**{"eval.final_wait_s": 30})
    keys = Keys(cfg.run_id)
    evals = Evals(cfg, r, keys, LearnerMetrics(tmp_path / "metrics.jsonl", run_name=cfg.run_id))
    publish(r, keys, result(3))  # an older version's result arrives first
    threading.Timer(0.5, publish, (r, keys, result(4, 0.375))).start()
    t0 = time.monotonic()
    final = evals.finish(version=4, step=4)
    assert final["requested_version"] == 4 and final["pass_at_1"] == 0.375
    assert 0.4 < time.monotonic() - t0 < 10
    assert [int(f[b"version"]) for _, f in r.xrange(keys.eval_requests)] == [4]

    short = Evals(eval_config(**{"eval.final_wait_s": 0.3}), r, Keys(free_run_id("eval")),
                  LearnerMetrics(None))
    assert short.finish(version=1, step=1) is None  # nobody evaluates: it gives up after final_wait_s


def test_base_at_rest_waits_for_the_base_models_result_before_the_first_step_and_a_restart_does_not(r, tmp_path):
    cfg = eval_config(**{"eval.base_at_rest": True, "eval.final_wait_s": 30})
    keys = Keys(cfg.run_id)
    evals = Evals(cfg, r, keys, LearnerMetrics(tmp_path / "metrics.jsonl", run_name=cfg.run_id))
    threading.Timer(0.5, publish, (r, keys, result(0, 0.125))).start()
    t0 = time.monotonic()
    evals.start(version=0, step=0)
    assert 0.4 < time.monotonic() - t0 < 10  # it waited for the result, and logged it
    assert [res["version"] for res in evals.results] == [0]

    restarted = Evals(cfg, r, keys, LearnerMetrics(None))  # at step 0 again, the base model already logged
    t0 = time.monotonic()
    restarted.start(version=0, step=0)
    assert time.monotonic() - t0 < 1 and restarted.results == []

    beside = Evals(eval_config(**{"eval.final_wait_s": 30}), r, Keys(free_run_id("eval")), LearnerMetrics(None))
    t0 = time.monotonic()
    beside.start(version=0, step=0)  # the default: asked for, not waited on
    assert time.monotonic() - t0 < 1 and int(r.xlen(beside.keys.eval_requests)) == 1


def test_one_worker_takes_each_request_and_a_gone_workers_request_is_taken_over(r):
    cfg = eval_config()
    keys = Keys(cfg.run_id)
    for w in ("w0", "w1"):
        registry.heartbeat_worker(r, keys, w, ttl_s=30, address="127.0.0.1:1")
    w0, w1 = (EvalRunner(cfg, w, engine=None, r=r, task=None, encode=None) for w in ("w0", "w1"))
    r.xadd(keys.eval_requests, {"version": 5, "step": 5})
    got0 = w0.next_request(block_ms=100)
    assert got0[1] == {"version": "5", "step": "5"}
    assert w1.next_request(block_ms=100) is None  # w0 holds it, and w0 is alive
    registry.remove_worker(r, keys, "w0")  # w0's heartbeat expired: it is gone, its request unfinished
    got1 = w1.next_request(block_ms=100)
    assert got1 == got0
    w1.publish(got1[0], result(5))
    assert r.xpending(keys.eval_requests, GROUP)["pending"] == 0
    assert w1.next_request(block_ms=100) is None


def test_held_out_rows_are_never_training_rows():
    cfg = eval_config()
    task = make_eval_task(cfg)
    train = {question_key(r.question) for r in load_rows("mawps:singleop")}
    held_out = [question_key(task.prompt(i).meta.get("input", "")) for i in range(task.size)]
    # 36 questions the two sets share as written and 17 reworded ("will she need" / "will Marlee need")
    assert task.size == len(load_rows("mawps:singleeq")) - 53
    assert not train & set(held_out)
    with pytest.raises(ConfigError, match=r"eval.dataset: .*share 53 question"):
        validate_run(eval_config(**{"eval.drop_shared": False}))
    with pytest.raises(ConfigError, match="eval.dataset: the same"):
        validate_run(eval_config(**{"eval.dataset": "mawps:singleop"}))


def dead_letters(r, stream: str) -> dict[str, str]:
    """``source_id -> reason`` of a side stream's dead letters (rlpipe/side_streams.py)."""
    return {f[b"source_id"].decode(): f[b"reason"].decode() for _, f in r.xrange(stream + ":dead")}


def test_entries_of_the_results_stream_that_are_not_this_runs_results_are_dead_lettered_never_logged(r, tmp_path):
    """Issue 33, item 14: an entry that was not JSON killed the learner at every start, and
    forged results (pass@1 0.99, or NaN) were logged as real. Each is dead-lettered with its
    reason, and the learner logs the real result after them."""
    cfg = eval_config()
    keys = Keys(cfg.run_id)
    metrics = LearnerMetrics(tmp_path / "metrics.jsonl", run_name=cfg.run_id)
    evals = Evals(cfg, r, keys, metrics)
    evals.request(0, 0)
    forged = {
        "not JSON": {"result": b"\xff{not json"},
        "missing field": {"data": "x"},
        "never asked for": {"result": json.dumps(result(7, 0.99))},
        "NaN": {"result": json.dumps({**result(0), "pass_at_1": math.nan})},
        "above 1": {"result": json.dumps({**result(0), "pass_at_1_lenient": 1.5})},
        "rows beyond eval.size": {"result": json.dumps(result(0, rows=cfg.eval.size + 1))},
        "another dataset": {"result": json.dumps({**result(0), "dataset": "gsm8k:test"})},
        "another step": {"result": json.dumps({**result(0), "step": 4})},
        "huge": {"result": json.dumps({**result(0), "junk": "x" * 100_000})},
    }
    ids = {what: r.xadd(keys.eval_results, fields).decode() for what, fields in forged.items()}
    real = r.xadd(keys.eval_results, {"result": json.dumps(result(0, 0.125))}).decode()
    assert [(res["version"], res["pass_at_1"]) for res in evals.poll(step=1)] == [(0, 0.125)]
    reasons = dead_letters(r, keys.eval_results)
    assert sorted(reasons) == sorted(ids.values())
    for what, needle in [("not JSON", "not JSON"), ("missing field", "missing field"),
                         ("never asked for", "never asked for an evaluation of version 7"),
                         ("NaN", "pass_at_1: nan is not a number within 0..1"), ("above 1", "pass_at_1_lenient"),
                         ("rows beyond eval.size", "rows: 65"), ("another dataset", "gsm8k:test"),
                         ("another step", "version 0 at step 4"), ("huge", "bytes")]:
        assert needle in reasons[ids[what]], (what, reasons[ids[what]])
    assert [entry_id.decode() for entry_id, _ in r.xrange(keys.eval_results)] == [real]  # the others moved
    assert [(e["version"], e["pass_at_1"]) for e in read_jsonl(tmp_path / "metrics.jsonl", kind="eval")] == [(0, 0.125)]
    assert evals.poll(step=2) == []


def test_a_copy_of_a_real_result_with_its_score_forged_is_dead_lettered_and_the_next_version_still_logs(r, tmp_path):
    cfg = eval_config()
    keys = Keys(cfg.run_id)
    evals = Evals(cfg, r, keys, LearnerMetrics(tmp_path / "metrics.jsonl", run_name=cfg.run_id))
    evals.request(0, 0)
    real = r.xadd(keys.eval_results, {"result": json.dumps(result(0, 0.125))}).decode()
    copy = r.xadd(keys.eval_results, {"result": json.dumps(result(0, 0.99))}).decode()
    assert [(res["version"], res["pass_at_1"]) for res in evals.poll(step=1)] == [(0, 0.125)]
    assert f"version 0 was answered already (entry {real})" in dead_letters(r, keys.eval_results)[copy]
    evals._first_answer(0, real)  # the same entry read again after a restart keeps its claim
    evals.request(2, 2)  # the steady state: the next request's answer is logged
    r.xadd(keys.eval_results, {"result": json.dumps(result(2, 0.25))})
    assert [(res["version"], res["pass_at_1"]) for res in evals.poll(step=3)] == [(2, 0.25)]
    assert [e["pass_at_1"] for e in read_jsonl(tmp_path / "metrics.jsonl", kind="eval")] == [0.125, 0.25]


def test_a_result_that_stops_the_learner_each_time_is_dead_lettered_after_its_delivery_limit(r, tmp_path, monkeypatch):
    """One that passes the checks but kills the learner while it is logged (any bug in
    logging it) is read again by the restarted learner: after ``queue.max_deliveries``
    tries it is dead-lettered instead of crash-looping the run."""
    cfg = eval_config()
    keys = Keys(cfg.run_id)
    Evals(cfg, r, keys, LearnerMetrics(None)).request(0, 0)
    publish(r, keys, result(0, 0.5))

    def crash(self, step, res):
        raise RuntimeError("the learner died logging it")

    with monkeypatch.context() as m:
        m.setattr(LearnerMetrics, "record_eval", crash)
        for _ in range(cfg.queue.max_deliveries):  # each: a learner that starts and dies at its first poll
            with pytest.raises(RuntimeError):
                Evals(cfg, r, keys, LearnerMetrics(None)).poll(step=1)
    restarted = Evals(cfg, r, keys, LearnerMetrics(None))
    assert restarted.poll(step=1) == []
    (reason,) = dead_letters(r, keys.eval_results).values()
    assert reason.startswith(f"delivered {cfg.queue.max_deliveries} times and never logged")
    Evals(cfg, r, keys, LearnerMetrics(None)).request(2, 2)
    publish(r, keys, result(2, 0.25))
    assert [res["version"] for res in restarted.poll(step=3)] == [2]


def test_a_request_the_learner_never_made_is_dead_lettered_at_once_not_waited_on(r):
    """Forged requests each held a worker's evaluator for VERSION_WAIT_S (60 s), waiting for a
    version that never comes. A request whose version and step are not in ``eval:requested``
    is dead-lettered at once, with the reason, and the learner's own request after it is
    evaluated."""
    import asyncio

    cfg = eval_config()
    keys = Keys(cfg.run_id)
    registry.heartbeat_worker(r, keys, "w0", ttl_s=30, address="127.0.0.1:1")
    forged = [r.xadd(keys.eval_requests, fields).decode()
              for fields in ({"version": 10**6, "step": 10**6}, {"version": "abc", "step": 1}, {"step": 2})]
    Evals(cfg, r, keys, LearnerMetrics(None)).request(2, 2)
    runner = EvalRunner(cfg, "w0", engine=None, r=r, task=None, encode=None)
    evaluated = []

    async def evaluate(version, step):
        evaluated.append((version, step))
        return result(version)

    runner.evaluate = evaluate

    async def scenario():
        runner.start()
        t0 = time.monotonic()
        while not evaluated and time.monotonic() - t0 < 20:
            await asyncio.sleep(0.05)
        await runner.stop()
        return time.monotonic() - t0

    assert asyncio.run(scenario()) < 10  # not a minute per forged request
    assert evaluated == [(2, 2)]
    reasons = dead_letters(r, keys.eval_requests)
    assert sorted(reasons) == sorted(forged)
    assert "never asked for an evaluation of version 1000000 at step 1000000" in reasons[forged[0]]
    assert "not integers" in reasons[forged[1]] and "not integers" in reasons[forged[2]]
    assert r.xpending(keys.eval_requests, GROUP)["pending"] == 0


def test_a_request_that_fails_or_kills_its_worker_each_time_is_dead_lettered_after_its_delivery_limit(r):
    """Tried ``queue.max_deliveries`` times, by one worker whose evaluation raises or by
    workers that die with it, a request goes to the dead letters with the reason, instead of
    being dropped without a trace (or tried forever)."""
    import asyncio

    cfg = eval_config()
    keys = Keys(cfg.run_id)
    registry.heartbeat_worker(r, keys, "w0", ttl_s=30, address="127.0.0.1:1")
    learner = Evals(cfg, r, keys, LearnerMetrics(None))
    learner.request(2, 2)
    runner = EvalRunner(cfg, "w0", engine=None, r=r, task=None, encode=None)

    async def evaluate(version, step):
        raise RuntimeError("a reward that always raises")

    runner.evaluate = evaluate

    async def scenario():
        runner.start()
        t0 = time.monotonic()
        while not r.xlen(keys.eval_requests + ":dead") and time.monotonic() - t0 < 30:
            await asyncio.sleep(0.05)
        await runner.stop()

    asyncio.run(scenario())
    (reason,) = dead_letters(r, keys.eval_requests).values()
    assert reason == f"delivered {cfg.queue.max_deliveries} times without a result: " \
                     "RuntimeError('a reward that always raises')"

    learner.request(4, 4)  # read by workers that died with it, one after the other (gone from the registry)
    (entry_id, _), = r.xreadgroup(GROUP, "gone", {keys.eval_requests: ">"}, count=1)[0][1]
    for _ in range(cfg.queue.max_deliveries - 1):
        r.xclaim(keys.eval_requests, GROUP, "gone", 0, [entry_id])
    assert runner.next_request(block_ms=100) is None
    assert dead_letters(r, keys.eval_requests)[entry_id.decode()].startswith(
        f"delivered {cfg.queue.max_deliveries} times without a result: its worker died with it each time?")
    assert r.xpending(keys.eval_requests, GROUP)["pending"] == 0


def test_the_base_models_result_is_kept_under_a_key_of_everything_its_answers_depend_on(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from rollout_service import eval_cache

    monkeypatch.setenv("RLPIPE_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    (model / "model.safetensors").write_bytes(b"weights")
    fp32 = SimpleNamespace(precision="fp32", dtype="float32", quantization=None, quant_hash="")
    prompts, settings = [([1, 2, 3], "4"), ([5, 6], "7")], {"max_tokens": 128, "samples": 0}
    key = eval_cache.base_key(str(model), fp32, prompts, settings)
    assert key == eval_cache.base_key(str(model), fp32, [list(p) for p in prompts], dict(settings))
    others = [eval_cache.base_key(str(model), SimpleNamespace(**{**vars(fp32), "precision": "bf16", "dtype": "bfloat16"}),
                                  prompts, settings),
              eval_cache.base_key(str(model), fp32, [([1, 2, 4], "4"), ([5, 6], "7")], settings),
              eval_cache.base_key(str(model), fp32, [([1, 2, 3], "5"), ([5, 6], "7")], settings),
              eval_cache.base_key(str(model), fp32, prompts, {**settings, "max_tokens": 64})]
    (model / "model.safetensors").write_bytes(b"weightz")  # other weights of the same size
    others.append(eval_cache.base_key(str(model), fp32, prompts, settings))
    assert len({key, *others}) == 6

    assert eval_cache.load(key) is None  # nothing kept yet
    fields = {f: 0.25 if f.startswith("pass") else [] if f.startswith("rows_") else 1 for f in eval_cache.REUSED_FIELDS}
    eval_cache.store(key, {**fields, "worker": "w0", "version": 0})
    assert eval_cache.load(key) == fields  # only the row's own fields, not who evaluated it when
    with_tool = {**fields, "tool": "calculator", "tool_calls": 3, "rows_using_tool": 2, "pass_at_1_without_tool": 0.1,
                 "pass_at_1_without_tool_low": 0.0, "pass_at_1_without_tool_high": 0.3, "rows_right_without_tool": [1]}
    eval_cache.store(key, {**with_tool, "worker": "w0"})
    assert eval_cache.load(key) == with_tool  # a run with task.tool reuses its answers without the tool too
    path = tmp_path / "cache" / "evals" / f"{key}.json"
    path.write_text('{"pass_at_1": 0.5}')  # not a whole result: evaluated again, not trusted
    assert eval_cache.load(key) is None
    path.write_text("not json")
    assert eval_cache.load(key) is None
