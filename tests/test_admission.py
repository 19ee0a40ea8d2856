"""Well-formed is not valid: records checked against the run before they reach a batch
(rlpipe/admission.py), foreign entries in the books, and the lease-epoch fence, on a real
Redis. The property tests throw any bytes and any mutation of a valid record at the reader:
each entry is either admitted, and then trains without error on the real toy model, or
dead-lettered with a reason; the reader never raises."""

from __future__ import annotations

import dataclasses
import math
import os

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from learner.batch import collate
from learner.loss import compute_advantages
from learner.policy import load_policy, token_logprobs
from rlpipe import registry
from rlpipe.admission import INDEX_SLACK, RunCheck
from rlpipe.fence import Fenced
from rlpipe.queue import TrajectoryQueue
from rlpipe.schema import Sample, encode_group
from tests.conftest import free_run_id
from tests.test_schema import make_record

VOCAB, N, MAX_TOKENS, MAX_MODEL_LEN, VERSION, CURSOR = 20, 2, 8, 64, 4, 50


def run_check(run_id: str) -> RunCheck:
    return RunCheck(run_id=run_id, vocab_size=VOCAB, n=N, max_tokens=MAX_TOKENS, max_model_len=MAX_MODEL_LEN,
                    sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": MAX_TOKENS},
                    precisions=("fp8",), version=VERSION)


@pytest.fixture
def queue(r):
    q = TrajectoryQueue(r, free_run_id("adm"), run_check("placeholder"))
    q.check.run_id = q.keys.prefix.split(":")[1]
    q.ensure_consumer_group()
    r.set(q.keys.cursor, CURSOR)
    r.hset(q.keys.attempts, 7, 2)  # prompt 7 was re-issued twice
    return q


def valid(q, **overrides):
    """make_record's group, as this run's workers would have made it."""
    return make_record(**{"run_id": q.check.run_id, "prompt_index": 7, "attempt": 2, **overrides})


def sample(tokens, versions=None) -> Sample:
    tokens = np.asarray(tokens, dtype=np.int32)
    return Sample(tokens, np.full(len(tokens), -0.5, dtype=np.float32), "stop", 1.0,
                  None if versions is None else np.asarray(versions, dtype=np.int32))


def books_balance(q) -> bool:
    c = q.counters()
    return c["produced"] == c["trained"] + c["dropped_stale"] + c["dead"] + c["duplicate"] + c["filtered"] + q.length()


FORGERIES = {
    "future version": (dict(policy_version=10**6, policy_version_end=10**6), "policy_version"),
    "another run": (dict(run_id="someone-else"), "run_id"),
    "another precision": (dict(precision="int8"), "precision"),
    "negative temperature": (dict(sampling={"temperature": -1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8}),
                             "sampling.temperature"),
    "NaN temperature": (dict(sampling={"temperature": math.nan, "top_p": 1.0, "top_k": -1, "max_tokens": 8}),
                        "sampling.temperature"),
    "temperature as a string": (dict(sampling={"temperature": "1.0", "top_p": 1.0, "top_k": -1, "max_tokens": 8}),
                                "sampling.temperature"),
    "another max_tokens": (dict(sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 2048}),
                           "sampling.max_tokens"),
    "empty response": (dict(samples=[sample([5, 2]), sample([])]), "empty response"),
    "per-token versions outside": (dict(samples=[sample([5, 2]), sample([6, 2], [-5, 3])]), "versions"),
    "fewer samples than n": (dict(samples=[sample([5, 2])]), "sampling.n"),
    "token id past the vocabulary": (dict(samples=[sample([5, 2]), sample([VOCAB + 3, 2])]), "vocabulary"),
    "prompt token past the vocabulary": (dict(prompt_tokens=np.array([1, 10**6], dtype=np.int32)), "vocabulary"),
    "2048-token samples": (dict(samples=[sample([5] * 2048), sample([5] * 2048)]), "sampling.max_tokens"),
    "longer than max_model_len": (dict(prompt_tokens=np.ones(MAX_MODEL_LEN - 2, dtype=np.int32)), "max_model_len"),
    "prompt never handed out": (dict(prompt_index=2 * CURSOR + INDEX_SLACK), "prompt_index"),
    "prompt 2^62": (dict(prompt_index=2**62), "prompt_index"),
    "attempt 999": (dict(attempt=999), "attempt"),
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_a_well_formed_record_that_does_not_fit_the_run_is_dead_lettered_with_its_reason(queue, name):
    overrides, reason = FORGERIES[name]
    queue.push(valid(queue, group_id="good"))
    forged_id = queue.push(valid(queue, group_id="forged", **overrides))
    got = queue.read("learner-0", 10, block_ms=100)
    assert [e.record.group_id for e in got] == ["good"]  # the valid one is untouched
    (dead_id, dead), = queue.r.xrange(queue.keys.dead)
    assert dead[b"source_id"].decode() == forged_id and reason in dead[b"reason"].decode(), dead[b"reason"]
    assert books_balance(queue) and queue.counters()["dead"] == 1


def test_records_the_run_could_have_made_are_admitted(queue):
    """Versions up to the learner's, per-token versions in the record's span, a prompt not
    from the cursor (-1: imported data), a prompt at its first hand-out, and one a restarted
    Redis forgot handing out."""
    ok = [valid(queue, policy_version=VERSION - 1, policy_version_end=VERSION,
                samples=[sample([5, 2], [3, 4]), sample([6, 7, 2], [3, 4, 4])]),
          valid(queue, prompt_index=-1, attempt=0, policy_version=0, policy_version_end=0,
                samples=[sample([5, 2]), sample([6, 2])]),
          valid(queue, prompt_index=CURSOR - 1, attempt=0, policy_version=0, policy_version_end=0,
                samples=[sample([5] * MAX_TOKENS), sample([2])]),
          # handed out just before a Redis restart that lost the cursor's and the re-issue's increments
          valid(queue, prompt_index=CURSOR + 20, attempt=1, policy_version=0, policy_version_end=0,
                samples=[sample([5, 2]), sample([6, 2])])]
    for rec in ok:
        queue.push(rec)
    assert len(queue.read("learner-0", 10, block_ms=100)) == 4 and queue.counters()["dead"] == 0


def test_foreign_entries_keep_the_books_balanced_and_raise_no_allowance(queue):
    """Raw XADDs (never counted as produced) are dead-lettered and counted as produced and
    dead at once: the books balance, and the workers' back-pressure allowance is what it
    was (it used to grow by one for each such dead letter)."""
    r = queue.r
    registry.set_learner_state(r, queue.keys, version=VERSION, consumed=0)
    for i in range(3):
        queue.push(valid(queue, group_id=f"g{i}"))
    allowance = queue.lease_prompts("w0", 0, (VERSION, 4, 1)).allowance
    raw = encode_group(valid(queue, group_id="raw"))
    foreign = [r.xadd(queue.keys.traj, {"data": raw}).decode(), r.xadd(queue.keys.traj, {"junk": b"x"}).decode(),
               r.xadd(queue.keys.traj, {"data": b"\xc1not msgpack"}).decode()]
    assert not books_balance(queue)  # until the reader sees them
    got = queue.read("learner-0", 10, block_ms=100)
    assert [e.record.group_id for e in got] == ["g0", "g1", "g2"]
    reasons = {d[b"source_id"].decode(): d[b"reason"].decode() for _, d in r.xrange(queue.keys.dead)}
    assert set(reasons) == set(foreign) and "foreign" in reasons[foreign[0]]
    c = queue.counters()
    assert books_balance(queue) and c["foreign"] == 3 and c["dead"] == 3
    assert queue.lease_prompts("w0", 0, (VERSION, 4, 1)).allowance == allowance



def test_a_forged_counted_field_leaves_the_books_balanced(queue):
    """Whether an entry was counted as produced is the queue's to know (the push records it
    beside the stream), never the entry's to say: raw XADDs that carry a ``counted`` field, as
    rlpipe's own entries once did, are foreign all the same. They used to be trusted: a junk
    one was dead-lettered without being counted as produced, and a well-formed one was
    admitted and trained, each leaving the books off by one."""
    r = queue.r
    registry.set_learner_state(r, queue.keys, version=VERSION, consumed=0)
    for i in range(2):
        queue.push(valid(queue, group_id=f"g{i}"))
    forged = [r.xadd(queue.keys.traj, {"data": encode_group(valid(queue, group_id="forged")), "counted": 1}),
              r.xadd(queue.keys.traj, {"junk": b"x", "counted": 1}),
              r.xadd(queue.keys.traj, {"data": b"\xc1not msgpack", "counted": b"1"})]
    got = queue.read("learner-0", 10, block_ms=100)
    assert [e.record.group_id for e in got] == ["g0", "g1"]
    queue.ack([e.entry_id for e in got])
    reasons = {d[b"source_id"]: d[b"reason"].decode() for _, d in r.xrange(queue.keys.dead)}
    assert set(reasons) == set(forged) and "foreign" in reasons[forged[0]], reasons
    c = queue.counters()
    assert books_balance(queue) and c["foreign"] == 3 and c["dead"] == 3 and c["trained"] == 2, c

# -- the property: trained or dead-lettered, never raised ----------------------------------------------
@pytest.fixture(scope="module")
def toy(toy_model_path):
    return load_policy(toy_model_path)


def trains(model, records) -> None:
    """What the learner does with admitted records before its optimizer: advantages, the
    padded batch and a forward (a record that passes admission must get through these)."""
    rewards = torch.tensor([r.rewards for r in records], dtype=torch.float32)
    advantages, _ = compute_advantages(rewards, "grpo", True)
    with torch.no_grad():
        logp, _ = token_logprobs(model, collate(records, advantages, VERSION))
    assert torch.isfinite(logp).all()


def valid_payload(q) -> dict:
    rec = valid(q, policy_version=3, policy_version_end=4)
    return msgpack.unpackb(encode_group(rec), raw=False)


ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**63, max_value=2**64 - 1),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), st.binary(max_size=64),
                      st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(),
                                                                             max_size=2))
FIELDS = ["schema", "run_id", "group_id", "prompt_id", "worker_id", "policy_version", "policy_version_end",
          "precision", "quant_profile", "sampling", "prompt_tokens", "samples", "created_at", "gen_seconds",
          "prompt_index", "attempt", "sampling.temperature", "sampling.top_k", "sampling.max_tokens", "sampling.seed",
          "samples.0", "samples.0.tokens", "samples.0.logprobs", "samples.0.versions", "samples.0.mask", "samples.0.reward",
          "samples.1.finish_reason", "samples.1.reward_info"]


def mutate(payload: dict, path: str, value) -> dict:
    node = payload
    *parents, last = path.split(".")
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(last)] = value
    elif value is None and last in node:
        del node[last]  # a missing field
    else:
        node[last] = value
    return payload


def read_one(q, data: bytes) -> list:
    q.push_data(data)  # as a worker's push would add it, whatever it holds
    dead_before = q.r.xlen(q.keys.dead)
    got = q.read("learner-0", 10, block_ms=None)
    dead = q.r.xrange(q.keys.dead)[dead_before:]
    assert len(got) + len(dead) == 1, (got, dead)
    if dead:
        assert dead[0][1][b"reason"], "a dead letter without a reason"
    return [e.record for e in got]


# The same cases every run, a reproducible gate, as the API fuzz's (tests/test_api.py):
# RLPIPE_FUZZ_RANDOM=1 explores new ones (one such run found the negative prompt id below;
# 21 more, 6,300 cases, found nothing else).
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
                    derandomize=os.environ.get("RLPIPE_FUZZ_RANDOM", "") != "1", database=None)


@PROPERTY
@given(data=st.binary(max_size=512))
def test_any_bytes_are_admitted_or_dead_lettered_never_raised(queue, toy, data):
    records = read_one(queue, data)
    if records:
        trains(toy, records)


@PROPERTY
@given(path=st.sampled_from(FIELDS), value=ANY_VALUE)
def test_any_mutation_of_a_valid_record_is_trained_or_dead_lettered_never_raised(queue, toy, path, value):
    try:
        data = msgpack.packb(mutate(valid_payload(queue), path, value), use_bin_type=True)
    except (OverflowError, ValueError, TypeError):  # not encodable as msgpack: no such entry can exist
        return
    records = read_one(queue, data)
    if records:
        trains(toy, records)


@pytest.mark.parametrize("path", ["prompt_tokens", "samples.0.tokens"])
def test_a_negative_token_id_is_dead_lettered_naming_its_field(queue, path):
    """Found by the mutation property: prompt_tokens' bytes replaced by random ones held a
    negative int32, the record was admitted, and the learner's embedding failed on it."""
    payload = valid_payload(queue)
    node = payload["samples"][0] if path.startswith("samples") else payload
    field = path.rsplit(".", 1)[-1]
    ids = np.frombuffer(node[field], dtype="<i4").copy()
    ids[0] = -3
    node[field] = ids.tobytes()
    assert read_one(queue, msgpack.packb(payload, use_bin_type=True)) == []
    reason = queue.r.xrange(queue.keys.dead)[-1][1][b"reason"].decode()
    assert f"{field}: negative token id" in reason, reason


def test_an_admitted_record_trains(queue, toy):
    """The property's other branch is reachable: the valid record itself goes through."""
    records = read_one(queue, msgpack.packb(valid_payload(queue), use_bin_type=True))
    assert len(records) == 1
    trains(toy, records)


# -- the zombie learner is fenced ----------------------------------------------------------------------
def test_a_learner_that_lost_its_lease_can_neither_acknowledge_nor_publish(r):
    """Learner A holds the lease (epoch e), is paused past its TTL, and B takes the lease
    (epoch e + 1). Every write of A that could undo B's work is refused by Redis itself:
    acknowledging, dead-lettering, publishing its state. B's go through."""
    run_id = free_run_id("fence")
    a_queue, b_queue = TrajectoryQueue(r, run_id), TrajectoryQueue(r, run_id)
    a_queue.ensure_consumer_group()
    a = registry.LearnerLease(r, a_queue.keys, ttl_s=30)
    assert a.try_acquire()
    a_queue.fence = a.fence
    for i in range(3):
        a_queue.push(dataclasses.replace(make_record(group_id=f"g{i}"), run_id=run_id))
    entries = a_queue.read("learner-0", 3, block_ms=100)
    r.delete(a.key)  # A's lease expired while it was paused
    b = registry.LearnerLease(r, b_queue.keys, ttl_s=30)
    assert b.try_acquire() and b.epoch == a.epoch + 1
    b_queue.fence = b.fence
    with pytest.raises(Fenced):
        a_queue.ack([entries[0].entry_id])
    with pytest.raises(Fenced):
        a_queue.dead_letter(entries[1].entry_id, {b"data": b""}, "zombie")
    with pytest.raises(Fenced):
        registry.set_learner_state(r, a_queue.keys, a.fence, version=99)
    assert a_queue.pending() == 3 and a_queue.counters()["trained"] == 0 and r.xlen(a_queue.keys.dead) == 0
    assert registry.learner_state(r, a_queue.keys).get("version") is None
    b_queue.ack([e.entry_id for e in entries])
    registry.set_learner_state(r, b_queue.keys, b.fence, version=5)
    assert b_queue.counters()["trained"] == 3 and registry.learner_version(r, b_queue.keys) == 5
