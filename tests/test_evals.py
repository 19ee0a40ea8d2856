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

from learner.evals import Evals
from learner.metrics import LearnerMetrics, read_jsonl
from rlpipe import registry
from rlpipe.config import ConfigError, build_config, validate_run
from rlpipe.datasets import load_rows, question_key
from rlpipe.queue import Keys
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
    assert task.size == len(load_rows("mawps:singleeq")) - 36
    assert not train & set(held_out)
    with pytest.raises(ConfigError, match=r"eval.dataset: .*share 36 question"):
        validate_run(eval_config(**{"eval.drop_shared": False}))
    with pytest.raises(ConfigError, match="eval.dataset: the same"):
        validate_run(eval_config(**{"eval.dataset": "mawps:singleop"}))
