"""``learner.activation_checkpointing``: the same gradients, fewer activations kept for the
backward pass, and parameter names unchanged (checkpoints and weight sync read them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from learner.batch import collate
from learner.policy import enable_activation_checkpointing, load_policy, token_logprobs
from tests.conftest import ROOT
from tests.families import FAMILIES, LAYERS, tiny_model
from tests.test_learner import synthetic_groups

MOE_FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]  # every MoE layout routing replay handles


def backward_with_saved_bytes(model, batch) -> int:
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = token_logprobs(model, batch, "fp32")
        loss = -(lp * batch.mask).sum()
    loss.backward()
    return sum(saved)


def test_checkpointed_layers_give_the_same_gradients_and_keep_fewer_activations(toy_model_path):
    plain, ckpt = load_policy(toy_model_path), load_policy(toy_model_path)
    assert enable_activation_checkpointing(ckpt) == len(ckpt.model.layers) > 0
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in ckpt.named_parameters()] == [n for n, _ in plain.named_parameters()]
    records = synthetic_groups(plain, 4, seed=3)
    batch = collate(records, torch.ones(len(records), 4), 0)
    plain_bytes = backward_with_saved_bytes(plain, batch)
    ckpt_bytes = backward_with_saved_bytes(ckpt, batch)
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=1e-5), name
    print(f"activations saved for backward: {plain_bytes} bytes plain, {ckpt_bytes} checkpointed")
    assert ckpt_bytes < 0.8 * plain_bytes
    with torch.no_grad():  # no-grad passes (pi_old) go straight through
        assert torch.equal(token_logprobs(ckpt, batch, "fp32")[0], token_logprobs(plain, batch, "fp32")[0])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_decoder_layers_are_found_in_every_family_and_checkpointing_keeps_its_gradients(family):
    """The learner finds the layers by their block class, not at ``model.model.layers``
    (a GPT-NeoX model crashed there with activation checkpointing, restarted forever)."""
    from learner.policy import decoder_layers

    plain, ckpt = tiny_model(family), tiny_model(family)
    layers = decoder_layers(plain)
    assert len(layers) == LAYERS and type(layers[0]).__name__ in plain._no_split_modules
    assert enable_activation_checkpointing(ckpt) == LAYERS
    batch = collate(synthetic_groups(plain, 2, seed=1), torch.ones(2, 4), 0)
    backward_with_saved_bytes(plain, batch)
    backward_with_saved_bytes(ckpt, batch)
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        if a.grad is not None:
            assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=1e-5), name


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "own_routes"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_mixture_of_experts_recomputes_through_the_forwards_experts(family, replay):
    """A checkpointed MoE layer is recomputed in the backward pass, after the replayed routes and the
    load mask are out of force: it routes as its forward did (the same saved tensors, not a
    CheckpointError; with replay, the gradient of the rollout's experts, equal to an unchecked
    forward's), and its routers count the forward once."""
    from learner import routing
    from tests.test_routing import own_routes, random_routes

    plain, ckpt = tiny_model(family), tiny_model(family)
    ckpt.load_state_dict(plain.state_dict())
    enable_activation_checkpointing(ckpt)
    ids = torch.randint(3, 20, (2, 7), generator=torch.Generator().manual_seed(1))
    layers, top_k, experts = routing.routing_shape(plain)
    routes = random_routes(own_routes(plain, ids).shape, experts) if replay else None
    valid = torch.ones_like(ids)
    tallies = []
    for model in (plain, ckpt):
        routing.install(model)
        with routing.routes_for(model, routes, valid):
            loss = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).sum()  # as the learner
        loss.backward()
        tallies.append(routing.take_tally(model))
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=name)
    (a, b) = tallies
    assert a.total == b.total and a.agree == b.agree and a.tokens == b.tokens == {i: 14 for i in range(layers)}


@pytest.mark.slow
def test_fsdp_ranks_recompute_a_mixture_of_experts_through_the_forwards_experts(tmp_path):
    """The same under ``learner.parallel: fsdp`` (2 gloo ranks under torchrun, the learner's own
    ``Ranks.wrap``: each MoE block a unit of its own, all-gathered again for the recomputation
    inside its checkpointed layer): for every family routing replay handles, with routes replayed,
    only compared (``learner.replay_routes: false``) or absent, the ranks' averaged gradient is one
    unchecked process's to fp32 rounding, and rank 0's routers counted its own tokens once
    (tests/fsdp_moe_checkpoint_rank.py)."""
    out = tmp_path / "grads.json"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "tests" / "fsdp_moe_checkpoint_rank.py"), str(out), *MOE_FAMILIES],
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300, capture_output=True, text=True,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [(r["family"], r["arm"]) for r in results] == \
        [(f, arm) for f in MOE_FAMILIES for arm in ("replay", "compare", "own")]
    for r in results:
        case = (r["family"], r["arm"])
        worst = max(r["relative_diff"].values())
        print(case, f"largest norm-wise relative gradient difference {worst:.1e}", f"backward {r['seconds']:.2f} s",
              f"(own routes' gradient differs by {r['own_routes_diff']:.2f})" if r["own_routes_diff"] else "")
        assert r["same_params"] and len(r["relative_diff"]) > 10, case
        assert worst < 1e-5, case  # fp32 summed in another order; a recompute off the routes differs by O(1)
        assert r["tally_tokens"] == {str(i): r["own_tokens"] for i in range(LAYERS)}, case  # once, no padding
        # every position of rank 0's rows had a route (padding too), compared once
        assert r["tally_total"] == ([] if r["arm"] == "own" else [r["own_positions"]] * LAYERS), case
        if r["arm"] == "replay":
            assert r["own_routes_diff"] > 1e-2, case
