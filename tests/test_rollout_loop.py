"""The rollout loop end to end: real ``rlpipe rollout`` workers (vLLM, fp32) on a real Redis.

- Several workers share the prompt cursor: every index is handed out once, none skipped.
- SIGTERM drains a worker: it stops taking prompts, aborts what cannot finish within
  ``rollout.shutdown_deadline_s`` and gives those prompts back; another worker trains on
  them. No accepted prompt is lost.
- Records keep the response token ids exactly as sampled, even where decoding and
  re-tokenizing them gives other ids (a tokenizer with a merge, seed 003's SID-1 note).
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from rlpipe.config import build_config, dump_config
from rlpipe.keys import Keys
from rlpipe.queue import TrajectoryQueue
from rlpipe.redis_link import connect
from rlpipe.registry import set_learner_state, worker_incarnations
from tests.conftest import (
    WorkerHarness,
    free_run_id,
    launch_worker,
    learner_logprobs,
    start_worker,
    stop_worker,
    wait_for,
)

pytestmark = pytest.mark.slow


def stream_records(q: TrajectoryQueue) -> list:
    return [e.record for e in q._decode(q.r.xrange(q.keys.traj))]


# soak: two engines for minutes; test_queue's cursor across processes and test_resume's SIGTERM cover it in the suite
@pytest.mark.soak
def test_workers_share_the_cursor_and_sigterm_gives_unfinished_prompts_back(redis_server, toy_model_path, tmp_path):
    from learner.policy import load_policy
    from weight_sync.sender import WeightSender

    cfg = build_config({}, environ={}, run_id=free_run_id("drain"), run_dir=str(tmp_path), redis_url=redis_server.url,
                       **{"model.path": toy_model_path, "rollout.precision": "fp32", "learner.groups_per_step": 100_000,
                          "queue.max_lag": 0, "rollout.max_inflight_groups": 8, "sampling.max_tokens": 16,
                          # big groups, so some are still generating when SIGTERM arrives
                          "sampling.n": 128})
    dump_config(cfg, tmp_path / "config.yaml")
    # w0 gets no time to finish anything on SIGTERM; w1 the default deadline.
    w0, _ = launch_worker(cfg, tmp_path / "config.yaml", "w0", env={"RLPIPE_ROLLOUT__SHUTDOWN_DEADLINE_S": "0"},
                          wait=False)
    w1, _ = launch_worker(cfg, tmp_path / "config.yaml", "w1")
    r, keys = connect(redis_server.url), Keys(cfg.run_id)
    q = TrajectoryQueue(r, cfg.run_id)
    wait_for(lambda: len(worker_incarnations(r, keys)) == 2, 300, interval=0.5, what="both workers registered")
    sender = WeightSender(r, keys, "127.0.0.1", timeout_s=60, bucket_bytes=1 << 20, wire_dtype=torch.float32)
    try:
        assert sender.sync(0, load_policy(toy_model_path).named_parameters, worker_incarnations(r, keys)).members == 2
        set_learner_state(r, keys, version=0, step=0, status="running")

        def produced_by():
            return Counter(rec.worker_id for rec in stream_records(q))

        wait_for(lambda: min(produced_by().get(w, 0) for w in ("w0", "w1")) >= 5, 120, what="both producing")
        # SIGTERM just after w0 leases a new prompt, so at least that group is still generating.
        # (Its groups run in lockstep: at a random moment all of them may be pushing, and a
        # pushing group is always finished, so there would be nothing to give back.)
        leased_before = set(r.hkeys(keys.leases("w0")))
        wait_for(lambda: set(r.hkeys(keys.leases("w0"))) - leased_before, 60, interval=0.005,
                 what="w0 starting a new group")
        both_running_until = time.time()
        w0.send_signal(signal.SIGTERM)
        assert w0.wait(60) == 0
        log0 = (tmp_path / "worker.log").read_text()
        given = re.search(r"gave back (\d+) unfinished prompts \[([\d, ]*)\]", log0)
        assert given, log0[-2000:]
        given_back = [int(x) for x in given.group(2).split(",")]
        assert len(given_back) == int(given.group(1)) > 0
        assert not r.exists(keys.worker("w0"))  # left the registry

        def taken_up():  # w1 generated the prompts w0 gave back
            done = {int(rec.prompt_id) for rec in stream_records(q) if rec.worker_id == "w1"}
            return set(given_back) <= done

        wait_for(taken_up, 60, what="w1 finishing w0's given-back prompts")
        w1.send_signal(signal.SIGTERM)
        assert w1.wait(60) == 0
    finally:
        sender.drop()
        for p in (w0, w1):
            stop_worker(p)
    records = stream_records(q)
    ids = [int(rec.prompt_id) for rec in records]  # prompt_id == cursor index below task.size
    returned = [int(x) for x in r.lrange(keys.returned, 0, -1)]
    handed = int(r.get(keys.cursor))
    assert handed < cfg.task.size
    assert len(ids) == len(set(ids)), "a prompt was generated twice"
    assert sorted(ids + returned) == list(range(handed)), "a prompt was lost or duplicated"
    # While both ran, both got a fair part of the cursor.
    shares = Counter(rec.worker_id for rec in records if rec.created_at < both_running_until)
    assert min(shares["w0"], shares["w1"]) >= 0.25 * sum(shares.values()), shares


def build_merge_model(out: Path) -> Path:
    """A random tiny Qwen2 whose tokenizer has the merged token ``ab`` as well as ``a``
    and ``b``: a sampled ``a`` then ``b`` decodes to text that re-tokenizes to ``ab``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", "a", "b", "c", "ab"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("ab|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(out)
    torch.manual_seed(0)
    # head_dim 64: vLLM's CPU attention has kernels for 32, 64, 80, ... but not 16.
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).float().save_pretrained(out, safe_serialization=True)
    return out


def test_records_keep_tokens_as_sampled_when_retokenizing_differs(redis_server, tmp_path):
    from transformers import AutoTokenizer

    from learner.policy import load_policy

    model_dir = build_merge_model(tmp_path / "merge-model")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n"
                                                    for p in ("abc", "cab", "bca", "cc")))
    cfg, proc, address = start_worker(redis_server.url, str(model_dir), tmp_path, **{
        "task.type": "math", "task.dataset": str(tmp_path / "prompts.jsonl"), "sampling.max_tokens": 24,
        "learner.groups_per_step": 1000})  # many groups of version 0
    harness = WorkerHarness(cfg, proc, address, connect(redis_server.url))
    tok, model = AutoTokenizer.from_pretrained(model_dir), load_policy(str(model_dir))
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    try:
        version = harness.sync(model)
        found = []
        while len(found) < 3:
            rec = harness.next_group(version)
            for s in rec.samples:
                tokens = s.tokens.tolist()
                if any(x == a and y == b for x, y in zip(tokens, tokens[1:])):
                    found.append((rec, s))
    finally:
        harness.sender.drop()
        stop_worker(proc)
    for rec, s in found:
        retokenized = tok(tok.decode(s.tokens, skip_special_tokens=True))["input_ids"][1:]  # drop <bos>
        assert retokenized != s.tokens.tolist()  # the text alone would not give back these ids
        assert s.logprobs.shape == s.tokens.shape
        # The recorded log-probs are the model's log-probs of exactly these tokens (fp32 engine).
        ours = learner_logprobs(model, rec.prompt_tokens.tolist(), s.tokens.tolist()).numpy()
        np.testing.assert_allclose(s.logprobs, ours, atol=2e-4)
        assert s.reward == 0.0 and s.reward_info["format_ok"] is False  # math task: no boxed answer


def test_a_group_whose_verifier_fails_is_given_back_and_scored_later(redis_server, toy_model_path, tmp_path, verifier):
    """A remote verifier answers 503 to its first requests (no retries configured): those
    groups are not pushed with made-up rewards; their prompts go back to the cursor and
    come out later with the verifier's real rewards."""
    from transformers import AutoTokenizer

    from learner.policy import load_policy

    verifier.plan = ["503"] * 3
    rows = [{"id": f"p{i}", "prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg, proc, address = start_worker(redis_server.url, toy_model_path, tmp_path, **{
        "task.type": "remote", "task.dataset": str(tmp_path / "d.jsonl"), "task.verifier_url": verifier.url,
        "task.verifier_retries": 0, "task.shuffle": False, "learner.groups_per_step": 1000,
        "rollout.max_inflight_groups": 2})
    harness = WorkerHarness(cfg, proc, address, connect(redis_server.url))
    try:
        harness.sync(load_policy(toy_model_path))
        wait_for(lambda: len(verifier.seen) >= 12, 60, what="the verifier asked a dozen times")
        failed = {body["prompt_id"] for _, body in verifier.seen[:3]}
        q = harness.queue

        def redone():
            done = {rec.prompt_id: rec for rec in stream_records(q)}
            return failed <= set(done) and done

        done = wait_for(redone, 60, what="the failed prompts generated again")
        metrics = harness.http.get("/metrics").text
    finally:
        harness.sender.drop()
        stop_worker(proc)
    assert failed  # (a prompt given back is handed out first, so it may have failed twice)
    tok = AutoTokenizer.from_pretrained(toy_model_path)
    for rec in done.values():  # every pushed reward is the verifier's (it scores the text's length)
        texts = [tok.decode(s.tokens, skip_special_tokens=True) for s in rec.samples]
        assert [s.reward for s in rec.samples] == [float(len(t)) for t in texts]
        assert rec.samples[1].reward_info == {"len": len(texts[1])}
    assert re.search(r'rlpipe_rollout_reward_errors_total\{[^}]*\} 3\.0', metrics), metrics
    assert re.search(r'rlpipe_rollout_prompts_given_back_total\{[^}]*\} 3\.0', metrics)
