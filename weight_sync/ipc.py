"""Weight sync over CUDA IPC (``sync.transport: ipc``): for engines on learner rank 0's GPU,
which NCCL cannot reach (it puts one rank on a GPU). Design: docs/design/vllm-weight-transfer.md.

The generation and each version's header travel over gloo exactly as under nccl
(weight_sync/nccl.py, weight_sync/sender.py); no handshake follows, since vLLM's ``ipc``
engine needs no rendezvous, only to know that updates come packed (:data:`INIT_INFO`).
Then, per version, rank 0 packs one manifest bucket at a time into a GPU buffer (the
gloo path's layout, which is vLLM's packed one: each tensor's bytes after the last) and
sends each member, over gloo, a CUDA IPC handle of that buffer; the member's engine
(vLLM's ``ipc`` engine, driven by weight_sync/device_updates.py) maps it, loads the
bucket from it and acks, and only once every member acked (or failed) is the buffer
packed again. Each member's handles and acks go over its own gloo pair, and each bucket
is one wait per member under the rule every transport follows (weight_sync/stragglers.py):
a member whose load fails, or that has not acked ``sync.straggler_s`` after another
member did, is given up on alone (its pair dropped, and the buffer it may still be reading
retired, so the next bucket is packed into a fresh one); the others go on, and the
generation goes on without it.

Each member gets its own export of the buffer per version (and of a fresh buffer that
replaced a retired one mid-version): torch pairs one export with one importer's release,
and vLLM's importer keeps one mapping across a version's buckets and releases it at
``finish_weight_update``; one export shared by several engines would be released once per
engine and never reclaimed. Until every importer has released it,
torch keeps a freed exported buffer alive, so dropping a generation cannot pull the memory
from under a late member.

The handle is vLLM's ``{gpu uuid: torch's rebuild_cuda_tensor args}``, written as JSON
(:func:`encode_handle`) rather than pickled, so a member never unpickles what the network
brought. There is one GPU uuid in it: an engine whose processes sit on other GPUs (tensor
or pipeline parallel) cannot map it, which is why a launch refuses them under ipc
(rollout_service/engine_args.py).

GPU only: the CUDA calls (:meth:`IpcBroadcast._alloc`, ``_export``, ``_synchronize``) and
vLLM's engine have never run in this project: they are untested without a GPU (vLLM's and
torch's own tests cover them). What rlpipe decides (the transport, the update info per
bucket, the handle's encoding, the sequence of buckets and acks, who is given up on and
when) is tested on CPU (tests/test_ipc_sync.py) with those calls stood in; the rule
deciding who is late is weight_sync/stragglers.py's, the one tested on gloo
(tests/test_weight_sync.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from typing import Awaitable, Callable, Iterable, Mapping

import torch

from weight_sync.manifest import Bucket, Manifest, pack_bucket
from weight_sync.nccl import describe
from weight_sync.stragglers import StragglerRule
from weight_sync.transport import GlooGroup, SyncError

log = logging.getLogger(__name__)

INIT_INFO = {"packed": True}  # vLLM's IPCWeightTransferInitInfo: every bucket travels packed
HANDLE_BYTES = 4096  # an encoded handle's room on the wire (one is well under 1 KiB)
_HANDLE, _ACK = 1003, 1004  # gloo tags, apart from a version's header (0) and nccl's handshake


def bucket_update_info(bucket: Bucket, handle: dict[str, tuple]) -> dict:
    """vLLM's ``IPCWeightTransferUpdateInfo`` (packed) for one bucket in the shared buffer:
    its tensors' names, dtypes and shapes in the manifest's order, each one's bytes (the
    consumer cuts the buffer by these) and the buffer's handle."""
    return {**describe([bucket]), "tensor_sizes": [slot.nbytes for slot in bucket.tensors], "ipc_handles": handle}


# -- the handle on the wire: JSON, each non-JSON value of torch's args tagged ----------------
_CLASSES = {"Tensor": torch.Tensor, "Parameter": torch.nn.Parameter, "TypedStorage": torch.storage.TypedStorage,
            "UntypedStorage": torch.UntypedStorage}


def encode_handle(handle: dict[str, tuple]) -> torch.Tensor:
    """``{gpu uuid: rebuild_cuda_tensor args}`` as a gloo message of :data:`HANDLE_BYTES`."""
    data = json.dumps({uuid: [_encode(a) for a in args] for uuid, args in handle.items()}).encode()
    if len(data) + 8 > HANDLE_BYTES:
        raise ValueError(f"an IPC handle of {len(data)} bytes does not fit {HANDLE_BYTES}")
    out = torch.zeros(HANDLE_BYTES, dtype=torch.uint8)
    out[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    out[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def decode_handle(message: torch.Tensor) -> dict[str, tuple]:
    n = int(message[:8].view(torch.int64).item())
    if not 0 < n <= HANDLE_BYTES - 8:
        raise SyncError(f"an IPC handle message claims {n} bytes")
    data = json.loads(message[8:8 + n].numpy().tobytes())
    return {uuid: tuple(_decode(a) for a in args) for uuid, args in data.items()}


def _encode(value):
    if isinstance(value, bytes):
        return {"bytes": base64.b64encode(value).decode()}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, type):
        name = next((k for k, cls in _CLASSES.items() if cls is value), None)
        if name is None:
            raise ValueError(f"an IPC handle names class {value!r}")
        return {"class": name}
    if isinstance(value, tuple):  # torch.Size, strides
        return {"tuple": list(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"an IPC handle holds {type(value).__name__}")


def _decode(value):
    if not isinstance(value, dict):
        return value
    if "bytes" in value:
        return base64.b64decode(value["bytes"])
    if "dtype" in value:
        dtype = getattr(torch, value["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise SyncError(f"an IPC handle names dtype {value['dtype']!r}")
        return dtype
    if "class" in value:
        if value["class"] not in _CLASSES:
            raise SyncError(f"an IPC handle names class {value['class']!r}")
        return _CLASSES[value["class"]]
    if "tuple" in value:
        return torch.Size(value["tuple"]) if all(isinstance(d, int) for d in value["tuple"]) else tuple(value["tuple"])
    raise SyncError(f"an IPC handle holds {value!r}")


# -- a member's half -------------------------------------------------------------------------
async def receive_version(group: GlooGroup, manifest: Manifest, load: Callable[[dict], Awaitable]) -> None:
    """After a version's header: for each bucket, take the handle, ``load`` the bucket's
    update info (vLLM's ``update_weights``) and ack. A load that raises is acked as failed,
    so the learner leaves this member out at once instead of at its timeout, and raises on."""
    for index, bucket in enumerate(manifest.buckets):
        message = torch.zeros(HANDLE_BYTES, dtype=torch.uint8)
        await asyncio.to_thread(lambda: group.wait(group.recv(message, 0, _HANDLE)))
        try:
            await load(bucket_update_info(bucket, decode_handle(message)))
        except Exception:
            try:
                await asyncio.to_thread(_ack, group, index, False)
            except SyncError:
                pass
            raise
        await asyncio.to_thread(_ack, group, index, True)


def _ack(group: GlooGroup, index: int, ok: bool) -> None:
    """``[bucket index + 1, ok]``: the learner checks it names the bucket it sent (IpcBroadcast._hand)."""
    group.wait(group.send(torch.tensor([index + 1, int(ok)], dtype=torch.int64), 0, _ACK))


# -- the learner's half ----------------------------------------------------------------------
class IpcBroadcast:
    """Learner rank 0's IPC data plane for one generation, the sender's ``device`` seam as
    :class:`~weight_sync.nccl.NcclBroadcast` is. Each member takes its handles and sends its
    acks over its own gloo pair, so each bucket is one wait per member, under the rule gloo's
    own sends follow (weight_sync/stragglers.py :class:`StragglerRule`: the same
    ``sync.straggler_s``, the same abandon). GPU only: its CUDA calls have never run here,
    and what it decides is tested on CPU with them stood in (tests/test_ipc_sync.py)."""

    transport = "ipc"

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.group: GlooGroup | None = None
        self.rule = StragglerRule(timeout_s)
        self.buffer: torch.Tensor | None = None

    def open(self, group: GlooGroup, rule: StragglerRule | None = None) -> dict[int, str]:
        """After the gloo generation formed: nothing to rendezvous (vLLM's ipc engine needs
        none), the group carries the handles and acks; ``rule``: the sender's. No member can
        fail here: ``{}``."""
        self.group, self.rule = group, rule or self.rule
        return {}

    def broadcast(self, manifest: Manifest, tensors: Mapping[str, torch.Tensor],
                  gather: Callable[[list[str]], Mapping[str, torch.Tensor]] | None,
                  ranks: Iterable[int] | None = None) -> dict[int, str]:
        """One version, a bucket at a time through the shared buffer, to ``ranks`` (every
        member by default); returns the members that failed or were given up on (rank ->
        why), who got no bucket after it. Each member gets its own export of the buffer, per
        version and per buffer (see the module docstring)."""
        assert self.group is not None
        failed: dict[int, str] = {}
        members = list(range(1, self.group.world_size) if ranks is None else ranks)
        largest = max((b.nbytes for b in manifest.buckets), default=0)
        if self.buffer is not None and self.buffer.numel() < largest:
            self.buffer = None  # the smaller one goes before the larger one is made
        handles: dict[int, torch.Tensor] = {}  # of the buffer in use, for this version
        for index, bucket in enumerate(manifest.buckets):
            live = [rank for rank in members if rank not in failed]
            if not live:
                break
            if self.buffer is None:  # the first version, or the last buffer retired (see abandon)
                self.buffer, handles = self._alloc(largest), {}
            for rank in live:
                if rank not in handles:
                    handles[rank] = encode_handle(self._export(self.buffer))
            source = gather([slot.name for slot in bucket.tensors]) if gather else tensors
            pack_bucket(bucket, source, self.buffer[:bucket.nbytes])  # the last bucket's acks are in: free to reuse
            del source
            self._synchronize()  # the bytes are in before a member maps them
            waits = {}
            for rank in live:
                try:
                    waits[rank] = self._hand(rank, handles[rank], index)
                except SyncError as e:
                    failed[rank] = f"bucket {index}: {e}"
            self.rule.wait(waits, failed, self.abandon)
        return failed

    def _hand(self, rank: int, handle: torch.Tensor, index: int) -> Callable[[], None]:
        """Send one member bucket ``index``'s handle and post the receive of its ack; returns
        the wait for both, which raises SyncError when the send or the ack failed or the
        ack says the engine could not load the bucket. (Over its own pair, a wait that
        times out closes that member's pair alone.)"""
        group = self.group
        ack = torch.zeros(2, dtype=torch.int64)
        sent = group.waiter(rank, group.send(handle, rank, _HANDLE))
        acked = group.waiter(rank, group.recv(ack, rank, _ACK))

        def wait() -> None:
            try:
                sent()
                acked()
            except SyncError as e:
                raise SyncError(f"bucket {index}: {e}") from e
            got, ok = ack.tolist()
            if got != index + 1:
                raise SyncError(f"bucket {index}: acked bucket {got - 1}")
            if not ok:
                raise SyncError(f"bucket {index}: the engine failed to load it")

        return wait

    def abandon(self, rank: int) -> None:
        """Give up on one member: its pair leaves the group, and the buffer it may still be
        reading is retired (the next bucket goes into a fresh one, exported anew to each
        member left), so nothing is packed under a late member's load. torch keeps the
        retired buffer until its importers let go of it."""
        if self.group is not None:
            self.group.abandon(rank)
        self.buffer = None

    # -- the CUDA calls, the only part the CPU tests replace -------------------------------
    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))

    def _export(self, buffer: torch.Tensor) -> dict[str, tuple]:
        """A fresh export of ``buffer`` as vLLM's ipc engine takes it: ``{gpu uuid: args}``."""
        from torch.multiprocessing.reductions import reduce_tensor

        uuid = str(torch.cuda.get_device_properties(buffer.device.index).uuid)
        return {uuid: reduce_tensor(buffer)[1]}

    def _synchronize(self) -> None:
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        self.group = self.buffer = None  # torch keeps an exported buffer until its importers let go
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()


# -- the seam weight_sync/device_plane.py reads (this transport's row names this module) -----
def broadcast(bucket_bytes: int, timeout_s: float) -> IpcBroadcast:
    """The learner's half: one bucket at a time through the manifest's bucket sizes, so
    ``bucket_bytes`` is already in the manifest."""
    return IpcBroadcast(timeout_s)


async def engine_init_info(group: GlooGroup, engine_ranks: int) -> dict:
    """The engine's init info: no rendezvous, only that every bucket comes packed."""
    return dict(INIT_INFO)


engine_receive = receive_version  # each bucket's handle taken, loaded and acked over gloo
