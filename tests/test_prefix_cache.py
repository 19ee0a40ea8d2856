"""The prefix cache kept across weight updates (rollout_service/prefix_cache.py), on a real
vLLM engine (the toy in fp32, 32-token blocks, the CPU build's smallest) whose weights are
replaced in flight through the worker's own update path (``RolloutEngine.load_checkpoint``):

- a request started after an update never reads the old weights' KV, even while a request
  of the old version still runs (vLLM refuses to reset the cache then): its log-probs are
  the new weights' exactly, as a request that cannot hit the cache gets them;
- requests of one version do read each other's KV;
- a session's later turns read its first turn's KV, across an update between them."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

pytestmark = pytest.mark.slow

PROMPT = [5 + (i * 7) % 10 for i in range(40)]  # toy ids: one full 32-token block, then 8 more
BLOCK = 32


@pytest.fixture(scope="module")
def engine(toy_model_path, tmp_path_factory):
    """One fp32 toy engine with the prefix cache on (vLLM's default), and three weight
    versions to load into it: ``(engine, loop, {version: model})``."""
    from quant.precision_profile import profile_for
    from rlpipe.config import RolloutConfig
    from rollout_service.engine import RolloutEngine
    from tests.test_worker import perturbed

    for k, v in {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "OMP_NUM_THREADS": "1"}.items():
        os.environ.setdefault(k, v)
    models, root = {}, tmp_path_factory.mktemp("versions")
    for version in (1, 2, 3):
        models[version] = perturbed(toy_model_path, seed=40 + version)
        models[version].save_pretrained(root / f"v{version}", safe_serialization=True)
    engine = RolloutEngine(toy_model_path, profile_for("fp32", cuda=False),
                           RolloutConfig(max_model_len=64, engine={"block_size": BLOCK}))
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())
    engine.dirs = {version: str(root / f"v{version}") for version in models}
    try:
        yield engine, loop, models
    finally:
        async def shutdown():  # on the engine's loop: vLLM closes its sockets there
            engine.shutdown()

        loop.run_until_complete(shutdown())
        loop.close()


async def load(engine, version: int) -> None:
    outcome = await engine.load_checkpoint(engine.dirs[version], version)
    assert outcome.ok, outcome.error


async def one(engine, ids: list[int], **kw):
    """One sample of ``ids`` (temperature 1, fixed seed): its ``SampleResult``."""
    results, _, _ = await engine.generate(ids, n=1, temperature=1.0, max_tokens=4, seed=1, **kw)
    return results[0]


def recomputed(model, ids: list[int], tokens) -> np.ndarray:
    from tests.conftest import learner_logprobs

    return learner_logprobs(model, ids, tokens).numpy()


def test_a_request_after_an_update_reads_no_kv_of_the_old_weights_while_old_requests_run(engine):
    """The update lands while a request of the old version runs (its blocks held: vLLM's
    ``reset_prefix_cache`` fails then). A request of the new version on a prompt the old
    one cached forwards it anew and gets exactly the log-probs of a request that cannot hit
    the cache (a salt never used); salted as the old version it would read the old KV, and
    its log-probs would move. Requests of one version share the cache."""
    eng, loop, models = engine

    async def scenario():
        await load(eng, 1)
        first, again = await one(eng, PROMPT), await one(eng, PROMPT)
        assert again.cached_tokens == BLOCK and np.array_equal(again.logprobs, first.logprobs)
        for _attempt in range(3):  # the update must land while the long request runs
            running = asyncio.ensure_future(eng.generate(PROMPT[:8], n=4, temperature=1.0, max_tokens=56,
                                                         min_tokens=56, seed=2))
            while not running.done() and not any(t.counts for t in eng._active.values()):
                await asyncio.sleep(0.005)
            await load(eng, 2 if eng.version != 2 else 3)
            new = await one(eng, PROMPT)  # while the old request may still run
            (long_running, v0, v1) = await running
            if v0 != v1:
                break
        else:
            pytest.fail("the update never landed while the long request ran")
        never_cached = await one(eng, PROMPT, cache_salt="a salt no request had")
        as_old = await one(eng, PROMPT, cache_salt=first.cache_salt)
        repeat = await one(eng, PROMPT)
        return first, new, never_cached, as_old, repeat, v1

    first, new, never_cached, as_old, repeat, version = loop.run_until_complete(scenario())
    assert new.cache_salt != first.cache_salt and new.cached_tokens == 0 == never_cached.cached_tokens
    assert np.array_equal(new.tokens, never_cached.tokens) and np.array_equal(new.logprobs, never_cached.logprobs)
    assert float(np.abs(recomputed(models[version], PROMPT, new.tokens) - new.logprobs).max()) < 1e-4
    # what the salt prevents: the old weights' KV read by a request of the new ones
    assert as_old.cached_tokens == BLOCK and float(np.abs(as_old.logprobs[:1] - new.logprobs[:1]).max()) > 1e-3
    assert repeat.cached_tokens == BLOCK and np.array_equal(repeat.logprobs, new.logprobs)


def test_a_sessions_later_turn_reads_its_first_turns_kv_across_an_update(engine, toy_model_path):
    """Turn 2 comes after an update: it reads the blocks turn 1 filled (the session keeps its
    first turn's salt) and samples with the new weights; the same ids asked outside the
    session read nothing (the new version has no KV of them)."""
    from transformers import AutoTokenizer

    from rlpipe.config import RolloutConfig
    from rollout_service.api_models import Turn
    from rollout_service.sessions import Sessions

    eng, loop, _ = engine

    async def sample(ids, sampling):
        results, v0, v1 = await eng.generate(ids, n=1, **sampling)
        return results[0], v0, v1

    sessions = Sessions(RolloutConfig(max_model_len=64), AutoTokenizer.from_pretrained(toy_model_path), None,
                        sample, lambda: eng.version)

    async def scenario():
        await load(eng, 1)
        session = sessions.start(None, None, None, PROMPT[:30])
        turn = Turn(max_tokens=6, min_tokens=6, temperature=1.0, seed=3)
        first = await sessions.turn(session, turn)
        await load(eng, 3)
        second = await sessions.turn(session, Turn(token_ids=PROMPT[:4], max_tokens=4, temperature=1.0, seed=4))
        outside = await one(eng, session.ids[:-len(second.token_ids)])
        return first, second, outside

    first, second, outside = loop.run_until_complete(scenario())
    assert first.cached_tokens == 0 and first.versions == [1] * 6
    assert second.cached_tokens == BLOCK and second.versions == [3] * len(second.token_ids)
    assert outside.cached_tokens == 0
