"""Methods added to vLLM's worker (``worker_extension_cls``) for weight sync.

They run inside the engine's worker process, where the model lives, and are called from
the rollout server through ``collective_rpc``. Only JSON-able arguments cross that call
(vLLM mangles tensors passed as RPC arguments in multi-process mode); the weights
themselves arrive over the gloo group.
"""

from __future__ import annotations

import time

from rollout_service.vllm_compat import after_reload, die_with_parent
from weight_sync.manifest import Manifest
from weight_sync.receiver import WeightReceiver
from weight_sync.transport import SyncError

EXTENSION_CLS = "rollout_service.worker_ext.RlpipeWorkerExtension"


class RlpipeWorkerExtension:
    _rlpipe_receiver: WeightReceiver | None = None

    def rlpipe_init(self) -> dict:
        """Called once after start-up: process facts the server checks, and the orphan guard."""
        import os

        return {"pid": os.getpid(), "ppid": os.getppid(), "die_with_parent": die_with_parent()}

    def rlpipe_join(self, host: str, port: int, rank: int, world_size: int, generation: int,
                    timeout_s: float, join_timeout_s: float) -> dict:
        self.rlpipe_leave()
        try:
            self._rlpipe_receiver = WeightReceiver.join(host, port, rank, world_size, generation, timeout_s, join_timeout_s)
        except SyncError as e:
            return {"ok": False, "error": str(e)}
        return {"ok": True}

    def rlpipe_update(self, version: int, manifest_json: str) -> dict:
        """Receive every bucket, then load them all; on any failure nothing is loaded."""
        if self._rlpipe_receiver is None:
            return {"ok": False, "error": "not in a sync generation"}
        t0 = time.perf_counter()
        try:
            weights = self._rlpipe_receiver.receive(version, Manifest.from_json(manifest_json))
        except SyncError as e:
            self.rlpipe_leave()
            return {"ok": False, "error": str(e)}
        t1 = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=weights)
        fixes = after_reload(self.model_runner.get_model())
        t2 = time.perf_counter()
        return {"ok": True, "transfer_s": t1 - t0, "load_s": t2 - t1, "fixes": fixes}

    def rlpipe_leave(self) -> None:
        if self._rlpipe_receiver is not None:
            self._rlpipe_receiver.close()
        self._rlpipe_receiver = None
