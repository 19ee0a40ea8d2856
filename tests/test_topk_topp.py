"""The learner's recompute under top-k / top-p: the same truncation as vLLM's sampler.

Fast tests: :func:`learner.truncation.truncation_mask` on hand-made logits (ties, each filter
alone, both, the no-op settings, a different setting per row), checked against vLLM's own
``apply_top_k_top_p_pytorch`` too, and :func:`token_logprobs` renormalising and
differentiating over the kept tokens. Slow test: a real fp32 engine sampling with
``top_p=0.9, top_k=5`` agrees with the learner to 1e-4, and would not without the truncation.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from learner.batch import collate
from learner.policy import token_logprobs
from learner.truncation import OUTSIDE_LOGPROB, truncation_mask
from rlpipe.schema import GroupRecord, Sample


def kept(logits, top_k=-1, top_p=1.0) -> set[int]:
    """The token ids one position of ``logits`` (V,) keeps (all of them if nothing truncates)."""
    keep = truncation_mask(torch.tensor(logits, dtype=torch.float32)[None, None],
                           torch.tensor([top_k]), torch.tensor([top_p], dtype=torch.float32))
    if keep is None:
        return set(range(len(logits)))
    return set(keep[0, 0].nonzero().flatten().tolist())


def log(probs):
    return [math.log(q) for q in probs]


def test_noop_settings_return_none():
    x = torch.randn(2, 3, 7)
    for k in (-1, 0, 7, 100):
        assert truncation_mask(x, torch.tensor([k, k]), torch.tensor([1.0, 1.0])) is None


def test_top_k_only_keeps_ties_at_the_kth_value():
    assert kept([3.0, 2.0, 1.0, 0.0], top_k=2) == {0, 1}
    assert kept([3.0, 2.0, 2.0, 2.0, 1.0, 0.0], top_k=2) == {0, 1, 2, 3}  # three tied for 2nd: all kept
    assert kept([3.0, 2.0, 2.0, 2.0, 1.0, 0.0], top_k=4) == {0, 1, 2, 3}
    assert kept([3.0, 2.0, 2.0, 2.0, 1.0, 0.0], top_k=1) == {0}
    assert kept([5.0, 5.0, 1.0], top_k=1) == {0, 1}


def test_top_p_only():
    probs = log([0.5, 0.3, 0.15, 0.05])  # ascending cumsum: 0.05, 0.2, 0.5, 1
    assert kept(probs, top_p=0.7) == {0, 1}  # drop where cumsum <= 0.3
    assert kept(probs, top_p=0.45) == {0}
    assert kept(probs, top_p=0.94) == {0, 1, 2}
    assert kept(probs, top_p=0.96) == {0, 1, 2, 3}  # 0.05 > 1 - 0.96
    assert kept(probs, top_p=0.01) == {0}  # the most likely token always stays
    assert kept(probs[::-1], top_p=0.7) == {3, 2}  # by probability, not by position


def test_top_p_ties_at_the_cut_drop_the_lower_ids_first():
    # Uniform over 4: ascending cumsum 0.25, 0.5, 0.75, 1; p=0.5 drops the first two in the
    # (stable) sort order, which are the lower ids.
    assert kept([1.0, 1.0, 1.0, 1.0], top_p=0.5) == {2, 3}
    # Four tied at ~0.229 after one at ~0.084: cumsum 0.084, 0.313, 0.542, ...: of the tied
    # tokens 1-4, only token 1 is dropped.
    assert kept([0.0, 1.0, 1.0, 1.0, 1.0], top_p=0.5) == {2, 3, 4}


def test_top_k_then_top_p_on_the_renormalised_survivors():
    probs = log([0.4, 0.3, 0.2, 0.1])
    assert kept(probs, top_p=0.5) == {0, 1}  # top-p alone: cumsum 0.1, 0.3, 0.6, 1
    assert kept(probs, top_k=2) == {0, 1}
    # top-k first: survivors 4/7, 3/7; cumsum 3/7 <= 1 - 0.5 drops token 1
    assert kept(probs, top_k=2, top_p=0.5) == {0}
    assert kept(probs, top_k=3, top_p=0.6) == {0, 1}  # 2/9 <= 0.4 < 5/9


def test_per_row_settings():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, 11, generator=gen) * 2
    top_k = torch.tensor([3, -1, 0, 5, 11])
    top_p = torch.tensor([1.0, 0.6, 1.0, 0.8, 0.5])
    keep = truncation_mask(x, top_k, top_p)
    for i in range(5):
        alone = truncation_mask(x[i:i + 1], top_k[i:i + 1], top_p[i:i + 1])
        assert torch.equal(keep[i:i + 1], torch.ones_like(keep[i:i + 1]) if alone is None else alone)
    assert keep[0].sum(-1).eq(3).all()  # top_k 3, no ties in random logits
    assert keep[2].all()  # row 2 truncates nothing
    assert (keep[1].sum(-1) < 11).all() and (keep[4].sum(-1) < 11).all()


def test_matches_vllm_sampler_code():
    """The same keep sets as vLLM's own masking function, the one its CPU engine runs."""
    ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    gen = torch.Generator().manual_seed(1)
    n, t, v = 6, 5, 40
    x = torch.randn(n, t, v, generator=gen) * 3
    top_k = torch.tensor([5, -1, 3, 40, 1, 7])
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.7, 0.3, 0.95])
    keep = truncation_mask(x, top_k, top_p)
    k_vllm = torch.where((top_k > 0) & (top_k < v), top_k, v).to(torch.int32)  # vLLM's "off" is k = V
    ref = ops.apply_top_k_top_p_pytorch(x.reshape(-1, v).clone(), k_vllm.repeat_interleave(t),
                                        top_p.repeat_interleave(t), allow_cpu_sync=True)
    assert torch.equal(keep, (ref > -math.inf).reshape(n, t, v))
    only_k = ops.apply_top_k_only(x.reshape(-1, v).clone(), k_vllm.repeat_interleave(t))
    keep_k = truncation_mask(x, top_k, torch.ones(n))
    assert torch.equal(keep_k, (only_k > -math.inf).reshape(n, t, v))
    # Ties at the k-th value (logits on a coarse grid): both keep all of them.
    x = (x / 2).round()
    keep = truncation_mask(x, top_k, torch.ones(n))
    only_k = ops.apply_top_k_only(x.reshape(-1, v).clone(), k_vllm.repeat_interleave(t))
    assert torch.equal(keep, (only_k > -math.inf).reshape(n, t, v))
    assert (keep[0].sum(-1) > 5).any()  # some position of the top_k=5 row keeps more than 5


class LogitsModel(torch.nn.Module):
    """A 'causal LM' whose logits are a parameter (N, T, V): enough for token_logprobs."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = torch.nn.Parameter(logits.clone())

    def forward(self, input_ids, attention_mask, use_cache=None, logits_to_keep=0):
        return SimpleNamespace(logits=self.logits[:, -logits_to_keep:])  # as transformers keeps the last ones


def make_batch(rows: list[list[int]], sampling: list[dict], prompt_len: int = 1):
    """One record per row (its first ``prompt_len`` tokens are the prompt), with that row's
    sampling parameters, collated as the learner does."""
    recs = [GroupRecord("t", "g", "p", "w", 0, 0, "fp32", "", s, np.asarray(r[:prompt_len], dtype=np.int32),
                        [Sample(np.asarray(r[prompt_len:], dtype=np.int32),
                                np.zeros(len(r) - prompt_len, dtype=np.float32), "stop", 0.0)])
            for r, s in zip(rows, sampling)]
    return collate(recs, torch.zeros(len(recs), 1), 0)


def test_collate_carries_top_p_top_k():
    batch = make_batch([[1, 2], [1, 2], [1, 2]],
                       [{"temperature": 0.5, "top_p": 0.9, "top_k": 5}, {}, {"top_p": None, "top_k": None}])
    assert batch.top_p.dtype == torch.float32 and batch.top_p.tolist() == [pytest.approx(0.9), 1.0, 1.0]
    assert batch.top_k.tolist() == [5, -1, -1]
    assert batch.select(torch.tensor([0])).top_k.tolist() == [5]


def test_token_logprobs_renormalise_over_kept_tokens_with_gradients():
    gen = torch.Generator().manual_seed(2)
    v = 9
    rows = [[1, 4, 2, 7], [1, 3, 3, 0], [1, 8, 5, 6]]  # prompt: the first token
    sampling = [{"temperature": 0.7, "top_k": 3}, {"temperature": 1.0}, {"temperature": 1.3, "top_p": 0.6, "top_k": 6}]
    batch = make_batch(rows, sampling)
    model = LogitsModel(torch.randn(3, 4, v, generator=gen) * 2)
    logp, entropy = token_logprobs(model, batch)
    scaled = model.logits.detach()[:, :-1] / batch.temperature[:, None, None]
    keep = truncation_mask(scaled, batch.top_k, batch.top_p)
    assert keep[1].all()  # the untruncated row
    full = torch.log_softmax(scaled, dim=-1)
    for i in range(3):
        for t in range(3):
            target = batch.targets[i, t]
            renorm = torch.log_softmax(scaled[i, t][keep[i, t]], dim=-1)
            expected = renorm[keep[i, t][:target].sum()] if keep[i, t, target] else torch.tensor(OUTSIDE_LOGPROB)
            assert float(logp[i, t].detach()) == pytest.approx(float(expected), abs=1e-6)
            probs = renorm.exp()
            assert float(entropy[i, t].detach()) == pytest.approx(float(-(probs * renorm).sum()), abs=1e-5)
    assert torch.allclose(logp[1], full[1].gather(-1, batch.targets[1, :, None]).squeeze(-1))
    assert (logp[0] != full[0].gather(-1, batch.targets[0, :, None]).squeeze(-1)).any()
    # Gradients: finite everywhere, zero on the logits the truncation removed.
    (logp.sum() + entropy.sum()).backward()
    grad = model.logits.grad[:, :-1]
    assert torch.isfinite(grad).all()
    assert grad[~keep].abs().max() == 0
    assert grad[keep].abs().max() > 0


def test_fast_path_unchanged_without_truncation():
    gen = torch.Generator().manual_seed(3)
    batch = make_batch([[1, 2, 3], [1, 4, 5]], [{"temperature": 0.8, "top_p": 1.0, "top_k": -1}, {"top_k": 0}])
    model = LogitsModel(torch.randn(2, 3, 6, generator=gen))
    logp, _ = token_logprobs(model, batch)
    plain = torch.log_softmax(model.logits[:, :-1].float() / batch.temperature[:, None, None], dim=-1)
    assert torch.equal(logp, plain.gather(-1, batch.targets[..., None]).squeeze(-1))


def test_outside_logprob_is_finite_through_the_masked_metrics():
    from learner.loss import mismatch_metrics

    # A target the learner's truncation removed (e.g. sampled by an older policy).
    batch = make_batch([[1, 0, 2]], [{"top_k": 1}])
    logits = torch.zeros(1, 3, 4)
    logits[0, :, 3] = 5.0  # only token 3 survives top_k=1
    logp, entropy = token_logprobs(LogitsModel(logits), batch)
    assert logp.tolist() == [[OUTSIDE_LOGPROB, OUTSIDE_LOGPROB]] and entropy.abs().max() == 0
    metrics = mismatch_metrics(logp, torch.full_like(logp, -1.0), batch.mask)
    assert all(math.isfinite(v) for v in metrics.values())


# -- against a real fp32 engine ------------------------------------------------------------------
@pytest.mark.slow
def test_engine_top_p_top_k_logprobs_equal_learner_fp32(worker, toy_model_path):
    from learner.policy import load_policy

    model = load_policy(toy_model_path)
    worker.sync(model)
    sampling = {"temperature": 1.3, "top_p": 0.9, "top_k": 5}
    resp = worker.http.post("/v1/generate", json={"prompt": "12+7=", "n": 8, "max_tokens": 12, "seed": 11,
                                                  **sampling})
    resp.raise_for_status()
    body = resp.json()
    prompt, choices = body["prompt_token_ids"], body["choices"]
    assert sum(len(c["tokens"]) for c in choices) >= 16

    def diffs(record_sampling: dict) -> list[float]:
        out = []
        for c in choices:  # each sample as a record with these sampling parameters
            batch = make_batch([prompt + c["tokens"]], [record_sampling], prompt_len=len(prompt))
            with torch.no_grad():
                logp, _ = token_logprobs(model, batch)
            ours = logp[0][batch.mask[0].bool()]
            out.append(float((ours - torch.tensor(c["logprobs"])).abs().max()))
        return out

    with_fix = max(diffs(sampling))
    without = max(diffs({"temperature": sampling["temperature"]}))  # the full-vocabulary recompute
    print(f"max |learner - vLLM| per-token log-prob: truncated {with_fix:.2e}, full vocabulary {without:.2e}")
    assert with_fix < 1e-4
    assert without > 1e-3
