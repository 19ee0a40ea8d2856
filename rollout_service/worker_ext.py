"""Methods added to vLLM's worker (``worker_extension_cls``) for weight sync.

They run inside the engine's worker process, where the model lives, and are called from
the rollout server through ``collective_rpc``. Only JSON-able arguments cross that call
(vLLM mangles tensors passed as RPC arguments in multi-process mode); the weights
themselves arrive over the gloo group, or are read from a checkpoint on disk.

Everything slow runs in a background thread of the engine process, *staging* the new
weights while the engine keeps generating: checking in to a sync generation, receiving
the buckets, reading a checkpoint (``rlpipe_start`` + ``rlpipe_poll``). Only
``rlpipe_apply``, which copies the staged tensors into the model, runs with generation
paused. Staged weights are complete or absent, so a failed transfer leaves the model
as it was.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from rollout_service.vllm_compat import (
    after_reload,
    die_with_parent,
    keep_reloaded_kernel_tensors,
    reload_weights,
    rewind_cpu_generators,
)
from weight_sync.manifest import Manifest, incompatibility, shape_mismatch
from weight_sync.names import checkpoint_shapes
from weight_sync.receiver import WeightReceiver
from weight_sync.transport import LeftOut, SyncError

EXTENSION_CLS = "rollout_service.worker_ext.RlpipeWorkerExtension"

log = logging.getLogger(__name__)


class RlpipeWorkerExtension:
    _rlpipe_receiver: WeightReceiver | None = None
    _rlpipe_job: Future | None = None
    _rlpipe_staged: list | None = None
    _rlpipe_shapes: dict[str, tuple[int, ...]] = {}
    _rlpipe_compat: str = ""

    def rlpipe_init(self, model_dir: str, quant_compat: str = "") -> dict:
        """Called once after start-up: process facts the server checks, the orphan guard,
        the reload workarounds, the model's tensor shapes and the quantization the engine
        was started for (every update is checked against both)."""
        import os

        self._rlpipe_pool = ThreadPoolExecutor(1, thread_name_prefix="rlpipe-sync")
        self._rlpipe_shapes = checkpoint_shapes(model_dir)
        self._rlpipe_compat = quant_compat
        return {"pid": os.getpid(), "ppid": os.getppid(), "die_with_parent": die_with_parent(),
                "keep_reloaded_kernel_tensors": keep_reloaded_kernel_tensors(),
                "rewind_cpu_generators": rewind_cpu_generators(self.model_runner)}

    # -- background work ---------------------------------------------------------------
    def rlpipe_start(self, op: str, *args) -> dict:
        if self._rlpipe_job is not None:
            return {"ok": False, "error": "a weight operation is already running"}
        fn = {"join": self._rlpipe_join, "receive": self._rlpipe_receive, "read": self._rlpipe_read}[op]
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

    def _rlpipe_join(self, host: str, port: int, candidate: int, generation: int, manifest_json: str,
                     timeout_s: float) -> dict:
        self.rlpipe_leave()
        manifest = Manifest.from_json(manifest_json)
        refuse = incompatibility(manifest, self._rlpipe_shapes, self._rlpipe_compat)
        try:
            self._rlpipe_receiver = WeightReceiver.join(host, port, candidate, generation, manifest, timeout_s, refuse)
        except LeftOut as e:
            return {"ok": False, "left_out": True, "refused": refuse is not None, "error": str(e)}
        except SyncError as e:
            return {"ok": False, "error": str(e)}
        return {"ok": True}

    def _rlpipe_receive(self, version: int, manifest_json: str) -> dict:
        if self._rlpipe_receiver is None:
            return {"ok": False, "error": "not in a sync generation"}
        t0 = time.perf_counter()
        try:
            self._rlpipe_staged = self._rlpipe_receiver.receive(version, Manifest.from_json(manifest_json))
        except SyncError as e:
            self.rlpipe_leave()
            return {"ok": False, "error": str(e)}
        return {"ok": True, "transfer_s": time.perf_counter() - t0}

    def _rlpipe_read(self, model_dir: str) -> dict:
        """Stage a checkpoint's weights (all read before any is loaded)."""
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        try:
            weights = {}
            for f in sorted(Path(model_dir).glob("*.safetensors")):
                weights.update(load_file(f))
        except OSError as e:  # e.g. pruned by the learner while we read it
            return {"ok": False, "error": f"reading {model_dir}: {e}"}
        mismatch = shape_mismatch(((n, tuple(t.shape)) for n, t in weights.items()), self._rlpipe_shapes,
                                  f"checkpoint {model_dir}")
        if mismatch:
            return {"ok": False, "error": mismatch}
        self._rlpipe_staged = list(weights.items())
        return {"ok": True, "read_s": time.perf_counter() - t0}

    # -- with generation paused ----------------------------------------------------------
    def rlpipe_apply(self) -> dict:
        """Load the staged weights into the model. An exception here would leave the model
        half-loaded: the server treats it as fatal and exits instead of serving it."""
        if self._rlpipe_staged is None:
            return {"ok": False, "error": "nothing staged"}
        t0 = time.perf_counter()
        weights, self._rlpipe_staged = self._rlpipe_staged, None
        reload_weights(self.model_runner, weights)
        fixes = after_reload(self.model_runner.get_model())
        return {"ok": True, "load_s": time.perf_counter() - t0, "fixes": fixes}

    def rlpipe_leave(self) -> None:
        if self._rlpipe_receiver is not None:
            self._rlpipe_receiver.close()
        self._rlpipe_receiver = None
        self._rlpipe_staged = None
