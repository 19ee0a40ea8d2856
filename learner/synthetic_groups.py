"""Synthetic trajectory groups for the learner's benches and tests: one builder, so that a
bench's groups and a test's are made the same way (bench/learner_speed.py, bench/queue_cost.py,
and tests/test_learner.py's ``synthetic_groups``, which the learner tests share). It lives
with the learner, whose code path (``collate``, ``token_logprobs``) it uses, so that both
the benches and the tests import it without importing each other.

Each group answers a random sum of the toy model's task (``<bos> a a + b b =``, or a
prompt of random ids), its responses are random digits ended by EOS, and its behavior
log-probs (mu) are the model's own plus Gaussian noise: a train/serve mismatch of known
size. Rewards alternate 0/1, so every group has a spread (none is skipped as flat).
"""

from __future__ import annotations

import numpy as np
import torch

from rlpipe.schema import GroupRecord, Sample


def load_quietly(model_path: str):
    """The policy at ``model_path``, loaded without the "Loading weights" bar (a bench prints
    its own progress lines)."""
    from transformers.utils import logging as hf_logging

    from learner.policy import load_policy

    hf_logging.disable_progress_bar()
    return load_policy(model_path)


def own_logprobs(model, prompt_tokens, response_tokens, temperature: float = 1.0) -> torch.Tensor:
    """The learner's log-probs of one response, through its own code path (``collate`` and
    ``token_logprobs``), the response alone in its batch."""
    from learner.batch import collate
    from learner.policy import token_logprobs

    rec = GroupRecord("t", "g", "p", "w", 0, 0, "fp32", "", {"temperature": temperature},
                      np.asarray(prompt_tokens, dtype=np.int32),
                      [Sample(np.asarray(response_tokens, dtype=np.int32),
                              np.zeros(len(response_tokens), dtype=np.float32), "stop", 0.0)])
    batch = collate([rec], torch.zeros(1, 1), 0)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
    return logp[0][batch.mask[0].bool()]


def synthetic_groups(model, n_groups: int, n: int = 4, min_len: int = 2, max_len: int = 4, seed: int = 0,
                     noise: float = 0.05, prompt_len: int = 0, precisions=("bf16",), version: int = 0,
                     name: str = "bench") -> list[GroupRecord]:
    """``n_groups`` groups of ``n`` responses of random lengths in ``min_len..max_len`` (EOS
    included) to random sums (``prompt_len`` > 0: prompts of that many ids, as a real chat
    prompt is long); mu is ``model``'s own log-prob plus Gaussian noise of std ``noise``
    (kept a log-prob: at most 0); rewards 0/1. Group ``g`` is ``{name}-{seed}-{g}``, of
    precision ``precisions[g % len(precisions)]`` and policy version ``version``.

    The same ``seed`` gives the same groups: one random stream, drawn group by group and
    response by response (its length, its tokens, then its noise), and each response's
    log-probs computed alone in its batch, so that no padding beside it moves them."""
    rng = np.random.default_rng(seed)
    records = []
    for g in range(n_groups):
        prompt = np.array([1, *rng.integers(5, 15, 2), 14, *rng.integers(5, 15, 2), 17], dtype=np.int32)
        if prompt_len:
            prompt = np.array([1, *rng.integers(5, 15, prompt_len - 1)], dtype=np.int32)
        samples = []
        for i in range(n):
            length = int(rng.integers(min_len, max_len + 1))
            tokens = np.array([*rng.integers(5, 15, length - 1), 2], dtype=np.int32)
            exact = own_logprobs(model, prompt, tokens).numpy()
            mu = np.minimum(exact + rng.normal(0, noise, len(tokens)), 0).astype(np.float32)
            samples.append(Sample(tokens, mu, "stop", float(i % 2)))
        records.append(GroupRecord("bench", f"{name}-{seed}-{g}", str(g), "bench", version, version,
                                   precisions[g % len(precisions)], "",
                                   {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": max_len},
                                   prompt, samples))
    return records
