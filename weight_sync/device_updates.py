"""A rollout engine's side of the transports over vLLM's own weight-transfer engines:
``nccl`` (``sync.transport: nccl``; the protocol is in weight_sync/nccl.py) and ``ipc`` (an
engine on learner rank 0's GPU; weight_sync/ipc.py), as weight_sync/stager.py is gloo's.
One lifecycle for both; only the engine's init info and how a version's bytes arrive
differ, and those come from the transport's own module (weight_sync/device_plane.py's
``engine_init_info`` and ``engine_receive``), so nothing here names a transport.

The gloo side runs in the rollout server's process, not in the engine's worker as under
gloo: it only checks in, shakes hands (nccl) and takes each version's header (and, under
ipc, each bucket's handle), and an engine over several processes (tensor or pipeline
parallel, nccl only) must join once, as one member. vLLM's ``AsyncLLM`` then fans the
init and every update out to each of its processes, which under nccl get their own rank
(offset + their rank in the engine) and load whole tensors narrowed to their shard.

This module decides everything and imports no vLLM: the engine's weight-transfer engine
is a :class:`TransferEngine`, whose one binding to vLLM's ``AsyncLLM`` is
rollout_service/transfer_engine.py (``VllmTransferEngine``); the tests stand it in.
:func:`weight_sync.transport_choice.receiver_for` makes one for a run's transport.

The rollout engine (rollout_service/engine.py) drives it one way, as it drives the staged
path under gloo: it joins with the manifest the follower parsed, takes each version's
header while generating (:meth:`DeviceUpdates.expect`), then pauses generation for
:meth:`DeviceUpdates.transfer`. Unlike gloo's staged updates, generation is paused for
the whole transfer (vLLM's engines load chunk by chunk as they arrive), and a transfer
that fails part-way leaves a mix of old and new layers: that is the engine's
``WeightsCorrupted``, and the worker exits rather than serve it (rollout_service/worker.py).
Catching up from a checkpoint stays on the engine's staged path (weight_sync/stager.py).

GPU only in production: vLLM's transfer engines need CUDA and have never run in this
project. What this module decides is tested on CPU with the transfer engine stood in
(tests/test_nccl_sync.py, tests/test_ipc_sync.py); the calls are vLLM's, which its
authors test.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from weight_sync.device_plane import plane
from weight_sync.follower import SyncOutcome
from weight_sync.manifest import Manifest, incompatibility, refusal
from weight_sync.receiver import expect_header, join_group
from weight_sync.transport import LeftOut, SyncError

log = logging.getLogger(__name__)


class TransferEngine(Protocol):
    """An engine's weight-transfer engine (vLLM's ``AsyncLLM`` lifecycle of it): what
    :class:`DeviceUpdates` calls, and nothing else."""

    async def init(self, info: dict) -> None:
        """Init the transfer engine with the transport's init info."""

    async def start(self) -> None:
        """A version begins (generation is paused)."""

    async def load(self, info: dict) -> None:
        """Receive and load the tensors one update info describes."""

    async def finish(self, version: int) -> None:
        """The version is whole."""

    async def shutdown(self) -> None:
        """Shut the transfer engine down (the generation is left)."""


class DeviceUpdates:
    def __init__(self, engine: TransferEngine, transport: str, shapes: dict[str, tuple[int, ...]],
                 quant_compat: str, engine_ranks: int):
        self.engine = engine  # the engine's transfer engine: its lifecycle
        self.transport = transport  # a row of rlpipe/transports.py with an engine_backend
        self.plane = plane(transport)  # its module: the engine's init info and receive
        self.shapes, self.quant_compat = shapes, quant_compat  # what a manifest must fit
        self.engine_ranks = engine_ranks  # the engine's processes, each a rank of the NCCL group
        self.group = self.relay = None
        self.manifest: Manifest | None = None
        self.initialized = False

    async def join(self, host: str, port: int, slot: str, generation: int, manifest: Manifest,
                   timeout_s: float) -> SyncOutcome:
        """Check in (or refuse), take the init info, and init the transfer engine."""
        await self.leave()
        refuse = incompatibility(manifest, self.shapes, self.quant_compat, self.transport)
        try:
            self.group, self.relay = await asyncio.to_thread(join_group, host, port, slot, generation, timeout_s,
                                                             None if refuse is None else refusal(manifest, refuse))
            info = await self.plane.engine_init_info(self.group, self.engine_ranks)
        except LeftOut as e:
            return SyncOutcome.failed(refuse or str(e), refused=refuse is not None)
        except SyncError as e:
            await self.leave()
            return SyncOutcome.failed(str(e))
        try:
            await asyncio.wait_for(self.engine.init(info), timeout_s)
        except Exception as e:  # the learner's init failed or timed out: it re-forms without us
            await self.leave()
            return SyncOutcome.failed(f"{self.transport} init: {e!r}")
        self.initialized, self.manifest = True, manifest
        return SyncOutcome(True)

    async def expect(self, version: int, manifest: Manifest) -> str | None:
        """Take ``version``'s header over gloo, while generating; why not (the generation
        is then left), or None."""
        if self.group is None or self.manifest is None or manifest.hash != self.manifest.hash:
            return "not in this generation"
        try:
            await asyncio.to_thread(expect_header, self.group, version, manifest)
        except SyncError as e:
            await self.leave()
            return str(e)
        return None

    async def transfer(self, version: int, manifest: Manifest) -> dict:
        """Receive and load ``version`` (the engine has paused generation): an exception
        here may leave a mix of old and new layers."""
        await self.engine.start()
        await self.plane.engine_receive(self.group, manifest, self.engine.load)
        await self.engine.finish(version)
        return {"ok": True}

    async def leave(self) -> None:
        if self.initialized:
            try:
                await self.engine.shutdown()
            except Exception as e:
                log.warning("leaving the %s transfer: %r", self.transport, e)
            self.initialized = False
        if self.group is not None:
            self.group.close()
        if self.relay is not None:
            self.relay.close()
        self.group = self.relay = self.manifest = None
