"""The learner's forwards at the weights the rollout engines serve (``learner.served_weights``).

A bf16 or fp16 engine holds the learner's fp32 master weights rounded to its dtype. At a
real model's learning rate most of an update is below that rounding, so a learner that
computes at the master weights trains (and measures the mismatch against) a policy no
engine serves. learner/step.py runs its forwards and backwards inside
:meth:`ServedWeights.rounded`.
"""

from __future__ import annotations

import contextlib

import torch

from rlpipe.precisions import spec


def served_dtype(cfg) -> torch.dtype | None:
    """The dtype the rollout engines hold the weights in when the learner ships them cast
    (bf16 or fp16 rollout, every worker the same), else None (int8/fp8 are quantized, a
    mixed fleet holds several): what :class:`ServedWeights` rounds to."""
    precisions = cfg.rollout.precisions
    if not cfg.learner.served_weights or len(precisions) != 1:
        return None
    row = spec(precisions[0])
    # An engine holds the weights as cast only without a scheme, and a LoRA adapter in its
    # activation dtype whatever the base's scheme; casting to fp32 rounds nothing.
    return None if (row.scheme and not cfg.learner.lora.rank) or row.dtype == "float32" else getattr(torch, row.dtype)


# visible_fraction compares every SAMPLE-th weight of each tensor: 1/8 of a copy, not a whole one.
SAMPLE = 8
CHUNK = 1 << 20  # elements per slice when the master is put back: int32 temporaries of 4 MiB, not of a tensor


class ServedWeights:
    """The learner's forwards at the weights the rollout engines serve, not at the fp32 master.

    A bf16 engine holds ``bf16(w)``. An Adam step at a real model's learning rate (1e-6 to
    2e-5) is far below bf16's resolution for most weights: measured on SmolLM2-135M after 10
    steps at 2e-5, the fp32 policy had moved KL 0.29 per token from the base model (T 0.4)
    and its bf16 copy 0.005 (6% of the weights had changed in bf16; 82% in fp32). A learner
    computing at the master weights then trains a policy no engine serves, and reads that
    gap as rollout mismatch (k3 KL 0.002 at step 1 -> 0.1-0.2 by step 7, staleness 0).

    Within :meth:`rounded` every parameter holds its served value, so pi_old, the loss and
    its gradient are those of the served policy; the master values come back before the
    optimizer steps them, so updates below the rounding still accumulate, as in
    mixed-precision training. :meth:`visible_fraction` is the share of (this rank's)
    weights whose served value changed since :meth:`begin_step` (on every 8th weight: how
    much of the update the engines see). Sharded (FSDP2) parameters are rounded shard by shard.

    Cost: for bf16, the low 16 bits of each fp32 master (what the rounding drops: half an
    fp32 copy, exact, :func:`split_bf16`); for fp16, whose bits are not the top half of
    fp32's, a whole fp32 copy.
    """

    def __init__(self, params, dtype: torch.dtype | None):
        self.params, self.dtype = list(params), dtype
        self._before: list[torch.Tensor] | None = None

    def _local(self) -> list[torch.Tensor]:
        return [p.to_local() if hasattr(p, "to_local") else p for p in self.params]

    @contextlib.contextmanager
    def rounded(self):
        if self.dtype is None:
            yield
            return
        local = self._local()
        with torch.no_grad():
            if self.dtype == torch.bfloat16:
                kept = [split_bf16(t) for t in local]
            else:
                kept = [t.detach().clone() for t in local]
                for t in local:
                    t.copy_(t.to(self.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for t, k in zip(local, kept):
                    join_bf16(t, *k) if self.dtype == torch.bfloat16 else t.copy_(k)

    @torch.no_grad()
    def begin_step(self) -> None:
        self._before = [_sample(t).to(self.dtype) for t in self._local()] if self.dtype is not None else None

    @torch.no_grad()
    def visible_fraction(self) -> float | None:
        if self._before is None:
            return None
        now = [_sample(t).to(self.dtype) for t in self._local()]
        changed = sum(int((a != b).sum()) for a, b in zip(now, self._before))
        return changed / max(sum(t.numel() for t in now), 1)


def _sample(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)[::SAMPLE]


def split_bf16(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round the fp32 tensor ``t`` to bf16 in place (its values on bf16's grid, still fp32) and
    return what :func:`join_bf16` needs to put the exact master back: each value's low 16 bits
    (int16, what the rounding dropped), and the flat indices of the ties rounded up.

    bf16 is the top 16 bits of an fp32. Rounding to nearest (even on a tie) keeps them, or adds
    one to them when the low half is past the midpoint (0x8000), or at it with an odd top half.
    So from the rounded value and the low half the top half is known, except at an exact tie
    (about one weight in 65,536), whose direction is kept as an index."""
    flat = t.detach().view(-1)
    low = torch.empty(flat.shape, dtype=torch.int16)
    tied_up = []
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start:start + CHUNK]
        bits = part.view(torch.int32)
        low[start:start + CHUNK] = bits.to(torch.int16)  # the low 16 bits, two's complement
        rounded = part.to(torch.bfloat16).float()
        up = (rounded.view(torch.int32) >> 16) != (bits >> 16)
        tie = (bits & 0xFFFF) == 0x8000
        tied_up.append(torch.nonzero(up & tie).view(-1) + start)
        part.copy_(rounded)
    return low, torch.cat(tied_up) if tied_up else torch.empty(0, dtype=torch.long)


def join_bf16(t: torch.Tensor, low: torch.Tensor, tied_up: torch.Tensor) -> None:
    """Put back, in place, the exact fp32 master that :func:`split_bf16` rounded: the top half is
    the rounded value's, less the one a round-up added."""
    flat = t.detach().view(-1)
    for start in range(0, flat.numel(), CHUNK):
        bits = flat[start:start + CHUNK].view(torch.int32)
        low_u = low[start:start + CHUNK].to(torch.int32) & 0xFFFF
        up = low_u > 0x8000
        ties = tied_up[(tied_up >= start) & (tied_up < start + CHUNK)] - start
        up[ties] = True
        bits.copy_(bits - (up.to(torch.int32) << 16) + low_u)
