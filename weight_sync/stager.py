"""The engine process's side of weight sync: join a generation, receive a version or read a
checkpoint into *staged* tensors, and hand them over to be loaded.

It runs where the model lives (in a vLLM engine, the worker process, behind the thin
binding of rollout_service/worker_ext.py) and is plain Python without vLLM, so the
weight-sync tests drive it on CPU as they drive the follower. The path of an update runs
one way: the follower (weight_sync/follower.py) tells the engine, the engine asks its
worker process, the binding calls this stager, and the stager the receiver
(weight_sync/receiver.py); nothing calls back up.

- :meth:`WeightStager.join` checks the generation's manifest against the model's
  checkpoint shapes and the quantization the engine was started for, and checks in
  under the follower's *slot* (:func:`~weight_sync.transport.check_in_slot`), or refuses
  there, saying why. It keeps the manifest (in its receiver) for the whole generation:
  an update then names only its version and the manifest's hash, which only JSON-able
  values may cross vLLM's ``collective_rpc``.
- :meth:`WeightStager.receive` and :meth:`WeightStager.read` stage a version's or a
  checkpoint's tensors, complete or not at all: a failed transfer leaves nothing staged
  (and the generation: the follower asks back in), so the model keeps its weights.
- :meth:`WeightStager.take` hands the staged tensors over once, to be loaded with
  generation paused. Received tensors are views into the receiver's buffers: they must
  be loaded before the next :meth:`receive`.

Every operation answers with a JSON-able reply, what crosses ``collective_rpc``: ``ok``,
``error``, ``refused`` and ``left_out`` (a join), and its timing (``transfer_s``,
``read_s``); :meth:`~weight_sync.follower.SyncOutcome.of` reads it.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from weight_sync.adapters import read_adapter
from weight_sync.manifest import Manifest, incompatibility, plan_buckets, refusal, shape_mismatch
from weight_sync.names import checkpoint_shapes
from weight_sync.receiver import WeightReceiver
from weight_sync.transport import LeftOut, SyncError


class WeightStager:
    def __init__(self, shapes: dict[str, tuple[int, ...]], quant_compat: str = "", quant_profile: str = "",
                 lora_rank: int = 0):
        """``shapes``: the model's tensors as its checkpoint has them; ``quant_compat``: the
        quantization its engine was started for (``quant_profile``: its profile, which an
        adapter must have been rewritten for); ``lora_rank``: the largest adapter rank the
        engine takes (0: none). A manifest or checkpoint that does not fit them is refused."""
        self.shapes, self.quant_compat = shapes, quant_compat
        self.quant_profile, self.lora_rank = quant_profile, lora_rank
        self.receiver: WeightReceiver | None = None  # the generation joined, with its manifest
        self._staged: list[tuple[str, torch.Tensor]] | None = None
        self.staged_adapter = ""  # the adapter config of what is staged, when it is an adapter

    @classmethod
    def for_model(cls, model_dir: str, quant_compat: str = "", quant_profile: str = "",
                  lora_rank: int = 0) -> "WeightStager":
        return cls(checkpoint_shapes(model_dir), quant_compat, quant_profile, lora_rank)

    def _incompatibility(self, manifest: Manifest) -> str | None:
        return incompatibility(manifest, self.shapes, self.quant_compat, quant_profile=self.quant_profile,
                               lora_rank=self.lora_rank)

    def join(self, host: str, port: int, slot: str, generation: int, manifest: Manifest, timeout_s: float) -> dict:
        """Leave any generation, then check in under ``slot`` and join ``generation``, or
        refuse it when ``manifest`` does not fit the model (``refused``: the learner stops,
        naming this worker and the reason, if ``manifest`` is its own; the refusal names the
        manifest's hash, :func:`~weight_sync.manifest.refusal`)."""
        self.leave()
        refuse = self._incompatibility(manifest)
        try:
            self.receiver = WeightReceiver.join(host, port, slot, generation, manifest, timeout_s,
                                                None if refuse is None else refusal(manifest, refuse))
        except LeftOut as e:
            return {"ok": False, "left_out": True, "refused": refuse is not None, "error": refuse or str(e)}
        except SyncError as e:
            return {"ok": False, "error": str(e)}
        return {"ok": True}

    def receive(self, version: int, manifest_hash: str) -> dict:
        """Stage ``version`` of the joined generation, whose manifest has ``manifest_hash``;
        on any failure nothing is staged and the generation is left."""
        receiver = self.receiver
        if receiver is None:
            return {"ok": False, "error": "not in a sync generation"}
        t0 = time.perf_counter()
        try:
            if manifest_hash != receiver.manifest.hash:
                raise SyncError(f"manifest {manifest_hash} is not generation {receiver.generation}'s "
                                f"{receiver.manifest.hash}")
            self._staged = receiver.receive(version, receiver.manifest)
        except SyncError as e:
            self.leave()
            return {"ok": False, "error": str(e)}
        self.staged_adapter = receiver.manifest.adapter
        return {"ok": True, "transfer_s": time.perf_counter() - t0, "adapter": bool(self.staged_adapter)}

    def read(self, model_dir: str) -> dict:
        """Stage a checkpoint's weights (all read and shape-checked before any is loaded)."""
        from safetensors.torch import load_file

        self._staged, self.staged_adapter = None, ""
        t0 = time.perf_counter()
        try:
            if (adapter := read_adapter(model_dir)) is not None:
                return self._stage_adapter(model_dir, *adapter, t0)
            weights = {}
            for f in sorted(Path(model_dir).glob("*.safetensors")):
                weights.update(load_file(f))
        except OSError as e:  # e.g. pruned by the learner while we read it
            return {"ok": False, "error": f"reading {model_dir}: {e}"}
        mismatch = shape_mismatch(((n, tuple(t.shape)) for n, t in weights.items()), self.shapes,
                                  f"checkpoint {model_dir}")
        if mismatch:
            return {"ok": False, "error": mismatch}
        self._staged = list(weights.items())
        return {"ok": True, "read_s": time.perf_counter() - t0}

    def _stage_adapter(self, model_dir: str, tensors: list[tuple[str, torch.Tensor]], config: str, t0: float) -> dict:
        """Stage a checkpoint's adapter (learner.lora) once it fits this engine, as one received would."""
        manifest = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in tensors], 1 << 62, self.quant_profile,
                                self.quant_compat, adapter=config)
        if why := self._incompatibility(manifest):
            return {"ok": False, "error": f"checkpoint {model_dir}: {why}"}
        self._staged, self.staged_adapter = tensors, config
        return {"ok": True, "read_s": time.perf_counter() - t0, "adapter": True}

    def take(self) -> list[tuple[str, torch.Tensor]] | None:
        """The staged weights, once (None when nothing is staged)."""
        staged, self._staged = self._staged, None
        return staged

    def leave(self) -> None:
        """Leave the generation (if any) and drop what is staged."""
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = None
        self._staged, self.staged_adapter = None, ""
