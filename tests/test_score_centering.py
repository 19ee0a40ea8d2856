"""Score centering (learner/score_centering.py) against a reference written from the paper (arXiv
2609.20807, Eq. 14 and its top-k estimator) in plain loops: the loss value, and its gradient against the
sampler-expected score taken over the whole vocabulary with the modelled tail."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner.loss import ISSettings, importance_weights, loss_sum
from learner.score_centering import centering_coefficients, centering_terms, token_weight
from rlpipe.corrections import CENTERING_WEIGHT

V, K = 7, 3
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
ADV = torch.tensor([1.3, -0.7])
SEQ_W = torch.tensor([[0.6, 0.6, 0.6], [1.0, 1.0, 1.0]])  # a sequence-level mode's weight, per row


def setup(seed: int = 0, k: int = K, pad: bool = True):
    """Trainer logits (with grad), the sampler's full distribution q (a drifted copy), its top-k head
    (ids, log-probs) and one position whose last candidate is padding (id 0, -inf)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 3, V, generator=g, requires_grad=True)
    q_all = torch.softmax(logits.detach() + 0.8 * torch.randn(2, 3, V, generator=g), -1)
    mu_topk, ids = q_all.log().topk(k, dim=-1)
    ids, mu_topk = ids.clone(), mu_topk.clone()
    if pad:
        ids[1, 1, -1], mu_topk[1, 1, -1] = 0, float("-inf")
    return logits, q_all, ids, mu_topk


def f_ref(x: float, settings: ISSettings) -> float:
    """A token-level mode's weight of a ratio x, written out."""
    m = settings.mode
    if m == "vanilla_is":
        return x
    if m == "token_tis":
        return min(x, settings.cap)
    if m == "token_mis":
        return x if x <= settings.cap else 0.0
    if m == "icepop":
        low = settings.icepop_alpha or 1 / settings.icepop_beta
        return x if low <= x <= settings.icepop_beta else 0.0
    raise AssertionError(m)


def weight_ref(x: float, i: int, t: int, settings: ISSettings) -> float:
    kind = CENTERING_WEIGHT[settings.mode]
    return 1.0 if kind == "one" else float(SEQ_W[i, t]) if kind == "sequence" else f_ref(x, settings)


def reference(logits, ids, mu_topk, settings: ISSettings):
    """(value, full-vocabulary loss) of the paper's correction, one position at a time:

    value: sum_t A sum_H sg(q_v w_v - alpha p_v) log p_v, alpha = rho f(1/rho) (the head-only form)
    full:  sum_t A sum_V sg(qhat_v w_v) log p_v, qhat = q on H and rho p off it (its gradient is
           A E_qhat[w grad log p], the sampler-expected score the term must subtract)
    """
    logp = torch.log_softmax(logits, -1)
    value, full = 0.0, 0.0
    for i in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if not MASK[i, t]:
                continue
            head = [(int(v), math.exp(float(m))) for v, m in zip(ids[i, t], mu_topk[i, t]) if math.isfinite(float(m))]
            p = logp[i, t].detach().exp()
            q_h, p_h = sum(q for _, q in head), sum(float(p[v]) for v, _ in head)
            rho = max(1 - q_h, 0.0) / max(1 - p_h, 1e-6)
            alpha = rho * weight_ref(1 / rho, i, t, settings) if rho > 0 else 0.0
            for v, q in head:
                c = q * weight_ref(float(p[v]) / q, i, t, settings) - alpha * float(p[v])
                value = value + ADV[i] * c * logp[i, t, v]
            in_head = dict(head)
            for v in range(V):
                qhat = in_head[v] if v in in_head else rho * float(p[v])
                w = weight_ref(float(p[v]) / qhat, i, t, settings) if qhat > 0 else 0.0
                full = full + ADV[i] * qhat * w * logp[i, t, v]
    return value, full


def product(logits, ids, mu_topk, settings: ISSettings):
    pi_topk = torch.log_softmax(logits, -1).gather(-1, ids)
    term, metrics = centering_terms(pi_topk, mu_topk, ADV, MASK, SEQ_W, settings)
    return loss_sum(term, MASK, "token_mean"), metrics


MODES = [ISSettings(mode="none"), ISSettings(mode="token_tis", cap=1.2), ISSettings(mode="vanilla_is"),
         ISSettings(mode="token_mis", cap=1.5), ISSettings(mode="icepop", icepop_beta=1.5),
         ISSettings(mode="seq_tis"), ISSettings(mode="geo_mask")]


@pytest.mark.parametrize("settings", MODES, ids=[s.mode for s in MODES])
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_and_gradient_equal_the_reference(settings, seed):
    logits, _, ids, mu_topk = setup(seed)
    value, full = reference(logits, ids, mu_topk, settings)
    (want,) = torch.autograd.grad(full, logits)
    got, metrics = product(logits, ids, mu_topk, settings)
    (grad,) = torch.autograd.grad(got, logits)
    assert got.item() == pytest.approx(float(value), rel=1e-5, abs=1e-6)
    assert torch.allclose(grad, want, atol=1e-6), (grad - want).abs().max()
    assert metrics["score_centering_drift"] >= 0 and 0 < metrics["score_centering_head_mass"] <= 1


def test_the_centered_score_has_zero_mean_under_the_sampler():
    """With the whole vocabulary as the head and no IS, sum_a q_a (grad log p_a - mu) = 0: the
    sampled-token term's expectation under q plus the centering term has no gradient (drift gone),
    while the sampled-token term alone has one."""
    logits, q_all, ids, mu_topk = setup(0, k=V, pad=False)
    settings = ISSettings(mode="none")
    logp = torch.log_softmax(logits, -1)
    expected_pg = -(ADV[:, None, None] * q_all * logp * MASK[..., None]).sum()  # E_q of -A log p_a
    centered, _ = product(logits, ids, mu_topk, settings)
    (drift,) = torch.autograd.grad(expected_pg, logits, retain_graph=True)
    (left,) = torch.autograd.grad(expected_pg + centered, logits)
    assert drift.abs().max() > 1e-2
    assert left.abs().max() < 1e-5


def test_untruncated_is_needs_no_centering():
    """vanilla_is: q w = p on the head and rho (1/rho) p = p on the tail, so every coefficient is 0."""
    logits, _, ids, mu_topk = setup(0)
    pi_topk = torch.log_softmax(logits, -1).gather(-1, ids)
    coef, _, _ = centering_coefficients(pi_topk, mu_topk, SEQ_W, ISSettings(mode="vanilla_is"))
    assert coef.abs().max() < 1e-6


def test_a_sampler_equal_to_the_trainer_has_no_drift():
    logits, _, _, _ = setup(0)
    logp = torch.log_softmax(logits.detach(), -1)
    mu_topk, ids = logp.topk(K, dim=-1)
    pi_topk = torch.log_softmax(logits, -1).gather(-1, ids)
    for settings in MODES:
        coef, rho, _ = centering_coefficients(pi_topk, mu_topk, torch.ones_like(MASK), settings)
        assert coef.abs().max() < 1e-6 and torch.allclose(rho, torch.ones_like(rho)), settings.mode


@pytest.mark.parametrize("mode", [m for m, kind in CENTERING_WEIGHT.items() if kind == "token"])
def test_token_weight_is_the_is_modes_own_rule(mode):
    """f applied to the candidates is the weight importance_weights gives a sampled token."""
    settings = ISSettings(mode=mode, cap=1.5, icepop_beta=1.5)
    log_w = torch.linspace(-1.5, 1.5, 31)[None]
    w, _ = importance_weights(log_w, torch.zeros_like(log_w), torch.ones_like(log_w), settings)
    assert torch.allclose(token_weight(log_w, settings), w)


def test_centering_is_refused_where_the_ratio_is_taken_against_mu():
    from rlpipe.config import ConfigError, build_config

    for mode in ("ppo_is", "bypass"):
        with pytest.raises(ConfigError, match="score_centering_k"):
            build_config({}, environ={}, **{"learner.score_centering_k": 4, "learner.is_mode": mode})
    with pytest.raises(ConfigError, match="task.tool or task.environment"):
        build_config({}, environ={}, **{"learner.score_centering_k": 4, "task.environment": "calculator"})
    assert build_config({}, environ={}, **{"learner.score_centering_k": 4}).learner.score_centering_k == 4


def test_the_learners_topk_log_probs_and_gradients_are_the_plain_paths(toy_model_path):
    """The chunked head and the shared prompt give the log-probs at the sampler's top-k ids, and their
    gradients, as the plain whole-logits path does (learner/policy.py token_logprobs with_topk)."""
    from learner.batch import collate
    from learner.policy import load_policy, token_logprobs
    from rlpipe.schema import GroupRecord, Sample

    model = load_policy(toy_model_path)
    rng = np.random.default_rng(0)
    samples = [Sample(rng.integers(3, 20, size=n).astype(np.int32), np.full(n, -1.0, np.float32), "stop", 0.0,
                      topk_ids=rng.integers(0, 20, size=(n, 4)).astype(np.int32),
                      topk_logprobs=np.full((n, 4), -2.0, np.float16)) for n in (3, 5)]
    rec = GroupRecord("r", "g", "p", "w", 0, 0, "fp32", "", {"temperature": 0.9, "top_k": 12}, np.arange(1, 6, dtype=np.int32),
                      samples, sampler_topk=4)
    batch = collate([rec], torch.zeros(1, 2), 0)
    runs = {}
    for name, kw in {"plain": {}, "chunked": {"head_chunk": 3}, "shared": {"share_prompt": True}}.items():
        model.zero_grad()
        lp, _, topk = token_logprobs(model, batch, with_topk=True, **kw)
        (topk * batch.mask[..., None]).sum().backward()
        runs[name] = (lp.detach(), topk.detach(), model.get_output_embeddings().weight.grad.clone())
    on = batch.mask.bool()
    plain_lp, _ = token_logprobs(model, batch)
    assert torch.allclose(runs["plain"][0][on], plain_lp[on])
    for name in ("chunked", "shared"):
        lp, topk, grad = runs[name]
        assert torch.allclose(lp[on], runs["plain"][0][on], atol=1e-5), name
        assert torch.allclose(topk[on], runs["plain"][1][on], atol=1e-5), name
        assert torch.allclose(grad, runs["plain"][2], atol=1e-5), name


def _record(k: int):
    from rlpipe.schema import GroupRecord, Sample

    rng = np.random.default_rng(1)
    samples = [Sample(rng.integers(0, 20, size=n).astype(np.int32), np.full(n, -0.5, np.float32), "stop", 1.0,
                      topk_ids=rng.integers(0, 20, size=(n, k)).astype(np.int32) if k else None,
                      topk_logprobs=np.sort(-rng.random((n, k)) * 5, axis=1)[:, ::-1].astype(np.float16) if k else None)
               for n in (2, 3)]
    if k:
        samples[0].topk_logprobs[0, -1] = -np.inf  # a candidate the sampler's top-p left out
    return GroupRecord("r", "g", "p", "w", 0, 0, "fp32", "", {"temperature": 1.0}, np.arange(1, 4, dtype=np.int32),
                       samples, sampler_topk=k)


def test_the_wire_carries_the_top_k_only_when_asked_and_checks_it():
    import msgpack

    from rlpipe.admission import RunCheck
    from rlpipe.schema import SchemaError, decode_group, encode_group

    plain, with_topk = encode_group(_record(0)), encode_group(_record(8))
    assert b"topk" not in plain and len(with_topk) - len(plain) >= (2 + 3) * 8 * 6
    rec = decode_group(with_topk)
    want = _record(8)
    assert rec.sampler_topk == 8
    for got, s in zip(rec.samples, want.samples):
        assert np.array_equal(got.topk_ids, s.topk_ids) and np.array_equal(got.topk_logprobs, s.topk_logprobs)
    m = msgpack.unpackb(with_topk)
    m["samples"][1]["topk_ids"] = m["samples"][1]["topk_ids"][:-4]
    with pytest.raises(SchemaError, match="topk_ids: .* bytes, expected 3 tokens x 8"):
        decode_group(msgpack.packb(m))
    m = msgpack.unpackb(plain)
    m["samples"][0]["topk_ids"] = b""
    with pytest.raises(SchemaError, match="sampler_topk is 0"):
        decode_group(msgpack.packb(m))
    check = RunCheck(run_id="r", vocab_size=20, n=2, sampling={}, max_tokens=8, max_model_len=64,
                     precisions=("fp32",), sampler_topk=8)
    check.check(rec, 1, 0)
    with pytest.raises(SchemaError, match="sampler_topk: 0, this run's learner.score_centering_k is 8"):
        check.check(decode_group(plain), 1, 0)


def test_collate_lays_the_top_k_out_as_the_targets():
    from learner.batch import collate

    rec = _record(8)
    batch = collate([rec], torch.zeros(1, 2), 0)
    assert batch.sampler_topk_ids.shape == (2, 2 + 3, 8)
    for i, s in enumerate(rec.samples):
        on = batch.mask[i].bool()
        assert torch.equal(batch.sampler_topk_ids[i][on], torch.from_numpy(s.topk_ids).long())
        assert torch.equal(batch.sampler_topk_logprobs[i][on], torch.from_numpy(s.topk_logprobs.astype(np.float32)))
        assert torch.isinf(batch.sampler_topk_logprobs[i][~on]).all()
