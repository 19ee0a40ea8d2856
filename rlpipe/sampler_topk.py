"""The sampler's top-k log-probs of each sampled position, as a record carries them (score centering,
``learner.score_centering_k``; learner/score_centering.py reads them).

Score centering needs, at every position a model token was sampled, the k tokens the engine gave the
most probability and their log-probs under the distribution it sampled from (after temperature,
top-k and top-p: vLLM's ``processed_logprobs``). They travel only when the run asks for them: a
group's ``sampler_topk`` is k, and each sample's ``topk_ids`` / ``topk_logprobs`` hold ``L x k``
values, row t for response token t, best first:

    topk_ids        little-endian int32, none negative
    topk_logprobs   little-endian float16: -inf for a token the sampler's top-k/top-p left out, and
                    for the padding of a row with fewer than k candidates (its id then 0)

6 bytes a candidate: k = 128 costs 768 bytes a token, k = 8 costs 48. float16 keeps a log-prob to
about 3 significant digits, a probability to within 0.1 % relative for log-probs above -8, and the
learner's correction reads probabilities (exp of these), so the rounding is far below the mismatch it
corrects. Only plain samples carry them (score centering is refused with task.tool and
task.environment, whose answers hold tokens nothing sampled).

Kept here, not in rlpipe/schema.py, so the schema names the fields and this module says how they are
packed and checked; numpy only.
"""

from __future__ import annotations

import numpy as np

TOPK_IDS = np.dtype("<i4")
TOPK_LOGPROBS = np.dtype("<f2")
MAX_SAMPLER_TOPK = 1024  # the most candidates a record may carry per token (vLLM's max_logprobs is set to k)


def pack(ids: np.ndarray, logprobs: np.ndarray) -> dict[str, bytes]:
    """A sample's two wire fields from its (L, k) ids and log-probs."""
    return {"topk_ids": np.ascontiguousarray(ids, dtype=TOPK_IDS).tobytes(),
            "topk_logprobs": np.ascontiguousarray(logprobs, dtype=TOPK_LOGPROBS).tobytes()}


def unpack(s: dict, k: int, length: int, where: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A sample's (L, k) ids and log-probs, validated, or (None, None) when the group carries none
    (``k`` 0). Raises ValueError with the reason (the schema turns it into a SchemaError)."""
    present = [key for key in ("topk_ids", "topk_logprobs") if key in s]
    if not k:
        if present:
            raise ValueError(f"{where}{present[0]}: present, but the group's sampler_topk is 0")
        return None, None
    arrays = []
    for key, dtype in (("topk_ids", TOPK_IDS), ("topk_logprobs", TOPK_LOGPROBS)):
        raw = s.get(key)
        if not isinstance(raw, bytes):
            raise ValueError(f"{where}{key}: missing, and the group's sampler_topk is {k}")
        if len(raw) != length * k * dtype.itemsize:
            raise ValueError(f"{where}{key}: {len(raw)} bytes, expected {length} tokens x {k} x {dtype.itemsize}")
        arrays.append(np.frombuffer(raw, dtype=dtype).reshape(length, k).copy())
    ids, logprobs = arrays
    if ids.size and ids.min() < 0:
        raise ValueError(f"{where}topk_ids: negative token id")
    if np.isnan(logprobs).any() or (logprobs > 1e-3).any():
        raise ValueError(f"{where}topk_logprobs: not log-probabilities (nan, or above 0)")
    return ids, logprobs


def check_k(k) -> int:
    """The group's ``sampler_topk``, validated (0: none)."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_SAMPLER_TOPK:
        raise ValueError(f"sampler_topk: {k!r} is not an int in 0..{MAX_SAMPLER_TOPK}")
    return k


def from_steps(steps: list[dict], k: int) -> tuple[np.ndarray, np.ndarray]:
    """(L, k) ids and log-probs from an engine's per-token candidate maps (vLLM's ``logprobs=k``: each
    step maps token ids to entries with ``logprob`` and a 1-based ``rank``; the sampled token is there
    too, with its own rank, which may be beyond k). Best first; a step with fewer than k candidates of
    rank <= k is padded with id 0 and -inf."""
    ids = np.zeros((len(steps), k), dtype=TOPK_IDS)
    logprobs = np.full((len(steps), k), -np.inf, dtype=TOPK_LOGPROBS)
    for t, step in enumerate(steps):
        best = sorted(((e.rank, tok, e.logprob) for tok, e in step.items() if e.rank is not None and e.rank <= k))[:k]
        for j, (_, tok, lp) in enumerate(best):
            ids[t, j], logprobs[t, j] = tok, lp
    return ids, logprobs
