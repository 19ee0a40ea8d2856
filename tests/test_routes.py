"""Routing replay's capture (rollout_service/routes.py): the experts a real vLLM engine routed
each forwarded token to, per request and child, equal those Hugging Face's router picks for
the same tokens in fp32, through chunked prefill, requests batched together and n > 1; and
the runner's batch layout (rows by request, by position, recomputed, freed) on a stand-in."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.families import save_tiny_model

pytestmark = pytest.mark.slow

BUDGET = 16  # rollout.max_num_batched_tokens: a longer prompt is prefilled over several steps


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    """One fp32 engine on the tiny Qwen3-MoE (4 experts, top-2, 2 layers) with routing replay on."""
    from quant.precision_profile import profile_for
    from rlpipe.config import RolloutConfig
    from rollout_service.engine import RolloutEngine

    for k, v in {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "OMP_NUM_THREADS": "1"}.items():
        os.environ.setdefault(k, v)
    path = save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("moe") / "model")
    cfg = RolloutConfig(max_model_len=64, max_num_batched_tokens=BUDGET, routing_replay=True)
    engine = RolloutEngine(path, profile_for("fp32", cuda=False), cfg)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())
    try:
        yield engine, loop, path
    finally:
        async def shutdown():  # on the engine's loop: vLLM closes its sockets there (else exiting hangs)
            engine.shutdown()

        loop.run_until_complete(shutdown())
        loop.close()


def hf_routes(model, ids: list[int]) -> np.ndarray:
    """(len(ids), layers, top_k): the experts transformers' own Qwen3MoeTopKRouter picks."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    picked = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: picked.append(out[2]))
             for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(picked, 1).numpy()


def test_each_samples_routes_are_the_experts_hugging_face_routes_its_tokens_to(moe_engine):
    """Three requests at once (one prompt longer than a step's token budget, so prefilled in
    chunks while the others decode; n = 1, 2, 3): every sample carries one row per forwarded
    token (P + L - 1) and each row's experts are the set transformers picks, in fp32."""
    from learner.policy import load_policy

    engine, loop, path = moe_engine
    assert engine.routing == (2, 2, 4)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 20, size=p).tolist() for p in (5, 12, BUDGET * 2 - 2)]

    async def all_at_once():
        return await asyncio.gather(*[engine.generate(p, n=n, temperature=1.0, max_tokens=14 + 3 * n, seed=10 + n)
                                      for n, p in enumerate(prompts, 1)])

    outs = loop.run_until_complete(all_at_once())
    model = load_policy(path)
    checked, diffs = 0, []
    for prompt, (samples, _, _) in zip(prompts, outs):
        for s in samples:
            assert len(s.tokens) >= 1 and s.finish_reason in ("stop", "length")
            assert s.routes.shape == (len(prompt) + len(s.tokens) - 1, 2, 2) and s.routes.dtype == np.uint8
            want = hf_routes(model, prompt + s.tokens.tolist()[:-1])
            diffs.append(int((np.sort(s.routes, -1) != np.sort(want, -1)).any(-1).sum()))
            checked += len(want)
    print({"rows_checked": checked, "rows_differing": diffs})
    assert checked > 100 and sum(diffs) == 0
    picked = {tuple(sorted(r)) for _, (samples, _, _) in zip(prompts, outs) for s in samples
              for r in s.routes.reshape(-1, 2).tolist()}
    assert len(picked) > 3  # the router does choose: a wrong row would show
    assert len({s.tokens.tobytes() for s in outs[2][0]}) > 1  # the children sampled apart


class _Router:
    top_k, global_num_experts = 2, 300  # > 256 experts: uint16 rows

    def set_capture_fn(self, fn):
        self.fn = fn


def _fake_runner(monkeypatch, layers: int = 2):
    """A stand-in for vLLM's runner, only what RouteCapture reads of it."""
    import rollout_service.routes as routes

    routers = [_Router() for _ in range(layers)]
    monkeypatch.setattr(routes, "moe_routers", lambda model: routers)
    batch = SimpleNamespace(num_reqs=0, req_ids=[], num_computed_tokens_cpu=np.zeros(8, int))
    runner = SimpleNamespace(get_model=lambda: None, requests={}, query_start_loc=SimpleNamespace(np=np.zeros(9, int)),
                             input_batch=batch)
    return runner, routers


def _step(runner, routers, batch: list[tuple[str, int, int]], tag: int = 0) -> None:
    """One forward of ``batch`` [(vLLM id, first position, tokens)]; in layer l the token at
    position p of child k routes to experts (k * 100 + p, 10 * tag + l)."""
    b = runner.input_batch
    b.num_reqs, b.req_ids = len(batch), [rid for rid, _, _ in batch]
    b.num_computed_tokens_cpu[:len(batch)] = [start for _, start, _ in batch]
    runner.query_start_loc.np[:len(batch) + 1] = np.cumsum([0] + [n for _, _, n in batch])
    runner.requests.update({rid: None for rid, _, _ in batch})
    for layer, router in enumerate(routers):
        ids = [[int(rid.split("_")[0]) * 100 + p if "_" in rid else p, 10 * tag + layer]
               for rid, start, n in batch for p in range(start, start + n)]
        router.fn(torch.tensor(ids + [[299, 299]], dtype=torch.int32))  # and a padding row


def test_rows_follow_the_runners_batch_layout_chunks_recompute_and_freeing(monkeypatch):
    from rollout_service.routes import MAX_DONE, RouteCapture, decode

    runner, routers = _fake_runner(monkeypatch)
    cap = RouteCapture(runner)
    a, b0, b1 = "r1-0123abcd", "0_r2-89abcdef", "1_r2-89abcdef"
    _step(runner, routers, [(a, 0, 3), (b0, 0, 5)], 1)  # a's prompt whole, b0's first chunk
    _step(runner, routers, [(a, 3, 1), (b0, 5, 2), (b1, 0, 4)], 2)
    _step(runner, routers, [(b1, 1, 2)], 3)  # b1 preempted, recomputed from position 1
    del runner.requests[a]  # vLLM freed a: its rows wait to be taken
    _step(runner, routers, [(b0, 7, 1)], 4)
    assert a in cap.done and a not in cap.live
    got = decode(cap.take("r2"), *cap.shape)
    assert sorted(got) == [0, 1] and got[0].dtype == np.dtype("<u2")
    assert got[0][:, 0, 0].tolist() == list(range(8)) and got[0][:, 0, 1].tolist() == [10] * 5 + [20] * 2 + [40]
    assert got[0][:, 1, 1].tolist() == [11] * 5 + [21] * 2 + [41]
    assert got[1][:, 0, 0].tolist() == [100, 101, 102] and got[1][:, 0, 1].tolist() == [20, 30, 30]
    assert decode(cap.take("r1"), *cap.shape)[0][:, 0, 0].tolist() == [0, 1, 2, 3]
    assert cap.take("r1") == {} and not cap.live and not cap.done
    _step(runner, routers, [("r3-00000000", 2, 2)])  # positions 0-1 never forwarded (a cached prefix)
    with pytest.raises(RuntimeError, match="never forwarded"):
        decode(cap.take("r3"), *cap.shape)
    for k in range(MAX_DONE + 5):  # never taken (aborted): dropped beyond MAX_DONE
        _step(runner, routers, [(f"x{k}-00000000", 0, 1)])
        del runner.requests[f"x{k}-00000000"]
    _step(runner, routers, [])
    assert len(cap.done) == MAX_DONE and "x0-00000000" not in cap.done


def test_a_model_without_experts_is_refused_naming_why(monkeypatch):
    """What rlpipe_capture_routes answers for a dense model; RolloutEngine.start raises it."""
    from rollout_service.routes import RouteCapture

    runner, _ = _fake_runner(monkeypatch)
    monkeypatch.setattr("rollout_service.routes.moe_routers", lambda model: [])
    with pytest.raises(ValueError, match="no MoE layers"):
        RouteCapture(runner)


def test_the_engine_refuses_routing_replay_on_a_model_without_experts():
    """RolloutEngine.start's check, on what the engine process answers for a dense model:
    a config error naming the key and why, and the engine shut down."""
    from quant.precision_profile import profile_for
    from rlpipe.config import ConfigError, RolloutConfig
    from rollout_service.engine import RolloutEngine

    class DenseLLM:
        down = False

        async def collective_rpc(self, method, args=()):
            assert method == "rlpipe_capture_routes"
            return [{"ok": False, "error": "this one has no MoE layers"}]

        def shutdown(self):
            self.down = True

    engine = RolloutEngine("dense", profile_for("fp32", cuda=False), RolloutConfig(routing_replay=True))
    engine.llm = llm = DenseLLM()
    with pytest.raises(ConfigError, match="rollout.routing_replay: .*no MoE layers"):
        asyncio.run(engine._start_routes())
    assert llm.down and engine.routing is None and engine.llm is None


def test_vllms_own_routes_are_asked_for_where_it_records_them_and_pass_the_hooks_check(monkeypatch):
    """Where vLLM records the routes itself (``enable_return_routed_experts``: its V2 runner, on
    CUDA; not this CPU build), the engine asks for them instead of binding the capture hook,
    takes the run's routing shape from the first, and checks each finished child's
    ``CompletionOutput.routed_experts`` as it checks the hook's: P + L - 1 rows, those past a
    stop string cut, none kept for an aborted child. No GPU engine runs here."""
    from vllm.outputs import CompletionOutput

    from quant.precision_profile import profile_for
    from rlpipe.config import RolloutConfig
    from rollout_service import vllm_compat
    from rollout_service.engine import FINISH_REASONS, RolloutEngine
    from rollout_service.routes import checked

    assert not vllm_compat.native_routes()  # this build records them through the hook
    monkeypatch.setattr(vllm_compat, "native_routes", lambda: True)
    engine = RolloutEngine("moe", profile_for("fp32", cuda=False), RolloutConfig(routing_replay=True))
    kwargs = engine.engine_kwargs()
    assert kwargs["enable_return_routed_experts"] is True and kwargs["enable_prefix_caching"] is False
    engine.llm = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(
        to_dict=lambda: {"num_experts": 6})))
    prompt, sampled = 4, [7, 8, 9]
    outs = [CompletionOutput(index=i, text="", token_ids=sampled, cumulative_logprob=None, logprobs=None,
                             routed_experts=np.arange(rows * 4).reshape(rows, 2, 2) % 6, finish_reason="stop")
            for i, rows in enumerate((prompt + 3 - 1, prompt + 3))]
    routes = asyncio.run(engine._take_routes("r1", {c.index: c.routed_experts for c in outs}))
    assert engine.routing == (2, 2, 6) and routes[0].dtype == np.uint8
    tokens, finish = {0: sampled, 1: sampled, 2: sampled}, {0: "stop", 1: "stop", 2: "abort"}
    got = checked("r1", routes, prompt, tokens, finish, True, FINISH_REASONS)
    assert sorted(got) == [0, 1] and all(len(r) == prompt + 3 - 1 for r in got.values())
    assert np.array_equal(got[1], outs[1].routed_experts[:-1])  # a row past the stop string cut
    with pytest.raises(RuntimeError, match="child 1 has 7 rows of routes, expected 6"):
        checked("r1", routes, prompt, tokens, finish, False, FINISH_REASONS)  # without a stop string: a bug
    with pytest.raises(RuntimeError, match="child 0 has 5 rows"):
        checked("r1", {0: routes[0][:-1]}, prompt, {0: sampled}, {0: "length"}, False, FINISH_REASONS)
