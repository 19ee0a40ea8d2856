"""The learner's weight sync: one channel per rollout precision, and the policy of when
and with whom to sync (:class:`FleetSync`).

Workers of different precisions need different tensors (bf16 weights, or int8 plus scales
quantized with the profile), so each precision of the fleet has its own wire
(quant/transfer.py), its own sync generation and rendezvous hash (``Keys.sync_channel``).
A run whose workers all share one precision has one channel on the plain ``sync`` hash.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Mapping

import torch

from quant.transfer import Stream, Wire, rollout_weights
from rlpipe import registry
from rlpipe.checkpoints import checkpoint_root
from weight_sync.convergence import Converged, Convergence
from weight_sync.names import Piece, served_parameters, served_pieces, served_tensors
from weight_sync.rendezvous import GenerationFloor
from weight_sync.sender import SyncStats, WeightSender
from weight_sync.transport import SyncError
from weight_sync.transport_choice import broadcast_for, role_transport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Collectives:
    """Rank 0's side of what a sharded learner's weight sync needs every rank for (the others
    join on its command, learner/train.py): ``gather(names)``, those parameters whole;
    ``forward(input_ids, attention_mask)``, the policy on a batch (int8's monitors)."""

    gather: Callable[[list[str]], Mapping[str, torch.Tensor]]
    forward: Callable[[torch.Tensor, torch.Tensor], object]


class SyncChannel:
    def __init__(self, cfg, r, keys, precision: str, sharded: Collectives | None = None, fence=None,
                 floor: GenerationFloor | None = None):
        self.precision = precision
        # A fleet's precisions have a channel each, for the workers registered with theirs only.
        self.channel = cfg.rollout.channel(precision)
        self.wire: Wire = rollout_weights(precision, cfg.quant, cfg.model.path, lora=bool(cfg.learner.lora.rank))
        self.sharded, self.stream = sharded, None
        # a sharded learner's quantized wire is made bucket by bucket; an adapter is gathered whole (prepare_sharded)
        self.streamed = bool(sharded) and not self.wire.adapter_wire
        bucket_bytes = int(cfg.sync.bucket_mib * 2**20)
        device = broadcast_for(role_transport(cfg), bucket_bytes, cfg.sync.timeout_s)  # None under gloo
        # Sharded: each bucket's wire tensors are made as it is packed (quant/transfer.py Stream)
        self.sender = WeightSender(r, keys, cfg.sync.host, cfg.sync.timeout_s, bucket_bytes, self.wire.cast_to,
                                   channel=self.channel, fence=fence, device=device, floor=floor,
                                   straggler_s=cfg.sync.straggler_s,
                                   gather=(lambda names: self.stream(names)) if self.streamed else None,
                                   # deltas pay for quantized wires only (weight_sync/delta.py); a sharded
                                   # learner never holds the whole wire, which a delta's base would be
                                   full_every=cfg.sync.delta_full_every
                                   if self.wire.quantized and not sharded else 0)
        self._prepared: tuple[int, dict[str, torch.Tensor]] | None = None  # (version, tensors) last sent

    def live(self, workers: dict[str, dict[str, str]]) -> dict[str, str]:
        """``id -> incarnation`` of the live workers this channel serves."""
        return {w: f.get("incarnation", "") for w, f in workers.items()
                if not self.channel or f.get("precision") == self.precision}

    def prepared(self, version: int) -> dict[str, torch.Tensor] | None:
        """The tensors sent for ``version``, if they were."""
        return self._prepared[1] if self._prepared and self._prepared[0] == version else None

    def sync(self, model, version: int, step: int, live: dict[str, str]) -> tuple[SyncStats, dict]:
        """Send ``version`` to ``live``; returns ``(sync stats, quantization metrics)``.
        Quantizing (and its monitors) runs once per version, not again for a re-formed generation."""
        tensors, quant_metrics = self.prepared(version), {}
        if tensors is None:
            if self.sharded:  # the wire's specs only; its tensors are made bucket by bucket
                tensors, quant_metrics = self.wire.prepare_sharded(model, step, self.sharded)
            else:
                tensors, quant_metrics = self.wire.prepare(model, step)
            self._prepared = (version, tensors)
        # Quantized before the sync (not sharded); sharded, each bucket is quantized as it is packed.
        quant_s = 0.0 if self.streamed else quant_metrics.get("quant_seconds", 0.0)
        if self.streamed:
            self.stream = Stream(self.wire, self.sharded.gather, list(served_parameters(model)))
        stats = self.sender.sync(version, tensors.items, live, self.wire.quant_profile, self.wire.compat,
                                 self.wire.adapter)
        stats.prepare_s = quant_s + stats.pack_s
        if self.streamed and self.wire.quantized and quant_metrics:
            quant_metrics["quant_seconds"] = self.stream.seconds
        return stats, quant_metrics


def rollout_from_weights(wire: Wire, served: dict[str, Piece],
                         weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A quantized wire's tensors made from whole ``weights`` keyed by parameter name
    (``served``: the name each tensor is sent under -> where it is, weight_sync/names.py)."""
    params = served_tensors(served, weights)
    return wire.part(params, list(params))


class FleetSync:
    """Every channel, and when to sync: after each step (:meth:`sync`), and while the
    learner waits for groups, whenever the live workers differ from a channel's generation
    (:meth:`maybe_resync`: a worker joined, returned or died). The first generation waits
    up to ``sync.join_timeout_s`` for the whole configured fleet, so that no worker fills
    the first batches alone while the others start."""

    def __init__(self, cfg, r, keys, metrics, sharded: Collectives | None = None, fence=None):
        """``sharded``: a sharded learner's collectives (:class:`Collectives`); ``fence``: the
        learner lease's, on every write to the sync hashes (rlpipe/fence.py)."""
        self.cfg, self.r, self.keys, self.metrics = cfg, r, keys, metrics
        # Generation numbers taken, beside the checkpoints (weight_sync/rendezvous.py): a run
        # without a directory of its own (tools, tests) counts from Redis and this process only.
        floor = (GenerationFloor(checkpoint_root(cfg) / "sync-generations.json")
                 if cfg.run_dir or cfg.learner.checkpoint_dir else None)
        self.channels = {p: SyncChannel(cfg, r, keys, p, sharded, fence, floor) for p in cfg.rollout.precisions}
        self._started = time.monotonic()
        self.convergence = Convergence()
        self._converged: Converged | None = None  # the newest version that converged since the last row

    def maybe_resync(self, model, version: int, step: int) -> None:
        workers = registry.live_workers(self.r, self.keys)
        self._observe(workers)
        if not any(ch.sender.group for ch in self.channels.values()) and len(workers) < self.cfg.workers \
                and time.monotonic() - self._started < self.cfg.sync.join_timeout_s:
            return
        # Only the channels whose workers changed: the others' members already hold
        # ``version``, and a follower never takes a version again, so re-sending it to them
        # would block this learner for sync.timeout_s and then drop their generation.
        changed = [p for p, ch in self.channels.items() if ch.sender.needs_forming(ch.live(workers))]
        if changed:
            self._sync(model, version, step, workers, changed)

    def _observe(self, workers: dict[str, dict[str, str]]) -> None:
        """Versions every member now serves (weight_sync/convergence.py): their convergence
        goes into the next step's row, and into the convergence histogram."""
        for done in self.convergence.observe(workers):
            self.metrics.sync_seconds.labels(phase="convergence").observe(done.seconds)
            self._converged = done

    def sync(self, model, version: int, step: int) -> dict:
        """The step's sync (:meth:`_sync`), and the convergence of the newest version that
        converged since the last step's (``weight_sync_converged_version``, usually the
        previous one): measured from the workers' registry timestamps, never waited for."""
        workers = registry.live_workers(self.r, self.keys)
        self._observe(workers)
        out = self._sync(model, version, step, workers)
        if self._converged is not None:
            out.update(self._converged.metrics())
            self._converged = None
        return out

    def _sync(self, model, version: int, step: int, workers: dict[str, dict[str, str]],
              precisions: list[str] | None = None) -> dict:
        """Bring every live worker to ``version``, each precision on its channel (of
        ``precisions``, default all); never blocks longer than sync.timeout_s per channel on
        workers (a dead one is left out, see weight_sync.sender). Returns the sync metrics;
        opens the version's convergence."""
        started_at, t0 = time.time(), time.perf_counter()
        out = {"weight_sync_seconds": 0.0, "weight_sync_prepare_seconds": 0.0, "weight_sync_pack_seconds": 0.0,
               "weight_sync_transfer_seconds": 0.0, "weight_sync_form_seconds": 0.0, "weight_sync_members": 0,
               "weight_sync_sent_bytes": 0, "weight_sync_full_bytes": 0, "weight_sync_deltas": 0}
        by_precision, received = {}, {}
        for precision, ch in self.channels.items():
            if precisions is not None and precision not in precisions:
                continue
            try:
                stats, quant_metrics = ch.sync(model, version, step, ch.live(workers))
            except SyncError as e:
                log.warning("weight sync of version %d to %s workers failed, re-forming next time: %s", version,
                            precision, e)
                self.metrics.sync_failures.inc()
                out["weight_sync_failed"] = out.get("weight_sync_failed", 0) + 1
                by_precision[precision] = {"failed": str(e)}
                continue
            out.update(quant_metrics)
            if stats.sync_s:  # a version was sent (not an empty generation)
                self.metrics.sync_seconds.labels(phase="prepare").observe(stats.prepare_s)
                self.metrics.sync_seconds.labels(phase="pack").observe(stats.pack_s)
                self.metrics.sync_seconds.labels(phase="transfer").observe(stats.transfer_s)
            self.metrics.sync_bytes.inc(stats.bytes * stats.members)
            received.update(stats.received)
            seconds = stats.form_s + stats.sync_s
            out["weight_sync_prepare_seconds"] += stats.prepare_s
            out["weight_sync_pack_seconds"] += stats.pack_s
            out["weight_sync_transfer_seconds"] += stats.transfer_s
            out["weight_sync_form_seconds"] += stats.form_s
            out["weight_sync_members"] += stats.members
            out["weight_sync_sent_bytes"] += stats.bytes
            out["weight_sync_full_bytes"] += stats.full_bytes
            out["weight_sync_deltas"] += int(stats.delta)
            by_precision[precision] = {"members": stats.members, "seconds": seconds, "bytes": stats.bytes,
                                       "generation": stats.generation}
        out["weight_sync_generation"] = max(ch.sender.state.generation for ch in self.channels.values())
        # The whole wall time: quantizing (and the int8 monitors), forming, packing, sending, every channel.
        out["weight_sync_seconds"] = time.perf_counter() - t0
        self.convergence.started(version, started_at, received)
        out["weight_sync_left_out_total"] = self.left_out_total
        if len(self.channels) > 1:
            out["weight_sync_by_precision"] = by_precision
        return out

    def drop(self) -> None:
        """Leave every generation (a restarted Redis, a stopping learner): the next sync re-forms."""
        for ch in self.channels.values():
            ch.sender.drop()

    @property
    def left_out_total(self) -> int:
        return sum(ch.sender.left_out_total for ch in self.channels.values())

    def rollout_tensors(self, model, version: int) -> dict[str, tuple[str, object, str]]:
        """Each quantized precision's tensors of ``version`` as sent, for the checkpoint, with
        the profile and (LoRA) the adapter's config: a LoRA run keeps every precision's
        adapter, as its workers load it. A sharded learner never held quantized tensors
        whole: instead, the function that makes them from the checkpoint's gathered weights
        (``{parameter name: tensor}``), bit for bit the same (learner/checkpoint.py ``save``)."""
        out = {}
        for p, ch in self.channels.items():
            if (ch.wire.quantized or ch.wire.adapter_wire) and ch.prepared(version) is not None:
                out[p] = (ch.wire.quant_profile, partial(rollout_from_weights, ch.wire, served_pieces(model))
                          if ch.streamed else ch.prepared(version), ch.wire.adapter)
        return out

    def workers_status(self, version: int) -> dict[str, dict]:
        """Every live worker as the registry has it, and how it stands with weight sync."""
        out = {}
        for w, f in sorted(registry.live_workers(self.r, self.keys).items()):
            worker_version = int(f.get("version", -1))
            ch = self.channels.get(f.get("precision", "")) or next(iter(self.channels.values()))
            out[w] = {"version": worker_version, "behind": version - worker_version,
                      "generation": int(f.get("generation", 0)), "weights": f.get("weights", ""),
                      "member": w in ch.sender.members,
                      "left_out": ch.sender.excluded.get(w) == f.get("incarnation", ""),
                      "precision": f.get("precision", ""), "address": f.get("address", ""),
                      "inflight_groups": int(f.get("inflight", 0)),
                      "last_sync": json.loads(f.get("last_sync") or "{}"), "last_error": f.get("last_error", "")}
        return out

    def status(self, version: int) -> dict:
        """The sync part of the learner's ``/status``."""
        return {
            "sync_generation": max((ch.sender.state.generation for ch in self.channels.values() if ch.sender.group),
                                   default=None),
            "sync_members": [w for ch in self.channels.values() for w in ch.sender.members],
            "sync_left_out_total": self.left_out_total,
            "workers": self.workers_status(version),
            # per precision: its profile, and the last monitors with each one's worst linear
            "quant": {p: s for p, ch in self.channels.items() if (s := ch.wire.status()) is not None},
        }
