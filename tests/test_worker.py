"""A real rollout worker (vLLM engine in fp32) against the learner's own log-prob code."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from learner.policy import load_policy
from rlpipe import registry
from tests.conftest import learner_logprobs, max_diff, wait_for

pytestmark = pytest.mark.slow


def perturbed(path: str, seed: int, scale: float = 0.05):
    model = load_policy(path)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return model


def test_worker_group_logprobs_equal_learner_fp32(worker, toy_model_path):
    model = load_policy(toy_model_path)
    version = worker.sync(model)
    rec = worker.next_group(version)
    assert rec.precision == "fp32" and rec.worker_id == "w0"
    assert rec.policy_version == rec.policy_version_end == version
    assert len(rec.samples) == worker.cfg.sampling.n
    assert max_diff(model, rec) < 1e-4
    # The reward is the task's verdict on the decoded response.
    from transformers import AutoTokenizer

    from rollout_service.tasks import make_task

    task, tok = make_task(worker.cfg.task), AutoTokenizer.from_pretrained(toy_model_path)
    prompt = task.prompt(int(rec.prompt_id))
    assert tok(prompt.text)["input_ids"] == rec.prompt_tokens.tolist()
    texts = [tok.decode(s.tokens, skip_special_tokens=True) for s in rec.samples]
    assert [s.reward for s in rec.samples] == [r for r, _ in asyncio.run(task.score(prompt, texts))]


def test_logprobs_equal_learner_after_weight_sync(worker, toy_model_path):
    base = load_policy(toy_model_path)
    model = perturbed(toy_model_path, seed=1)
    version = worker.sync(model)
    rec = worker.next_group(version)
    assert max_diff(model, rec) < 1e-4
    assert max_diff(base, rec) > 1e-2  # the update really changed the engine's policy
    # The HTTP path samples from the same, updated engine.
    resp = worker.http.post("/v1/generate", json={"prompt_token_ids": rec.prompt_tokens.tolist(), "n": 4,
                                                  "max_tokens": 6, "seed": 7})
    resp.raise_for_status()
    body = resp.json()
    assert body["policy_version"] == version
    for choice in body["choices"]:
        ours = learner_logprobs(model, rec.prompt_tokens, choice["tokens"])
        assert float((ours - torch.tensor(choice["logprobs"])).abs().max()) < 1e-4


def test_second_sync_replaces_first(worker, toy_model_path):
    first, second = perturbed(toy_model_path, seed=2), perturbed(toy_model_path, seed=3)
    worker.sync(first)
    version = worker.sync(second)
    rec = worker.next_group(version)
    assert max_diff(second, rec) < 1e-4
    assert max_diff(first, rec) > 1e-2


def test_health_ready_metrics_status(worker):
    assert worker.http.get("/healthz").json()["status"] == "ok"
    worker.next_group(worker.sync(load_policy(worker.cfg.model.path)))
    ready = worker.http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["version"] == worker.version, ready.text
    status = worker.http.get("/v1/status").json()
    assert status["precision"] == "fp32" and status["synced"] and status["sync_generation"] >= 1
    assert status["paused_seconds_total"] > 0 and status["prefix_cache_salt"].endswith(f"-v{worker.version}")
    metrics = worker.http.get("/metrics").text
    groups = [line for line in metrics.splitlines() if line.startswith("rlpipe_rollout_groups_total")]
    assert groups and float(groups[0].split()[-1]) >= 1
    assert "rlpipe_rollout_policy_version" in metrics and "rlpipe_weight_sync_pause_seconds" in metrics
    # Prometheus conventions hold on the real page, and every series carries the worker's run
    from tests.ops_tools import check_metrics, samples_without

    check_metrics(metrics)
    assert not samples_without(metrics, "run_id", worker.cfg.run_id)
    assert f'process_start_time_seconds{{run_id="{worker.cfg.run_id}"}}' in metrics


def test_each_update_records_its_activation_pause_and_the_pause_excludes_staging(worker, toy_model_path):
    """The pause is measured where the engine pauses generation (loading the staged weights),
    one observation per update, on /metrics, /v1/status and in the registry: with a learner
    that takes a second per bucket to send, the worker stages (receives) for seconds while
    generating, and the pause stays a small part of that."""
    import json
    import re

    def pauses() -> tuple[float, float]:
        text = worker.http.get("/metrics").text
        count, total = (float(re.search(rf"^rlpipe_weight_sync_pause_seconds_{k}{{[^}}]*}} (\S+)$", text, re.M)
                              .group(1)) for k in ("count", "sum"))
        return count, total

    def last_sync(version: int) -> dict:
        # the version shows in the engine a moment before the update is recorded
        return wait_for(lambda: (s := worker.http.get("/v1/status").json()["last_sync"]).get("version") == version
                        and s, 10, what=f"version {version} recorded")

    model = load_policy(toy_model_path)
    count, total = pauses()
    last_sync(worker.sync(model))
    assert pauses()[0] == count + 1

    def slow(names):  # the learner's gather hook: called before each bucket is packed
        time.sleep(1.0)
        return {n: worker.sent[n] for n in names}

    count, total = pauses()
    worker.sender.gather = slow
    try:
        version = worker.sync(model)
    finally:
        worker.sender.gather = None
    last = last_sync(version)
    assert last["source"] == "learner"
    new_count, new_total = pauses()
    assert new_count == count + 1 and new_total - total == pytest.approx(last["pause_s"], abs=1e-5)
    assert last["transfer_s"] >= 1.0 and 0 < last["pause_s"] < 0.25 * last["transfer_s"]
    assert last["activated_at"] <= time.time()
    published = json.loads(registry.live_workers(worker.r, worker.keys)["w0"]["last_sync"])
    assert published["activated_at"] == last["activated_at"] and published["pause_s"] == last["pause_s"]


def test_a_worker_held_by_back_pressure_counts_idle_seconds_and_generating_is_not_idle(worker, toy_model_path):
    """max_lag 0 and a learner that consumes nothing: once its one group is pushed the worker
    has nothing in flight, and every second of that is idle (what the learner sums into its
    metrics, and the worker's Prometheus counter); the time it generates is not."""
    def held():  # the registry says so: its last group pushed, the idle period published
        fields = registry.live_workers(worker.r, worker.keys)["w0"]
        return fields["inflight"] == "0" and float(fields["idle_since"]) > 0

    def idle_now() -> tuple[float, float]:
        now = time.time()
        total, workers = registry.fleet_idle_seconds(worker.r, worker.keys, now)
        assert workers == 1
        return now, total

    model = load_policy(toy_model_path)
    worker.next_group(worker.sync(model))
    wait_for(held, 30, what="the worker held by back-pressure")
    t0, idle0 = idle_now()
    time.sleep(1.0)
    t1, idle1 = idle_now()
    assert idle1 - idle0 == pytest.approx(t1 - t0, abs=0.02)
    scraped = [line for line in worker.http.get("/metrics").text.splitlines()
               if line.startswith("rlpipe_rollout_idle_seconds_total")]
    t2, idle2 = idle_now()
    assert scraped and idle1 - 0.02 <= float(scraped[0].split()[-1]) <= idle2 + 0.02
    # The next version lets one group through: the seconds it generated are not idle.
    rec = worker.next_group(worker.sync(model))
    wait_for(held, 30, what="the worker held again")
    t3, idle3 = idle_now()
    assert 0 < idle3 - idle1 <= (t3 - t1) - rec.gen_seconds + 0.02


@pytest.mark.parametrize("body, field", [
    ({"prompt_token_ids": [1, 5], "n": 0}, "n"),
    ({"prompt_token_ids": [1, 5], "n": 10_000}, "n"),
    ({"prompt_token_ids": [1, 5], "max_tokens": 0}, "max_tokens"),
    ({"prompt_token_ids": [1, 5], "max_tokens": 100_000}, "max_tokens"),
    ({"prompt_token_ids": [1, 5], "temperature": -1}, "temperature"),
    ({"prompt_token_ids": [1, 5], "top_p": 0}, "top_p"),
    ({"prompt_token_ids": [1, 99999]}, "prompt_token_ids"),
    ({"prompt_token_ids": [-3]}, "prompt_token_ids"),
    ({"prompt_token_ids": []}, "prompt_token_ids"),
    ({"prompt_token_ids": [1] * 500}, "prompt_token_ids"),
    ({"prompt_token_ids": "12"}, "prompt_token_ids"),
    ({"prompt": "1+1=", "prompt_token_ids": [1]}, None),
    ({}, None),
    ({"prompt": "1+1=", "bogus": 1}, "bogus"),
])
def test_generate_rejects_bad_input_with_the_field_named(worker, body, field):
    resp = worker.http.post("/v1/generate", json=body)
    assert resp.status_code == 422, resp.text
    if field:
        assert any(field in map(str, err["loc"]) for err in resp.json()["detail"]), resp.text


def test_generate_rejects_oversized_and_malformed_bodies(worker):
    resp = worker.http.post("/v1/generate", content=b"{" + b" " * (2 << 20) + b"}",
                            headers={"content-type": "application/json"})
    assert resp.status_code == 413
    # A body that is not JSON is the client's syntax error: 400, as docs/rollout.md says.
    resp = worker.http.post("/v1/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    # Nothing a client sent took the worker down.
    assert worker.http.get("/healthz").status_code == 200
    # The engine's own rule (greedy sampling needs n = 1) is a 422 too, not a 500.
    resp = worker.http.post("/v1/generate", json={"prompt": "12+30=", "n": 2, "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 422 and "n" in map(str, resp.json()["detail"][0]["loc"])
    greedy = [worker.http.post("/v1/generate", json={"prompt": "12+30=", "max_tokens": 4, "temperature": 0})
              for _ in range(2)]
    assert [g.status_code for g in greedy] == [200, 200]
    assert greedy[0].json()["choices"][0]["tokens"] == greedy[1].json()["choices"][0]["tokens"]
    assert np.isfinite(greedy[0].json()["choices"][0]["logprobs"]).all()


def logprobs_without_eos(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The model's log-probs of ``tokens`` with end-of-sequence masked out (what vLLM
    samples from under ``min_tokens``)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logits[:, model.config.eos_token_id] = float("-inf")
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def switch_point(versions: list[int] | None, new_version: int) -> int:
    """Index of the first token sampled by ``new_version`` (len if none; -1 if no record)."""
    if versions is None:
        return -1
    return versions.index(new_version) if new_version in versions else len(versions)


def test_an_update_lands_in_flight_and_every_token_records_its_version(worker, toy_model_path):
    """Requests started before an update finish after it: each token says which weights
    sampled it, the tokens before the switch are exactly the old policy's, and the ones
    after come from the new weights (on the old prefix's KV cache, so only close to them).

    ``min_tokens`` keeps every response running to the end; vLLM then samples with the
    end-of-sequence token masked, and the behavior log-probs say so (as they must for
    importance sampling), so the reference masks it too."""
    old, new = perturbed(toy_model_path, seed=4), perturbed(toy_model_path, seed=5)
    old_version = worker.sync(old)
    prompt = worker.next_group(old_version).prompt_tokens.tolist()
    length = worker.cfg.rollout.max_model_len - len(prompt)
    request = {"prompt_token_ids": prompt, "n": 8, "max_tokens": length, "min_tokens": length, "seed": 3}
    with ThreadPoolExecutor(1) as pool:
        for _attempt in range(5):  # the update must land while the request runs; usually the first try
            pending = pool.submit(worker.http.post, "/v1/generate", json=request)
            wait_for(lambda: worker.http.get("/v1/status").json()["inflight_requests"] > 0, 30)
            new_version = worker.sync(new)
            body = pending.result().json()
            if any(0 < switch_point(c["versions"], new_version) < length for c in body["choices"]):
                break
            old_version = worker.sync(old)
        else:
            pytest.fail("the update never landed in the middle of a request")
    assert body["policy_version"] == old_version and body["policy_version_end"] == new_version
    switched = 0
    for c in body["choices"]:
        versions = c["versions"]
        assert len(versions) == len(c["tokens"]) == length
        assert set(versions) <= {old_version, new_version} and versions == sorted(versions)
        k = switch_point(versions, new_version)
        lp = torch.tensor(c["logprobs"])
        reference = logprobs_without_eos(old, prompt, c["tokens"])
        assert float((reference[:k] - lp[:k]).abs().max()) < 1e-4
        if 0 < k < length:
            switched += 1
            assert float((reference[k:] - lp[k:]).abs().mean()) > 1e-2
    assert switched >= 1
