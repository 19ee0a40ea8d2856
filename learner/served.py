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
    weights whose served value changed since :meth:`begin_step`: how much of the update
    the engines see. Sharded (FSDP2) parameters are rounded shard by shard.

    Cost: one fp32 copy of this rank's weights (its shard) for the step, to put the master
    values back; keeping only what the rounding drops would take half that (not done).
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
            master = [t.detach().clone() for t in local]
            for t in local:
                t.copy_(t.to(self.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for t, m in zip(local, master):
                    t.copy_(m)

    @torch.no_grad()
    def begin_step(self) -> None:
        self._before = [t.detach().to(self.dtype) for t in self._local()] if self.dtype is not None else None

    @torch.no_grad()
    def visible_fraction(self) -> float | None:
        if self._before is None:
            return None
        now = [t.detach().to(self.dtype) for t in self._local()]
        changed = sum(int((a != b).sum()) for a, b in zip(now, self._before))
        return changed / max(sum(t.numel() for t in now), 1)
