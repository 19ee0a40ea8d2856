"""vLLM's top-k/top-p truncation, mirrored on the learner, and the log-prob of a token it removed.

Its own module so that the plain path (learner/policy.py) and the chunked head (learner/head.py)
apply the one rule.
"""

from __future__ import annotations

import math

import torch

# The log-prob of a token that top-k/top-p removed (probability 0). Finite, not -inf: the
# loss and the metrics multiply by the mask (-inf * 0 is nan), and any log-ratio clamp
# (``learner.log_ratio_clamp``) turns it into a weight/ratio of exp(-clamp) all the same.
OUTSIDE_LOGPROB = -1e4


@torch.no_grad()
def truncation_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """Which tokens each row's top-k and top-p keep: (N, T, V) bool, or None if no row truncates.

    ``scaled`` (N, T, V) are fp32 logits already divided by the temperature; ``top_k`` (N,)
    is off unless ``0 < k < V`` and ``top_p`` (N,) off unless ``p < 1``, as in vLLM. This is
    vLLM's sampler (``vllm/v1/sample/ops/topk_topp_sampler.py``, ``apply_top_k_top_p_pytorch``,
    the path its CPU engine takes), on the same values in the same order:

    1. temperature first (the caller's division), then top-k, then top-p;
    2. top-k keeps every token whose logit is >= the k-th largest, so **ties at the k-th
       value are all kept** (possibly more than k tokens). (vLLM's Triton kernel, which
       its GPU engines use, keeps exactly k there, the lowest ids first: the two differ
       only on bit-equal fp32 logits at the k-th place);
    3. top-p runs on the top-k survivors: their softmax sorted ascending, cumulative sum,
       a token is dropped where the cumsum is <= 1 - p (``1 - p`` in fp32), and the most
       likely token is always kept. **Ties at the top-p cut** may be split: equal
       probabilities are ordered by a stable sort (lower token id first, so dropped first,
       the higher ids kept). vLLM's CPU sort is not stable, so which of tokens with exactly
       equal probability straddling the cut it keeps is unspecified; that needs bit-equal
       fp32 logits, which real models do not produce.

    A row with top-p off is not top-p-filtered at all (vLLM, when another row of its batch
    uses top-p, also drops that row's tokens whose fp32 probability underflows to exactly 0:
    they can never be sampled, so no log-prob the learner is compared on differs).
    Computed without gradient, one row at a time (one sort of (T, V) at a time).
    """
    vocab = scaled.shape[-1]
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1
    rows = (k_on | p_on).nonzero().flatten().tolist()
    if not rows:
        return None
    keep = torch.ones(scaled.shape, dtype=torch.bool, device=scaled.device)
    for i in rows:
        x = scaled[i].detach()  # (T, V)
        k = int(top_k[i]) if k_on[i] else None
        if not p_on[i]:  # top-k only: no sort of the whole vocabulary
            keep[i] = x >= x.topk(k, dim=-1).values[:, -1:]
            continue
        x_sort, idx = x.sort(dim=-1, descending=False, stable=True)
        if k is not None:
            x_sort = x_sort.masked_fill(x_sort < x_sort[:, vocab - k:vocab - k + 1], -math.inf)
        cum = x_sort.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p[i].to(torch.float32)
        drop[:, -1] = False  # at least one
        drop |= x_sort == -math.inf
        keep[i] = torch.empty_like(drop).scatter_(-1, idx, ~drop)
    return keep


def truncated_log_softmax(scaled: torch.Tensor, top_k: torch.Tensor,
                          top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-softmax (N, T, V) of fp32 logits already divided by the temperature, renormalised over the
    tokens each row's top-k/top-p keep (:func:`truncation_mask`), ``OUTSIDE_LOGPROB`` elsewhere; and
    that mask, or None where no row truncates (the plain softmax over the vocabulary)."""
    keep = truncation_mask(scaled, top_k, top_p)
    if keep is None:
        return torch.log_softmax(scaled, dim=-1), None
    return torch.log_softmax(scaled.masked_fill(~keep, -math.inf), dim=-1).masked_fill(~keep, OUTSIDE_LOGPROB), keep
