"""What the learner sends to the workers of one precision, prepared once per update.

:func:`rollout_weights` picks the wire (:class:`Wire`) for a precision:

- :class:`CastWeights`: the parameters as they are, cast to the engine dtype while
  packing (bf16, fp16, fp32, and fp8 that the engine quantizes itself);
- :class:`Fp8Weights`: per-channel fp8 plus scales, quantized here;
- :class:`Int8Weights`: calibration transfer. Every update is smoothed and quantized with
  the frozen profile, here on the learner, so no worker re-quantizes; the monitors
  (quant/monitor.py) run on the result, in a thread of their own on a copy of the policy
  (quant/background.py: the update is not held for them), and with ``quant.int8.recalibrate:
  auto`` a crossed threshold re-calibrates on the current policy, which the next update ships.

``prepare(model, step)`` returns ``(tensors, metrics)``; ``quant_profile`` and ``compat``
go into the sync manifest, where a worker checks them against its engine.

A sharded learner (FSDP) never holds the whole model, so it never holds the whole wire
either: ``prepare_sharded`` returns the wire's names, dtypes and shapes only (meta
tensors, for the manifest), and :class:`Stream` makes each bucket's tensors as the sender
packs it, from that bucket's parameters gathered whole (``part``). Every wire tensor
depends on one parameter alone (smoothing needs only the profile's vectors), so the
stream sends bit for bit what the whole model would. int8's monitors then run on a layer
sample (quant/monitor.py ``sampled_monitor``).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch

from quant.background import BackgroundMonitor
from quant.int8 import fp8_tensors, quantized_specs, smoothed_adapter, source_parameter
from quant.monitor import monitor, sampled_monitor
from quant.quant_profile import QuantProfile, fp8_identity, load_for_run, model_fingerprint
from rlpipe.precisions import spec
from weight_sync.adapters import base_names, wire_config, wire_tensors
from weight_sync.names import served_parameters

log = logging.getLogger(__name__)


class Wire(Protocol):
    """What the learner sends to the workers of one precision (learner/channels.py
    ``SyncChannel``): one of the three classes below, picked by :func:`rollout_weights`.

    ``quantized``: the learner quantizes the weights itself, so the tensors leave in their
    own dtypes (``cast_to`` None), a version may travel as a delta against the one before
    (weight_sync/delta.py: most quantized values stay put, where nearly every cast value
    moves), and the checkpoint keeps them for returning workers. ``quant_profile`` and
    ``compat`` go into every manifest, where a worker checks them against its engine."""

    quantized: bool
    cast_to: torch.dtype | None  # the dtype the sender casts every tensor to; None = as they are
    quant_profile: str  # the hash of the quantization in force ("" for a cast)
    compat: str  # what the workers' engines must have been started for ("" for a cast)
    adapter: str = ""  # a LoRA adapter's config (AdapterWeights): the tensors are the adapter alone
    adapter_wire: bool = False  # AdapterWeights: a version is an adapter, gathered whole under FSDP

    def prepare(self, model, step: int) -> tuple[dict[str, torch.Tensor], dict]:
        """The whole wire of ``model`` for the update of ``step``, and its metrics."""

    def prepare_sharded(self, model, step: int, collectives) -> tuple[dict[str, torch.Tensor], dict]:
        """A sharded learner's wire: names, dtypes and whole shapes only (for the manifest)."""

    def part(self, params: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
        """The wire tensors made from ``params`` gathered whole (``names``: every served name)."""

    def status(self) -> dict | None:
        """What the learner's ``/status`` shows of this wire under ``quant``, or None: nothing."""
        return None


class CastWeights(Wire):
    quantized = False
    quant_profile = ""
    compat = ""

    def __init__(self, dtype: torch.dtype):
        self.cast_to = dtype

    def prepare(self, model, step: int) -> tuple[dict[str, torch.Tensor], dict]:
        return served_parameters(model), {}

    def prepare_sharded(self, model, step: int, collectives) -> tuple[dict[str, torch.Tensor], dict]:
        return served_parameters(model), {}  # shards, with their whole shapes: cast while packing

    def part(self, params: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
        return params


class Fp8Weights(Wire):
    quantized, cast_to = True, None

    def __init__(self, base_model: str):
        """``base_model``: the base model's fingerprint (quant/quant_profile.py ``model_fingerprint``)."""
        self.compat, self.quant_profile = fp8_identity(base_model)

    def prepare(self, model, step: int) -> tuple[dict[str, torch.Tensor], dict]:
        t0 = time.perf_counter()
        tensors = fp8_tensors(served_parameters(model))
        return tensors, {"quant_seconds": time.perf_counter() - t0}

    def prepare_sharded(self, model, step: int, collectives) -> tuple[dict[str, torch.Tensor], dict]:
        return quantized_specs(whole_shapes(model), torch.float8_e4m3fn, input_scales=False), {}

    def part(self, params: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
        return fp8_tensors(params)


class Int8Weights(Wire):
    quantized, cast_to = True, None

    def __init__(self, profile: QuantProfile, qcfg):
        """``qcfg``: the run's ``quant.int8`` section (the monitors and recalibration)."""
        self.profile = profile
        self.qcfg = qcfg
        self.previous: dict[str, torch.Tensor] | None = None  # the last version's int8 weights
        self.recalibrations = 0
        self.last_recalibration_step: int | None = None
        self.last_monitors: dict = {}
        self.background: BackgroundMonitor | None = None  # quant.int8.monitor_background's thread, made on first use

    @property
    def quant_profile(self) -> str:
        return self.profile.hash

    @property
    def compat(self) -> str:
        return self.profile.compat

    def _quantize(self, params: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return self.profile.int8_tensors(params)

    def part(self, params: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
        return self.profile.int8_tensors(params, names)[0]

    def _monitored(self, step: int) -> bool:
        """Whether this update runs the monitors: every ``quant.int8.monitor_every``, and the first."""
        return step % self.qcfg.monitor_every == 0 or self.previous is None

    def prepare_sharded(self, model, step: int, collectives) -> tuple[dict[str, torch.Tensor], dict]:
        """The wire's specs, and on a monitored update the monitors on a layer sample
        (``quant.int8.monitor_layers``) with ``collectives`` (``gather``, ``forward``: every rank's).
        Recalibrating needs the whole model and is refused at launch under FSDP."""
        metrics = {}
        if self._monitored(step):
            t0 = time.perf_counter()
            m, self.previous = sampled_monitor(model, collectives.gather, collectives.forward, self.profile,
                                               self.previous, list(served_parameters(model)), self.qcfg.monitor_layers)
            metrics["quant_monitor_seconds"] = time.perf_counter() - t0
            over = self._over_thresholds(m)
            if over:
                log.warning("quantized policy over threshold on the sampled layers (%s)", ", ".join(over))
                metrics["quant_over_threshold"] = over
            metrics.update(m)
            self.last_monitors = {**m, "over_threshold": over}
        metrics.update(quant_profile=self.profile.hash, quant_recalibrations_total=self.recalibrations)
        return quantized_specs(whole_shapes(model), torch.int8, input_scales=self.profile.static), metrics

    def prepare(self, model, step: int) -> tuple[dict[str, torch.Tensor], dict]:
        t0 = time.perf_counter()
        params = {n: t.detach() for n, t in served_parameters(model).items()}
        tensors, smoothed = self._quantize(params)
        metrics = {"quant_seconds": time.perf_counter() - t0}
        if self.qcfg.monitor_background:
            tensors = self._background(model, params, tensors, smoothed, step, metrics)
        elif self._monitored(step):
            tensors = self._monitor(model, params, tensors, smoothed, step, metrics)
        metrics["quant_profile"] = self.profile.hash  # (a new one after a recalibration)
        self.previous = {k: v for k, v in tensors.items() if v.dtype == torch.int8}
        return tensors, metrics

    def _monitor(self, model, params, tensors, smoothed, step: int, metrics: dict) -> dict[str, torch.Tensor]:
        """Run the monitors into ``metrics``; past a threshold warn, or recalibrate and
        re-quantize. Returns the tensors to send."""
        t0 = time.perf_counter()
        m = monitor(model, tensors, smoothed, self.profile, self.previous)
        metrics["quant_monitor_seconds"] = time.perf_counter() - t0
        over = self._over_thresholds(m)
        if over:
            action = self.qcfg.recalibrate
            log.warning("quantized policy over threshold (%s); recalibrate=%s", ", ".join(over), action)
            if action == "auto" and not self._cooling(step):
                before = m
                tensors, smoothed = self.recalibrate(model, params, step)
                m = monitor(model, tensors, smoothed, self.profile, self.previous)
                metrics.update({f"{k}_before_recalibration": v for k, v in before.items()
                                if k.startswith("quant_") and k != "quant_worst"})
            metrics["quant_over_threshold"] = over
        metrics.update(m)
        metrics["quant_recalibrations_total"] = self.recalibrations
        self.last_monitors = {**m, "over_threshold": over}
        return tensors

    def _background(self, model, params, tensors, smoothed, step: int, metrics: dict) -> dict[str, torch.Tensor]:
        """``quant.int8.monitor_background``: the monitors of an earlier update, finished since, into
        ``metrics`` (and past a threshold a warning, or a recalibration of this update's policy);
        this update's monitors started on a copy, not waited for (quant/background.py)."""
        if self.background is None:
            self.background = BackgroundMonitor()
        done = self.background.result()
        recalibrated = False
        if done is not None:
            over = self._over_thresholds(done)
            if over:
                log.warning("quantized policy over threshold at step %d (%s); recalibrate=%s",
                            done["quant_monitor_step"], ", ".join(over), self.qcfg.recalibrate)
                done["quant_over_threshold"] = over
                if self.qcfg.recalibrate == "auto" and not self._cooling(step):
                    tensors, smoothed = self.recalibrate(model, params, step)
                    recalibrated = True
            metrics.update(done)
            self.last_monitors = {**done, "over_threshold": over}
        if self._monitored(step) or recalibrated:
            self.background.submit(model, tensors, smoothed, self.profile, self.previous, step)
        metrics.update(quant_recalibrations_total=self.recalibrations,
                       quant_monitor_skipped_total=self.background.skipped)
        return tensors

    def _cooling(self, step: int) -> bool:
        """Within ``recalibrate_cooldown_steps`` of the last recalibration."""
        return self.last_recalibration_step is not None and \
            step - self.last_recalibration_step < self.qcfg.recalibrate_cooldown_steps

    def _over_thresholds(self, m: dict) -> list[str]:
        q = self.qcfg
        limits = {"quant_act_clip_fraction": q.max_act_clip_fraction,
                  "quant_saturation_fraction": q.max_saturation_fraction,
                  "quant_kl_vs_bf16": q.max_kl_vs_bf16}
        return [f"{k} {m[k]:.3g} > {limit:g}" for k, limit in limits.items() if m.get(k, 0) > limit]

    def recalibrate(self, model, params: dict[str, torch.Tensor], step: int):
        """A new profile from the current policy, on the calibration set the profile
        carries; the next sync ships its scales (a new hash, so a new generation)."""
        from quant.calibrate import calibrate

        old = self.profile
        t0 = time.perf_counter()
        self.profile = calibrate(model, old.calibration_ids, old.probe_ids, old.alpha, old.activations,
                                 old.base_model, parent=old.hash, calibrated_on=f"step {step}", scheme=old.scheme)
        self.recalibrations += 1
        self.last_recalibration_step = step
        log.warning("recalibrated at step %d in %.1fs: profile %s -> %s", step, time.perf_counter() - t0, old.hash,
                    self.profile.hash)
        return self._quantize(params)

    def status(self) -> dict:
        """For the learner's ``/status``: the profile and the last monitors with their worst linears."""
        return {"profile": self.profile.summary(), "recalibrations_total": self.recalibrations,
                "last_recalibration_step": self.last_recalibration_step, "monitors": self.last_monitors}


class AdapterWeights(Wire):
    """``learner.lora``: a version is the adapter alone (weight_sync/adapters.py); the workers
    hold the base from the start. On an int8 base the adapter is rewritten for the profile's
    smoothing (quant/int8.py ``smoothed_adapter``), the profile loaded once and never
    recalibrated: the base is frozen, so its calibration stays exact. It travels in the
    engine's dtype (an int8 engine's activations are bf16, and so are its adapters)."""

    quantized, adapter_wire = False, True

    def __init__(self, precision: str, quant, model_path: str):
        wire = quant.wire(precision)
        self.profile = load_for_run(quant.int8, model_path) if wire == "int8" else None
        self.cast_to = getattr(torch, spec(precision).dtype)
        self.quant_profile = self.profile.hash if self.profile else ""
        self.compat = self.profile.compat if self.profile else fp8_identity(model_fingerprint(model_path))[0] \
            if wire == "fp8" else ""
        self.adapter = ""  # its adapter_config.json, from the first version on

    def prepare(self, model, step: int, gather=None) -> tuple[dict[str, torch.Tensor], dict]:
        t0 = time.perf_counter()
        tensors = wire_tensors(model, gather)
        if self.profile is not None:
            tensors = smoothed_adapter(tensors, self.profile.smoothing, base_names(model))
        self.adapter = wire_config(model)
        return tensors, {"quant_seconds": time.perf_counter() - t0} if self.profile is not None else {}

    def prepare_sharded(self, model, step: int, collectives) -> tuple[dict[str, torch.Tensor], dict]:
        return self.prepare(model, step, collectives.gather)  # the adapter is small: gathered whole at once

    def part(self, params: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError("an adapter is gathered whole (prepare_sharded), never streamed")


def whole_shapes(model) -> dict[str, tuple[int, ...]]:
    """Served name -> whole shape (a shard's DTensor has the whole tensor's shape)."""
    return {n: tuple(p.shape) for n, p in served_parameters(model).items()}


class Stream:
    """The sender's ``gather`` for a sharded learner: the wire tensors of one bucket, made
    from its parameters gathered whole (``gather(names)``, every rank's collective) by the
    wire's ``part``. The manifest groups tensors by dtype (weight_sync/manifest.py), so a
    linear's int8 weight and its fp32 scale travel in different buckets: what a part made
    beyond its bucket is kept until its bucket comes, not gathered twice. That is the
    scales alone (one float per row), as each int8 weight precedes its scale."""

    def __init__(self, wire: Wire, gather, names: list[str]):
        self.wire, self.gather, self.names = wire, gather, names
        self._carry: dict[str, torch.Tensor] = {}
        self.seconds = 0.0  # quantizing, for ``quant_seconds``

    def __call__(self, wire_names: list[str]) -> dict[str, torch.Tensor]:
        need = list(dict.fromkeys(source_parameter(n) for n in wire_names if n not in self._carry))
        part = {}
        if need:
            params = self.gather(need)
            t0 = time.perf_counter()
            part = self.wire.part(params, self.names)
            self.seconds += time.perf_counter() - t0
        have = {**self._carry, **part}
        self._carry = {n: t for n, t in have.items() if n not in wire_names}
        return {n: have[n] for n in wire_names}


def rollout_weights(precision: str, quant, model_path: str, lora: bool = False) -> Wire:
    """The wire for workers of ``precision`` (its row in rlpipe/precisions.py; ``quant``, the
    run's QuantConfig, says whether the learner quantizes it); with ``lora``, the adapter's."""
    if lora:
        return AdapterWeights(precision, quant, model_path)
    wire = quant.wire(precision)
    if wire == "int8":
        return Int8Weights(load_for_run(quant.int8, model_path), quant.int8)
    if wire == "fp8":
        return Fp8Weights(model_fingerprint(model_path))
    return CastWeights(getattr(torch, spec(precision).dtype))
