"""One weight-sync channel per rollout precision.

Workers of different precisions need different tensors (bf16 weights, or int8 plus scales
quantized with the profile), so each precision of the fleet has its own wire
(quant/transfer.py), its own sync generation and rendezvous hash (``Keys.sync_channel``).
A run whose workers all share one precision has one channel on the plain ``sync`` hash.
"""

from __future__ import annotations

import torch

from quant.transfer import rollout_weights
from weight_sync.sender import WeightSender


class SyncChannel:
    def __init__(self, cfg, r, keys, precision: str, mixed: bool):
        self.precision = precision
        self.mixed = mixed  # a fleet of several precisions: only workers registered with ours
        self.wire = rollout_weights(precision, cfg.quant, cfg.model.path)
        self.sender = WeightSender(r, keys, cfg.sync.host, cfg.sync.timeout_s, int(cfg.sync.bucket_mib * 2**20),
                                   self.wire.cast_to, channel=precision if mixed else "")
        self._prepared: tuple[int, dict[str, torch.Tensor]] | None = None  # (version, tensors) last sent

    def live(self, workers: dict[str, dict[str, str]]) -> dict[str, str]:
        """``id -> incarnation`` of the live workers this channel serves."""
        return {w: f.get("incarnation", "") for w, f in workers.items()
                if not self.mixed or f.get("precision") == self.precision}

    def prepared(self, version: int) -> dict[str, torch.Tensor] | None:
        """The tensors sent for ``version``, if they were."""
        return self._prepared[1] if self._prepared and self._prepared[0] == version else None

    def sync(self, model, version: int, step: int, live: dict[str, str]) -> tuple[dict, dict]:
        """Send ``version`` to ``live``; returns ``(sync stats, quantization metrics)``.
        Quantizing (and its monitors) runs once per version, not again for a re-formed generation."""
        tensors, quant_metrics = self.prepared(version), {}
        if tensors is None:
            tensors, quant_metrics = self.wire.prepare(model, step)
            self._prepared = (version, tensors)
        stats = self.sender.sync(version, tensors.items, live, self.wire.quant_profile, self.wire.compat)
        return stats, quant_metrics


def make_channels(cfg, r, keys) -> dict[str, SyncChannel]:
    precisions = list(dict.fromkeys(cfg.rollout.fleet)) or [cfg.rollout.precision]
    mixed = bool(cfg.rollout.fleet)
    return {p: SyncChannel(cfg, r, keys, p, mixed) for p in precisions}
