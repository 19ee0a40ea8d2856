"""A rollout engine's weight updates over vLLM's own weight-transfer engines: ``nccl``
(``sync.transport: nccl``; the protocol is in weight_sync/nccl.py) and ``ipc`` (an engine
on learner rank 0's GPU; weight_sync/ipc.py). One lifecycle for both; only the engine's
init info and how a version's bytes arrive differ (:meth:`DeviceUpdates._init_info`,
:meth:`DeviceUpdates._receive`).

The gloo side runs here, in the rollout server's process, not in the engine's worker as
under gloo: it only checks in, shakes hands (nccl) and takes each version's header (and,
under ipc, each bucket's handle), and an engine over several processes (tensor or
pipeline parallel, nccl only) must join once, as one member. vLLM's ``AsyncLLM`` then
fans the init and every update out to each of its processes, which under nccl get their
own rank (offset + their rank in the engine) and load whole tensors narrowed to their shard.

Unlike gloo's staged updates, generation is paused for the whole transfer (vLLM's engines
load chunk by chunk as they arrive), and a transfer that fails part-way leaves a mix of
old and new layers: that is :class:`WeightsCorrupted`, and the worker exits rather than
serve it (rollout_service/worker.py). Catching up from a checkpoint stays on the engine's
staged path (rollout_service/worker_ext.py).

GPU only: this module needs CUDA and has never run in this project. What it decides is
tested on CPU (tests/test_nccl_sync.py, tests/test_ipc_sync.py); the calls are vLLM's,
which its authors test.
"""

from __future__ import annotations

import asyncio
import logging

from rollout_service.engine_args import engine_processes
from weight_sync.follower import SyncOutcome
from weight_sync.ipc import INIT_INFO, receive_version
from weight_sync.manifest import Manifest, incompatibility
from weight_sync.names import checkpoint_shapes
from weight_sync.nccl import update_info, worker_handshake
from weight_sync.receiver import expect_header, join_group
from weight_sync.transport import LeftOut, SyncError

log = logging.getLogger(__name__)


class DeviceUpdates:
    def __init__(self, engine, transport: str):
        self.engine = engine  # the RolloutEngine: its AsyncLLM, and its paused apply
        self.transport = transport  # nccl or ipc: vLLM's weight_transfer_config backend
        self.shapes = checkpoint_shapes(engine.model_dir)
        self.group = self.relay = None
        self.manifest: Manifest | None = None
        self.initialized = False

    async def join(self, host: str, port: int, slot: str, generation: int, manifest: Manifest,
                   timeout_s: float) -> SyncOutcome:
        """Check in (or refuse), take the init info, and init vLLM's transfer engine."""
        await self.leave()
        refuse = incompatibility(manifest, self.shapes, self.engine.profile.compat, self.transport)
        try:
            self.group, self.relay = await asyncio.to_thread(join_group, host, port, slot, generation, timeout_s,
                                                             refuse)
            info = await self._init_info()
        except LeftOut as e:
            return SyncOutcome.failed(str(e), refused=refuse is not None)
        except SyncError as e:
            await self.leave()
            return SyncOutcome.failed(str(e))
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        try:
            await asyncio.wait_for(self.engine.llm.init_weight_transfer_engine(
                WeightTransferInitRequest(init_info=info)), timeout_s)
        except Exception as e:  # the learner's init failed or timed out: it re-forms without us
            await self.leave()
            return SyncOutcome.failed(f"{self.transport} init: {e!r}")
        self.initialized, self.manifest = True, manifest
        return SyncOutcome(True)

    async def _init_info(self) -> dict:
        """vLLM's init info: nccl's place in the learner's NCCL group, from the handshake;
        ipc's needs no rendezvous."""
        if self.transport == "ipc":
            return dict(INIT_INFO)
        return await asyncio.to_thread(worker_handshake, self.group, engine_processes(self.engine.cfg.engine))

    async def update(self, version: int, manifest: Manifest) -> SyncOutcome:
        """Take the version's header over gloo, then receive and load it with generation
        paused."""
        if self.group is None or self.manifest is None or manifest.hash != self.manifest.hash:
            return SyncOutcome.failed("not in this generation")
        try:
            await asyncio.to_thread(expect_header, self.group, version, manifest)
        except SyncError as e:
            await self.leave()
            return SyncOutcome.failed(str(e))
        llm = self.engine.llm

        async def transfer() -> dict:
            await llm.start_weight_update()
            await self._receive(manifest)
            await llm.finish_weight_update(weight_version=str(version))
            return {"ok": True}

        async with self.engine._update_lock:
            return SyncOutcome.of(await self.engine._apply(version, "learner", transfer))

    async def _receive(self, manifest: Manifest) -> None:
        """The version's bytes into the engine: nccl's in one packed broadcast described by
        the manifest; ipc's a bucket at a time, each handle taken and acked over gloo."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        async def load(info: dict) -> None:
            await self.engine.llm.update_weights(WeightTransferUpdateRequest(update_info=info))

        if self.transport == "ipc":
            await receive_version(self.group, manifest, load)
        else:
            await load(update_info(manifest))

    async def leave(self) -> None:
        if self.initialized:
            try:
                await self.engine.llm.shutdown_weight_transfer_engine()
            except Exception as e:
                log.warning("leaving the %s transfer: %r", self.transport, e)
            self.initialized = False
        if self.group is not None:
            self.group.close()
        if self.relay is not None:
            self.relay.close()
        self.group = self.relay = self.manifest = None
