"""Routing replay on the learner's side (learner/routing.py, issue 36 item 2): the wire's routes
(rlpipe/schema.py), their layout in a batch (learner/batch.py) and the replayed forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner import routing
from learner.batch import collate
from learner.policy import token_logprobs
from rlpipe.admission import RunCheck
from rlpipe.schema import GroupRecord, Sample, SchemaError, decode_group, encode_group
from tests.families import tiny_config, tiny_model


def mixtral():
    import transformers

    cfg = tiny_config("llama").to_dict()
    cfg.update(num_local_experts=4, num_experts_per_tok=2, architectures=None)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**cfg)).float().eval()


MODELS = {"qwen3_moe": lambda: tiny_model("qwen3_moe"), "mixtral": mixtral}


def own_routes(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's own top-k per token and MoE layer, (B, S, layers, top_k), from a plain forward."""
    seen = []
    hooks = [r.register_forward_hook(lambda m, i, out: seen.append(out[2])) for r in routing.moe_routers(model)]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return torch.stack(seen, dim=1).reshape(*ids.shape, len(seen), -1).int()


def random_routes(shape: tuple, experts: int, seed: int = 0) -> torch.Tensor:
    """Distinct expert ids per row, drawn at random: (B, S, layers, top_k)."""
    g = torch.Generator().manual_seed(seed)
    *rows, k = shape
    return torch.rand(*rows, experts, generator=g).argsort(-1)[..., :k].int()


def forced_by_hand(model, ids: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
    """Logits of a forward whose routers take ``routes`` through a loop over tokens, written
    apart from learner/routing.py (softmax over the experts, the forced ones' probabilities,
    renormalised)."""
    originals = []
    for layer, router in enumerate(routing.moe_routers(model)):
        def forward(hidden, router=router, layer=layer):
            hidden = hidden.reshape(-1, router.weight.shape[1])
            logits = hidden @ router.weight.T
            chosen = torch.stack([routes[b, s, layer].long() for b in range(ids.shape[0])
                                  for s in range(ids.shape[1])])
            weights = torch.stack([torch.softmax(logits[i].float(), -1)[chosen[i]] for i in range(len(chosen))])
            return logits, weights / weights.sum(-1, keepdim=True), chosen
        originals.append((router, router.forward))
        router.forward = forward
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits
    finally:
        for router, original in originals:
            router.forward = original


@pytest.mark.parametrize("family", MODELS)
def test_a_replayed_forward_equals_one_forced_by_hand_and_own_routes_change_nothing(family):
    model = MODELS[family]()
    ids = torch.randint(3, 20, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    own = own_routes(model, ids)
    layers, top_k, experts = routing.routing_shape(model)
    assert own.shape == (2, 7, layers, top_k) and layers == 2 and experts == 4
    routing.install(model)
    forced = random_routes(own.shape, experts)
    with torch.no_grad():
        with routing.routes_for(model, own):
            same = model(input_ids=ids).logits
        assert routing.take_tally(model).metrics()["routing_agreement"] == 1.0
        with routing.routes_for(model, forced):
            replayed = model(input_ids=ids).logits
        tally = routing.take_tally(model)
        outside = model(input_ids=ids).logits  # no routes in force: the model's own routing again
    assert torch.equal(same, plain) and torch.equal(outside, plain)
    agreement = tally.metrics()
    assert sum(tally.total) == 2 * 7 * layers and 0 <= agreement["routing_agreement"] < 1
    assert len(agreement["routing_agreement_by_layer"]) == layers
    torch.testing.assert_close(replayed, forced_by_hand(model, ids, forced), rtol=1e-5, atol=1e-5)
    assert (replayed - plain).abs().max() > 1e-3  # the forced experts did change the forward


def test_the_router_still_learns_under_replay_and_measure_only_mode_changes_no_logit():
    model = tiny_model("qwen3_moe")
    ids = torch.randint(3, 20, (2, 6), generator=torch.Generator().manual_seed(2))
    routing.install(model)
    forced = random_routes((2, 6, 2, 2), 4, seed=3)
    with routing.routes_for(model, forced):
        model(input_ids=ids).logits.logsumexp(-1).mean().backward()
    grads = [r.weight.grad for r in routing.moe_routers(model)]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        routing.install(model, replay=False)
        with routing.routes_for(model, forced):
            measured = model(input_ids=ids).logits
    assert torch.equal(measured, plain)
    assert routing.take_tally(model).metrics()["routing_agreement"] < 1


def record_with_routes(model, prompt: list[int], responses: list[list[int]], routes=None) -> GroupRecord:
    layers, top_k, experts = routing.routing_shape(model)
    samples = []
    for i, resp in enumerate(responses):
        ids = torch.tensor([prompt + resp])
        rows = own_routes(model, ids)[0, :-1] if routes is None else routes[i]  # the last token: never forwarded
        samples.append(Sample(np.array(resp, np.int32), np.full(len(resp), -1.0, np.float32), "stop", float(i),
                              routes=np.asarray(rows, dtype=np.uint8)))
    return GroupRecord(run_id="r", group_id="g", prompt_id="p", worker_id="w0", policy_version=0,
                       policy_version_end=0, precision="fp32", quant_profile="", sampling={"temperature": 1.0},
                       prompt_tokens=np.array(prompt, np.int32), samples=samples,
                       routing=(layers, top_k, experts))


def test_routes_cross_the_wire_and_the_batch_to_the_rows_they_belong_to():
    """A record's routes survive encoding and land on their rows' positions in a batch (responses
    of different lengths, so one row is padded): replaying the model's own routes gives the
    plain path's log-probs to the bit, and forging one sample's routes moves only that row."""
    model = tiny_model("qwen3_moe")
    routing.install(model)
    rec = decode_group(encode_group(record_with_routes(model, [5, 9, 7], [[11, 12, 13, 2], [14, 2]])))
    assert rec.routing == (2, 2, 4) and rec.samples[1].routes.shape == (3 + 2 - 1, 2, 2)
    batch = collate([rec], torch.zeros(1, 2), version=0)
    assert batch.routes.shape == (2, 7, 2, 2) and (batch.routes[1, 4:] == -1).all()
    plain = collate([rec], torch.zeros(1, 2), version=0)
    plain.routes = None
    with torch.no_grad():
        replayed, _ = token_logprobs(model, batch)
        expected, _ = token_logprobs(model, plain)
        assert torch.equal(replayed * batch.mask, expected * batch.mask)
        rec.samples[1].routes = random_routes(rec.samples[1].routes.shape, 4, seed=5).numpy().astype(np.uint8)
        forged, _ = token_logprobs(model, collate([rec], torch.zeros(1, 2), version=0))
    # row 0 only within float noise: the experts' batched matmuls group other rows' tokens differently
    torch.testing.assert_close(forged[0], replayed[0], rtol=1e-5, atol=1e-5)
    assert ((forged[1] - replayed[1]) * batch.mask[1]).abs().max() > 1e-3


def encoded_with(rec: GroupRecord, **sample_routes) -> bytes:
    """``rec`` encoded, then its first sample's ``routes`` bytes replaced (the reader's view of a forgery)."""
    import msgpack

    m = msgpack.unpackb(encode_group(rec), raw=False)
    m["samples"][0].update(sample_routes)
    return msgpack.packb(m, use_bin_type=True)


def test_bad_routes_are_refused_naming_the_field_and_the_run_checks_their_shape():
    model = tiny_model("qwen3_moe")
    rec = record_with_routes(model, [5, 9], [[11, 2], [12, 2]])
    good = rec.samples[0].routes
    bad = {
        "expert id 7 is not below": np.where(np.arange(good.size).reshape(good.shape) == 0, 7, good),
        "expected 3 forwarded tokens": good[:2],
        "chosen twice": np.stack([good[..., 0], good[..., 0]], -1),
    }
    for reason, routes in bad.items():
        with pytest.raises(SchemaError, match=reason):
            decode_group(encoded_with(rec, routes=np.ascontiguousarray(routes, np.uint8).tobytes()))
    rec.routing = None
    with pytest.raises(SchemaError, match="routes: present without the group's routing"):
        decode_group(encode_group(rec))
    rec.routing = (2, 2, 4)
    decoded = decode_group(encode_group(rec))
    check = RunCheck(run_id="r", vocab_size=20, n=2, sampling={}, max_tokens=8, max_model_len=64,
                     precisions=("fp32",), routing=(2, 2, 8))
    with pytest.raises(SchemaError, match=r"this run's model has \(2, 2, 8\)"):
        check.check(decoded, handed_out=0, reissued=0)
    check.routing = None
    with pytest.raises(SchemaError, match="does not replay routing"):
        check.check(decoded, handed_out=0, reissued=0)
    check.routing = (2, 2, 4)
    check.check(decoded, handed_out=0, reissued=0)


def test_a_model_without_moe_layers_is_refused_for_replay():
    assert routing.replay_problem(tiny_model("llama")) == "the model has no mixture-of-experts layers to replay"
    with pytest.raises(ValueError, match="no mixture-of-experts"):
        routing.install(tiny_model("qwen2"))


def olmoe():
    import transformers

    cfg = tiny_config("llama").to_dict()
    cfg.update(num_experts=4, num_experts_per_tok=2, architectures=None)
    torch.manual_seed(0)
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**cfg)).float().eval()


@pytest.mark.parametrize("family", [*MODELS, "olmoe"])
def test_the_routers_load_and_aux_loss_are_transformers_own_over_the_tokens_not_the_padding(family):
    """The load-balancing loss the learner reports is the one transformers computes for the
    model (``output_router_logits``, the same attention mask), and the busiest expert's share
    is counted by hand from the model's own top-k, padding left out."""
    model = olmoe() if family == "olmoe" else MODELS[family]()
    ids = torch.randint(3, 20, (3, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, 4:], mask[2, 2:] = 0, 0  # right padding, as collate lays rows out
    own = own_routes(model, ids)  # (B, S, layers, top_k)
    routing.install(model, replay=False)
    with torch.no_grad(), routing.routes_for(model, None, mask):
        aux = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
    got = routing.take_tally(model).metrics()
    assert "routing_agreement" not in got  # no routes were given: nothing to agree with
    assert got["router_aux_loss"] == pytest.approx(float(aux), rel=1e-5)
    layers, top_k, experts = routing.routing_shape(model)
    kept = own[mask.bool()]  # (tokens, layers, top_k)
    by_hand = [torch.bincount(kept[:, i].reshape(-1).long(), minlength=experts).max().item() / (len(kept) * top_k)
               * experts for i in range(layers)]
    assert got["router_load_max_by_layer"] == pytest.approx(by_hand)
    assert got["router_load_max"] == pytest.approx(max(by_hand))
    assert 1 <= got["router_load_max"] <= experts / top_k
    with torch.no_grad():  # outside routes_for the routers count nothing (a padded row's tokens would count)
        model(input_ids=ids)
    assert routing.take_tally(model).metrics() == {}
    with torch.no_grad(), routing.routes_for(model, None, mask[:, :5]), \
            pytest.raises(ValueError, match="a mask of 15 rows, the forward has 18 tokens"):
        model(input_ids=ids, attention_mask=mask)  # a mask of another layout is refused, not skipped


def test_the_shared_prompt_path_counts_a_groups_prompt_once_and_the_plain_path_every_row():
    model = tiny_model("qwen3_moe")
    routing.install(model, replay=False)
    rec = record_with_routes(model, [5, 9, 7], [[11, 12, 13, 2], [14, 2]])
    for s in rec.samples:
        s.routes = None
    rec.routing = None
    batch = collate([rec], torch.zeros(1, 2), version=0)
    counted = {}
    with torch.no_grad():
        for share in (True, False):
            token_logprobs(model, batch, share_prompt=share)
            counted[share] = routing.take_tally(model).tokens
    assert counted[False] == {0: int(batch.attention_mask.sum()), 1: int(batch.attention_mask.sum())}
    assert counted[True] == {0: 3 + 4 + 2, 1: 3 + 4 + 2}  # the prompt once, then each response


@pytest.mark.parametrize("family", [*MODELS, "olmoe"])
def test_each_layers_moe_block_is_found_for_fsdp_to_shard_apart(family):
    """learner/dist.py shards each MoE block (router and experts) as a unit of its own, before its
    layer (tests/test_ddp.py's fsdp-moe case trains one under 2 ranks)."""
    model = olmoe() if family == "olmoe" else MODELS[family]()
    from learner.policy import decoder_layers

    blocks = [routing.moe_blocks(layer) for layer in decoder_layers(model)]
    assert [len(b) for b in blocks] == [1, 1] and all(hasattr(b[0], "experts") for b in blocks)
    assert routing.moe_blocks(tiny_model("llama")) == []
