"""Turn group records into padded training tensors.

Each sample becomes one row ``prompt + response`` (right-padded). Position t of the
``(N, T-1)`` tensors describes the token at t+1, predicted from the logits at t, so
``mask`` is 1 exactly on the response tokens (the sampled ones, EOS included).

A multi-turn episode (a sample with a loss ``mask``, rlpipe/schema.py) is one row too: the
prompt and every token of the episode, exactly the ids the engine saw, so the forward
recomputes each model token's log-prob on the very context it was sampled from. Its
environment tokens are context only: ``mask`` is 0 there (and ``behavior_logprobs`` 0), so
they leave the loss, the IS weights, every mismatch metric and the token counts, all of
which are sums over ``mask`` (learner/loss.py). ``staleness`` counts from the oldest
model token's version.

Routing replay (issue 36): when the records carry routes, ``routes`` holds each position's
experts in the row's own layout, (N, T, MoE layers, top_k), -1 where the engine forwarded
nothing (the last token, the padding); learner/routing.py replays them in every forward.

Score centering (``learner.score_centering_k``): when the records carry the sampler's top-k,
``sampler_topk_ids`` and ``sampler_topk_logprobs`` (N, T-1, K) hold each response position's
candidates where ``targets`` holds its sampled token; off the mask the ids are 0 and the
log-probs -inf (no candidate: learner/score_centering.py leaves them out).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from rlpipe.schema import GroupRecord


@dataclass
class Batch:
    input_ids: torch.Tensor  # (N, T) long
    attention_mask: torch.Tensor  # (N, T) long
    targets: torch.Tensor  # (N, T-1) long: input_ids shifted left
    mask: torch.Tensor  # (N, T-1) float: 1 on response tokens the model sampled (0 on environment tokens)
    behavior_logprobs: torch.Tensor  # (N, T-1) float: mu, 0 off the mask
    advantages: torch.Tensor  # (N,), or (N, T-1) per token with a teacher (learner/distillation.py)
    rewards: torch.Tensor  # (N,)
    group_index: torch.Tensor  # (N,) long: which record each row came from
    prompt_len: torch.Tensor  # (N,) long: the record's prompt tokens, shared by the rows of a group
    staleness: torch.Tensor  # (N,) long: learner version - the row's oldest model token's version
    temperature: torch.Tensor  # (N,) float: the sampling temperature of each row
    top_p: torch.Tensor  # (N,) float32: each row's nucleus mass (1: off)
    top_k: torch.Tensor  # (N,) long: each row's top-k (-1 or 0: off)
    routes: torch.Tensor | None = None  # (N, T, layers, top_k) int32 expert ids, -1: none; routing replay only
    env_mask: torch.Tensor | None = None  # (N, T-1) float: 1 on environment tokens inside a response (a tool's)
    sampler_topk_ids: torch.Tensor | None = None  # (N, T-1, K) long; score centering only
    sampler_topk_logprobs: torch.Tensor | None = None  # (N, T-1, K) float, -inf: no candidate

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum().item())

    def select(self, rows: torch.Tensor) -> "Batch":
        return self._map(lambda name, value: value[rows])

    def trimmed(self) -> "Batch":
        """Without the padding columns past the longest row (rows are right-padded)."""
        width = int(self.attention_mask.sum(1).max().item())

        def trim(name: str, value: torch.Tensor) -> torch.Tensor:
            if value.dim() < 2:
                return value
            return value[:, : width if name in ("input_ids", "attention_mask", "routes") else width - 1]
        return self._map(trim)

    def to(self, device: torch.device) -> "Batch":
        return self._map(lambda name, value: value.to(device))

    def _map(self, fn) -> "Batch":
        """A batch of ``fn(name, tensor)`` for each field (an absent ``routes`` stays absent)."""
        return Batch(**{f.name: None if (v := getattr(self, f.name)) is None else fn(f.name, v) for f in fields(self)})


def microbatches(batch: Batch, rows: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
    """``rows`` split so each part, padded to its own longest row, holds at most
    ``max_tokens`` tokens (rows x longest length); shortest rows first, so rows of similar
    length share their padding. A row longer than the budget goes alone. ``max_tokens``
    0: all of ``rows`` at once."""
    if not max_tokens or len(rows) == 0:
        return [rows]
    lengths = batch.attention_mask[rows].sum(1)
    order = torch.argsort(lengths, stable=True)
    parts, current, longest = [], [], 0
    for i in order.tolist():
        length = int(lengths[i])
        if current and max(longest, length) * (len(current) + 1) > max_tokens:
            parts.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    parts.append(current)
    return [rows[torch.tensor(part, device=rows.device)] for part in parts]


def collate(records: list[GroupRecord], advantages: torch.Tensor, version: int, pad_id: int = 0) -> Batch:
    """``advantages`` is (G, n): one row per record, one column per sample."""
    rows, mus = [], []
    for rec in records:
        prompt = rec.prompt_tokens.tolist()
        for s in rec.samples:
            rows.append(prompt + s.tokens.tolist())
            mus.append((len(prompt), s.logprobs, s.model_mask()))
    n_rows, width = len(rows), max(map(len, rows))
    input_ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n_rows, width), dtype=torch.long)
    mask = torch.zeros((n_rows, width - 1))
    env = torch.zeros((n_rows, width - 1))
    mu = torch.zeros((n_rows, width - 1))
    for i, (row, (plen, lps, model)) in enumerate(zip(rows, mus)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        # response token k sits at position plen+k and is predicted at plen+k-1
        model = torch.from_numpy(model).float()
        mask[i, plen - 1 : len(row) - 1] = model
        env[i, plen - 1 : len(row) - 1] = 1 - model
        mu[i, plen - 1 : len(row) - 1] = torch.from_numpy(lps) * model
    group_index = torch.tensor([g for g, rec in enumerate(records) for _ in rec.samples])
    return Batch(
        input_ids=input_ids,
        attention_mask=attention,
        targets=input_ids[:, 1:],
        mask=mask,
        behavior_logprobs=mu,
        advantages=torch.cat([advantages[g, : len(rec.samples)] for g, rec in enumerate(records)]).float(),
        rewards=torch.tensor([s.reward for rec in records for s in rec.samples], dtype=torch.float32),
        group_index=group_index,
        prompt_len=torch.tensor([len(rec.prompt_tokens) for rec in records for _ in rec.samples]),
        staleness=torch.tensor([version - s.oldest_version(rec.policy_version) for rec in records
                                for s in rec.samples]),
        temperature=torch.tensor([float(rec.sampling.get("temperature", 1.0)) or 1.0
                                  for rec in records for _ in rec.samples]),
        top_p=torch.tensor([float(_or(rec.sampling.get("top_p"), 1.0)) for rec in records for _ in rec.samples],
                           dtype=torch.float32),
        top_k=torch.tensor([int(_or(rec.sampling.get("top_k"), -1)) for rec in records for _ in rec.samples],
                           dtype=torch.long),
        routes=_routes(records, width),
        env_mask=env,
        **_sampler_topk(records, width),
    )


def _sampler_topk(records: list[GroupRecord], width: int) -> dict:
    """The records' sampler top-k laid out as their rows' targets (collate: response token j of a
    sample with prompt P at position P - 1 + j), or {} when no record carries any."""
    ks = {rec.sampler_topk for rec in records}
    if ks == {0}:
        return {}
    if len(ks) > 1:
        raise ValueError(f"records with different sampler_topk in one batch: {sorted(ks)}")
    k = ks.pop()
    n_rows = sum(len(rec.samples) for rec in records)
    ids = torch.zeros((n_rows, width - 1, k), dtype=torch.long)
    logprobs = torch.full((n_rows, width - 1, k), float("-inf"))
    i = 0
    for rec in records:
        start = len(rec.prompt_tokens) - 1
        for s in rec.samples:
            end = start + len(s.tokens)
            ids[i, start:end] = torch.from_numpy(s.topk_ids.astype("int64"))
            logprobs[i, start:end] = torch.from_numpy(s.topk_logprobs.astype("float32"))
            i += 1
    return {"sampler_topk_ids": ids, "sampler_topk_logprobs": logprobs}


def _routes(records: list[GroupRecord], width: int) -> torch.Tensor | None:
    """The records' expert ids laid out as their rows (collate): sample s of a record with prompt
    P holds rows for positions 0..P+len(s)-2; the rest is -1. None when no record has routes
    (a run without routing replay); a mix cannot pass the reader (rlpipe/admission.py)."""
    shapes = {rec.routing for rec in records}
    if shapes == {None}:
        return None
    if len(shapes) > 1:
        raise ValueError(f"records with different routing shapes in one batch: {sorted(map(str, shapes))}")
    layers, top_k, _ = shapes.pop()
    rows = [s.routes for rec in records for s in rec.samples]
    out = torch.full((len(rows), width, layers, top_k), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.from_numpy(r.astype("int32"))
    return out


def _or(value, default):
    """``value`` unless it is missing (None)."""
    return default if value is None else value
