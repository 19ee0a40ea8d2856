"""Weight sync over NCCL (``sync.transport: nccl``): the GPU data plane, with gloo as its
control plane. Design: docs/design/vllm-weight-transfer.md.

A generation forms exactly as under gloo (weight_sync/sender.py): candidates check in on
the learner's gated store, are admitted with a rank, and build the small gloo group. Over
that authenticated group the learner then tells each member where it stands in an NCCL
group (:func:`learner_handshake`, :func:`worker_handshake`): its first rank (an engine
over tensor/pipeline parallel ranks takes one rank per process), the world size, the
packed-buffer geometry both ends must share, and an ``ncclUniqueId`` the learner minted,
so no unauthenticated store is opened for NCCL's bootstrap. Every version then starts
with the gloo header (version, manifest hash), which fails fast on a dead member, and
travels as one packed NCCL broadcast from the learner's GPU to every engine rank, each
of which loads whole tensors and narrows them to its shard (vLLM's weight loaders).

The worker side is vLLM's own ``nccl`` weight-transfer engine, driven through
``AsyncLLM``'s lifecycle (weight_sync/device_updates.py); the learner side is vLLM's
``uid_init_process_group`` and ``packed_nccl_broadcast_producer``
(:class:`NcclBroadcast`). What rlpipe decides (the handshake, the ranks, which tensors
travel in which order under which dtype and shape) is tested on CPU
(tests/test_nccl_sync.py). The NCCL calls themselves need CUDA and have never run in this
project: they are vLLM's code, which its authors test. ``sync.transport: ipc``
(weight_sync/ipc.py) shares this module's update-info helpers; which transport a run uses
and each one's two halves are weight_sync/transport_choice.py's.
"""

from __future__ import annotations

import base64
import logging
import threading
from typing import Callable, Iterator, Mapping

import torch

from weight_sync.manifest import Manifest
from weight_sync.transport import GlooGroup, SyncError

log = logging.getLogger(__name__)

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
NUM_BUFFERS = 2  # packed broadcast buffers in flight (vLLM's default), on both ends
_ASK, _ANSWER = 1001, 1002  # gloo tags of the handshake, apart from a version's (0 and up)


def rank_offsets(engine_ranks: list[int]) -> tuple[list[int], int]:
    """Each member's first NCCL rank and the world size: the learner is rank 0, and an engine
    of ``k`` processes (tensor x pipeline parallel) takes ``k`` consecutive ranks, since
    vLLM's nccl engine joins every one of them (rank = offset + its rank in the engine)."""
    offsets, nxt = [], 1
    for k in engine_ranks:
        if k < 1:
            raise SyncError(f"an engine reported {k} processes")
        offsets.append(nxt)
        nxt += k
    return offsets, nxt


def learner_handshake(group: GlooGroup, unique_id: bytes, buffer_bytes: int) -> int:
    """Rank 0's half, after a generation formed: learn each member's engine size, answer
    each with its NCCL place; returns the NCCL world size. Raises SyncError (gloo's
    timeout) when a member does not take part."""
    if len(unique_id) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, not {len(unique_id)}")
    asks = {rank: torch.zeros(1, dtype=torch.int64) for rank in range(1, group.world_size)}
    for rank, work in [(rank, group.recv(t, rank, _ASK)) for rank, t in asks.items()]:
        group.wait(work)
    offsets, world = rank_offsets([int(t.item()) for t in asks.values()])
    uid = torch.frombuffer(bytearray(unique_id), dtype=torch.uint8)
    works = []
    for rank, offset in zip(asks, offsets):
        head = torch.tensor([offset, world, buffer_bytes, NUM_BUFFERS], dtype=torch.int64).view(torch.uint8)
        works.append(group.send(torch.cat([head, uid]), rank, _ANSWER))
    for work in works:
        group.wait(work)
    return world


def worker_handshake(group: GlooGroup, engine_ranks: int) -> dict:
    """A member's half: report its engine's process count, and return the init info of
    vLLM's nccl engine (``NCCLWeightTransferInitInfo``'s fields) the learner answered."""
    group.wait(group.send(torch.tensor([engine_ranks], dtype=torch.int64), 0, _ASK))
    answer = torch.zeros(4 * 8 + UNIQUE_ID_BYTES, dtype=torch.uint8)
    group.wait(group.recv(answer, 0, _ANSWER))
    offset, world, buffer_bytes, num_buffers = answer[:32].view(torch.int64).tolist()
    return {"rank_offset": offset, "world_size": world,
            "nccl_unique_id_b64": base64.b64encode(answer[32:].numpy().tobytes()).decode(),
            "packed": True, "packed_buffer_size_bytes": buffer_bytes, "packed_num_buffers": num_buffers}


def update_info(manifest: Manifest) -> dict:
    """vLLM's ``NCCLWeightTransferUpdateInfo`` for a version: every tensor's name, dtype and
    shape in the order :func:`wire_tensors` sends them (the receiver cuts the packed
    buffers by these, so they must describe exactly the bytes sent)."""
    return describe(manifest.buckets)


def describe(buckets) -> dict:
    """The names, dtype names and shapes of these buckets' tensors, in order: what every
    vLLM update info starts with (the nccl one for a whole version, the ipc one per bucket)."""
    slots = [(slot, bucket.dtype) for bucket in buckets for slot in bucket.tensors]
    return {"names": [s.name for s, _ in slots], "dtype_names": [d for _, d in slots],
            "shapes": [list(s.shape) for s, _ in slots]}


def wire_tensors(manifest: Manifest, tensors: Mapping[str, torch.Tensor], device: torch.device | str,
                 gather: Callable[[list[str]], Mapping[str, torch.Tensor]] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a version, in the manifest's order and dtypes, on ``device``. A sharded
    learner's are gathered one bucket at a time (``gather``), as the gloo path packs them."""
    for bucket in manifest.buckets:
        source = gather([slot.name for slot in bucket.tensors]) if gather else tensors
        dtype = getattr(torch, bucket.dtype)
        for slot in bucket.tensors:
            yield slot.name, source[slot.name].detach().to(device=device, dtype=dtype).contiguous()
        del source


class NcclBroadcast:
    """Learner rank 0's NCCL data plane for one generation (the sender's ``device`` seam,
    as weight_sync/ipc.py's ``IpcBroadcast`` is). GPU only: never run here."""

    transport = "nccl"

    def __init__(self, buffer_bytes: int, timeout_s: float):
        self.buffer_bytes, self.timeout_s = buffer_bytes, timeout_s
        self.comm = None

    def open(self, group: GlooGroup) -> None:
        """After the gloo generation formed: the handshake, then NCCL's init, which every
        rank enters at once; a member that never does fails it within the sync timeout."""
        unique_id = self._unique_id()
        world = learner_handshake(group, unique_id, self.buffer_bytes)
        self.comm = _within(self.timeout_s, "NCCL init", lambda: self._init(unique_id, world))

    def broadcast(self, manifest: Manifest, tensors: Mapping[str, torch.Tensor],
                  gather: Callable[[list[str]], Mapping[str, torch.Tensor]] | None) -> dict[int, str]:
        """One version, in the manifest's order and dtypes, from this rank's GPU to every
        engine rank. It reaches all or raises, so no member failed alone: ``{}``."""
        device = self._device()
        _within(self.timeout_s, "NCCL broadcast", lambda: self._send(wire_tensors(manifest, tensors, device, gather)))
        return {}

    # -- the CUDA calls (vLLM's), the only part the CPU tests replace -----------------------
    def _unique_id(self) -> bytes:
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

        return bytes(NCCLLibrary().ncclGetUniqueId().internal)

    def _init(self, unique_id: bytes, world: int):
        from vllm.distributed.weight_transfer.nccl_common import uid_init_process_group

        return uid_init_process_group(unique_id, 0, world, torch.accelerator.current_device_index())

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.accelerator.current_device_index())

    def _send(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        packed_nccl_broadcast_producer(tensors, self.comm, 0, lambda item: item[1], self.buffer_bytes, NUM_BUFFERS)

    def close(self) -> None:
        if self.comm is not None:
            try:
                self.comm.destroy()  # ncclCommAbort: unblocks a rank stuck on a dead peer
            except Exception as e:
                log.warning("closing the NCCL group: %r", e)
        self.comm = None


def _within(timeout_s: float, what: str, fn: Callable):
    """Run ``fn`` (an NCCL call, which has no timeout of its own) and raise SyncError if it
    has not returned in ``timeout_s``; the caller then aborts the communicator."""
    result, error = [], []

    def run():
        try:
            result.append(fn())
        except BaseException as e:
            error.append(e)

    thread = threading.Thread(target=run, name=f"rlpipe-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise SyncError(f"{what} did not finish within {timeout_s:.0f} s (a member gone?)")
    if error:
        raise SyncError(f"{what} failed: {error[0]!r}") from error[0]
    return result[0] if result else None
