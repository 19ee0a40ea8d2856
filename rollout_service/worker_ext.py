"""The binding of weight sync to vLLM's worker (``worker_extension_cls``): methods that run
inside the engine's worker process, where the model lives, called from the rollout
engine (rollout_service/engine.py) through ``collective_rpc``.

The sync itself is :class:`~weight_sync.stager.WeightStager`'s (join a generation, stage a
version or a checkpoint); this module only binds it to vLLM: it makes the stager at
start-up, runs its slow operations in a background thread of the engine process while
the engine keeps generating (``rlpipe_start`` + ``rlpipe_poll``), and loads what it
staged into the model (``rlpipe_apply``, the only step that runs with generation paused)
with vLLM's reload and the workarounds of rollout_service/vllm_compat.py. Under routing
replay it also records each token's experts (``rlpipe_capture_routes``, ``rlpipe_take_routes``:
rollout_service/routes.py).

Only JSON-able arguments and replies cross ``collective_rpc`` (vLLM mangles tensors
passed as RPC arguments in multi-process mode): a generation's manifest crosses once, as
JSON, when joining, and is parsed here; an update names its version and the manifest's
hash. The weights arrive over the gloo group, or are read from a checkpoint on disk.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from rollout_service.vllm_compat import (
    after_reload,
    die_with_parent,
    grouped_cpu_lora,
    lora_on_prepacked_int8,
    quick_exit,
    keep_reloaded_kernel_tensors,
    reload_weights,
    rewind_cpu_generators,
)
from weight_sync.manifest import Manifest
from weight_sync.stager import WeightStager

EXTENSION_CLS = "rollout_service.worker_ext.RlpipeWorkerExtension"
# vLLM imports this module in the engine process before it builds the model: the LoRA layers'
# device lookup must be fixed by then (vllm_compat.lora_on_prepacked_int8).
LORA_DEVICE_FIX = lora_on_prepacked_int8()
LORA_GROUPED = grouped_cpu_lora()  # and its CPU kernels, grouped by adapter (vllm_compat.grouped_cpu_lora)

log = logging.getLogger(__name__)


class RlpipeWorkerExtension:
    _rlpipe_stager: WeightStager | None = None
    _rlpipe_job: Future | None = None
    _rlpipe_routes = None  # a RouteCapture once routing replay started

    def rlpipe_init(self, model_dir: str, quant_compat: str = "", quant_profile: str = "", lora_rank: int = 0) -> dict:
        """Called once after start-up: process facts the server checks, the orphan guard,
        the reload workarounds, and the stager for the model's tensor shapes and the
        quantization the engine was started for (every update is checked against both;
        an adapter also against the profile and the engine's largest rank)."""
        import os

        self._rlpipe_pool = ThreadPoolExecutor(1, thread_name_prefix="rlpipe-sync")
        self._rlpipe_stager = WeightStager.for_model(model_dir, quant_compat, quant_profile, lora_rank)
        return {"pid": os.getpid(), "ppid": os.getppid(), "die_with_parent": die_with_parent(),
                "lora_on_prepacked_int8": LORA_DEVICE_FIX, "grouped_cpu_lora": LORA_GROUPED,
                "quick_exit": quick_exit(),
                "keep_reloaded_kernel_tensors": keep_reloaded_kernel_tensors(),
                "rewind_cpu_generators": rewind_cpu_generators(self.model_runner)}

    # -- background work ---------------------------------------------------------------
    def rlpipe_start(self, op: str, *args) -> dict:
        """Start ``join`` (host, port, slot, generation, manifest JSON, timeout),
        ``receive`` (version, manifest hash) or ``read`` (checkpoint directory)."""
        if self._rlpipe_job is not None:
            return {"ok": False, "error": "a weight operation is already running"}
        stager = self._rlpipe_stager
        fn = {"join": self._rlpipe_join, "receive": stager.receive, "read": stager.read}[op]
        self._rlpipe_job = self._rlpipe_pool.submit(fn, *args)
        return {"ok": True}

    def rlpipe_poll(self) -> dict | None:
        """The background operation's result once it is done, else None."""
        job = self._rlpipe_job
        if job is None or not job.done():
            return None
        self._rlpipe_job = None
        try:
            return job.result()
        except Exception as e:  # a bug, not a sync failure: report it instead of killing the engine
            log.exception("weight operation failed")
            return {"ok": False, "error": repr(e)}

    def _rlpipe_join(self, host: str, port: int, slot: str, generation: int, manifest_json: str,
                     timeout_s: float) -> dict:
        return self._rlpipe_stager.join(host, port, slot, generation, Manifest.from_json(manifest_json), timeout_s)

    # -- with generation paused ----------------------------------------------------------
    def rlpipe_apply(self) -> dict:
        """Load the staged weights into the model. An exception here would leave the model
        half-loaded: the engine treats it as fatal and the worker exits instead of serving it."""
        weights = self._rlpipe_stager.take()
        if weights is None:
            return {"ok": False, "error": "nothing staged"}
        t0 = time.perf_counter()
        reload_weights(self.model_runner, weights)
        fixes = after_reload(self.model_runner.get_model())
        if self._rlpipe_routes is not None:
            self._rlpipe_routes.bind()
        return {"ok": True, "load_s": time.perf_counter() - t0, "fixes": fixes}

    def rlpipe_adapter(self, version: int) -> dict:
        """The staged adapter (learner.lora) written to a directory of this version's own
        (weight_sync/adapters.py), for the engine to load with ``add_lora``; the base is not touched."""
        from weight_sync.adapters import write_adapter

        stager = self._rlpipe_stager
        config, tensors = stager.staged_adapter, stager.take()
        if tensors is None or not config:
            return {"ok": False, "error": "no adapter staged"}
        t0 = time.perf_counter()
        return {"ok": True, "adapter_dir": write_adapter(tensors, config, version), "load_s": time.perf_counter() - t0}

    # -- routing replay (rollout_service/routes.py) --------------------------------------
    def rlpipe_capture_routes(self) -> dict:
        """Start recording each token's experts (``rollout.routing_replay``); the model's routing
        shape, or the reason it cannot be recorded (no MoE layers, a monolithic kernel)."""
        from rollout_service.routes import RouteCapture

        try:
            self._rlpipe_routes = RouteCapture(self.model_runner)
        except (ValueError, RuntimeError) as e:
            return {"ok": False, "error": str(e)}
        c = self._rlpipe_routes
        return {"ok": True, "layers": c.layers, "top_k": c.top_k, "experts": c.experts}

    def rlpipe_take_routes(self, request_id: str) -> dict:
        """The rows of our request ``request_id`` by child index, now forgotten here
        (``RouteCapture.take``; rollout_service/routes.py ``decode`` reads them)."""
        return self._rlpipe_routes.take(request_id)

    def rlpipe_leave(self) -> None:
        self._rlpipe_stager.leave()
