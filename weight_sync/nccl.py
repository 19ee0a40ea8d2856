"""Weight sync over NCCL (``sync.transport: nccl``): the GPU data plane, with gloo as its
control plane. Design: docs/design/vllm-weight-transfer.md.

A generation forms exactly as under gloo (weight_sync/sender.py): candidates check in on
the learner's gated store, are admitted with a rank, and build the small gloo group. Over
that authenticated group the learner then tells each member where it stands in an NCCL
communicator of its own with the learner (:func:`learner_handshake`,
:func:`worker_handshake`): a *pair*, as each member has a gloo pair, in which the learner
is rank 0 and the member's engine processes (tensor/pipeline parallel) ranks 1..k, the
packed-buffer geometry both ends must share, and an ``ncclUniqueId`` the learner minted for
that pair alone, so no unauthenticated store is opened for NCCL's bootstrap. Every version
then starts with the gloo header (version, manifest hash), which fails fast on a dead
member, and travels packed as vLLM packs it (its ``pack_tensors``) over each member's own
communicator, to every rank of that engine, each of which loads whole tensors and narrows
them to its shard (vLLM's weight loaders).

One communicator per member, not one of everyone: one NCCL broadcast reaches every member
or none, so a member that hung cost every member the version. A pair's calls run in a
thread of its own (:class:`NcclPair`: NCCL has no timeouts), and each chunk is one wait per
member under the rule every transport follows (weight_sync/stragglers.py): a member still
receiving ``sync.straggler_s`` after another member had the chunk is given up on alone,
its communicator aborted (``ncclCommAbort``, which ends its stuck kernel), and the others
get the version. The price: the learner's GPU sends each version once per member (as gloo
does), where one broadcast relays it along the ranks.

The worker side is vLLM's own ``nccl`` weight-transfer engine, driven through
``AsyncLLM``'s lifecycle (weight_sync/device_updates.py), unchanged by the pairs: it joins
the communicator the handshake names. The learner side is vLLM's
``uid_init_process_group``, ``pack_tensors`` and ``PyNcclCommunicator.broadcast`` on a
stream of each pair's own (:class:`NcclBroadcast`). What rlpipe decides (the handshake,
the pairs, which tensors travel in which order under which dtype and shape, the chunks,
who is given up on and when) is tested on CPU (tests/test_nccl_sync.py) with the CUDA calls
stood in, and the rule deciding who is late is the one tested on gloo
(tests/test_weight_sync.py). The CUDA calls themselves (:meth:`NcclBroadcast._unique_id`,
``_init``, ``_ready``, ``_send``, ``_device``) have never run in this project and are
untested without a GPU: they are thin calls into vLLM's and torch's code, which their
authors test. Untested too, for want of a GPU: that a hung pair's kernel, until its abort,
holds up no other pair's (it runs on its own stream; a device-wide synchronize would wait
for it). ``sync.transport: ipc`` (weight_sync/ipc.py) shares this module's update-info
helpers; which transport a run uses is weight_sync/transport_choice.py's, and the two
halves reach this module through its row of rlpipe/transports.py (weight_sync/device_plane.py).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import queue
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from typing import Awaitable, Callable, Iterable, Iterator, Mapping

import torch

from weight_sync.manifest import Manifest
from weight_sync.stragglers import StragglerRule
from weight_sync.transport import GlooGroup, SyncError

log = logging.getLogger(__name__)

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
NUM_BUFFERS = 2  # packed broadcast buffers in flight (vLLM's default), on both ends
_ASK, _ANSWER = 1001, 1002  # gloo tags of the handshake, apart from a version's (0 and up)


def pair_world(engine_ranks: int) -> int:
    """The size of one member's communicator: the learner (rank 0) and the engine's
    ``engine_ranks`` processes (tensor x pipeline parallel), ranks 1..k, since vLLM's nccl
    engine joins every one of them (rank = offset 1 + its rank in the engine)."""
    if engine_ranks < 1:
        raise SyncError(f"an engine reported {engine_ranks} processes")
    return 1 + engine_ranks


def learner_handshake(group: GlooGroup, unique_ids: Mapping[int, bytes], buffer_bytes: int,
                      rule: StragglerRule | None = None, failed: dict[int, str] | None = None) -> dict[int, int]:
    """Rank 0's half, after a generation formed, with every member at once: :func:`shake_hands`
    with each (``unique_ids``: rank -> the id minted for its communicator), one wait per
    member under ``rule`` (by default :func:`joining` the group's timeout), so a member that
    does not take part delays no other's answer. Returns rank -> its communicator's size for
    the members that took part, each other one in ``failed`` (rank -> why)."""
    for unique_id in unique_ids.values():
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, not {len(unique_id)}")
    rule = rule or joining(group.timeout.total_seconds())
    failed = {} if failed is None else failed
    worlds = {}

    def shake(rank: int) -> None:
        worlds[rank] = shake_hands(group, rank, unique_ids[rank], buffer_bytes)

    rule.wait({rank: partial(shake, rank) for rank in unique_ids}, failed, group.abandon)
    return {rank: worlds[rank] for rank in sorted(worlds) if rank not in failed}


def shake_hands(group: GlooGroup, rank: int, unique_id: bytes, buffer_bytes: int) -> int:
    """Rank 0's half with one member: learn its engine's size, and answer with its place in
    its own communicator (offset 1, its size, ``unique_id``) and the buffer geometry; returns
    the communicator's size. Raises SyncError (gloo's timeout, over the member's pair alone)
    when the member does not take part."""
    if len(unique_id) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, not {len(unique_id)}")
    ask = torch.zeros(1, dtype=torch.int64)
    group.waiter(rank, group.recv(ask, rank, _ASK))()
    world = pair_world(int(ask.item()))
    head = torch.tensor([1, world, buffer_bytes, NUM_BUFFERS], dtype=torch.int64).view(torch.uint8)
    uid = torch.frombuffer(bytearray(unique_id), dtype=torch.uint8)
    group.waiter(rank, group.send(torch.cat([head, uid]), rank, _ANSWER))()
    return world


def joining(timeout_s: float) -> StragglerRule:
    """The rule for joining (the handshake, NCCL's init): joining is not a transfer, so no
    member is cut off for lagging another, and each has the whole ``timeout_s``, as it has
    to check in; one that has not joined by then is given up on alone."""
    return StragglerRule(timeout_s, timeout_s)


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


class NcclPair:
    """One member's NCCL communicator with the learner, and the thread its calls run in,
    in order: an NCCL call has no timeout, so one that blocks on a member that hung blocks
    that member's thread alone, and the caller waits on each call's future (with the rule's
    deadline, weight_sync/stragglers.py). :meth:`close` aborts the communicator, which ends
    a call stuck in it; an init stuck on a member that never joins cannot be aborted (there
    is no communicator yet) and stays in its daemon thread until it returns."""

    def __init__(self, rank: int):
        self.rank = rank
        self.comm = self.stream = None  # the stream: CUDA's, made at the first send
        self.gone = False
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=f"rlpipe-nccl-pair-{rank}", daemon=True).start()

    def run(self, fn: Callable, *args) -> Future:
        """``fn(*args)`` in this pair's thread, after the calls before it."""
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if self.gone or not future.set_running_or_notify_cancel():
                future.cancel()
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:
                future.set_exception(e)

    def join(self, init: Callable[[], object]) -> None:
        """Make the communicator (``init()``: NCCL's init, which blocks until the member's
        ranks are in); one made after the pair was given up on is aborted at once."""
        comm = init()
        with self._lock:
            if not self.gone:
                self.comm = comm
                return
        _destroy(comm)

    def close(self) -> None:
        """Abort the communicator (ncclCommAbort: a broadcast stuck on this member ends) and
        let the thread go; calls still queued are cancelled."""
        with self._lock:
            self.gone, comm, self.comm = True, self.comm, None
        self._calls.put(None)
        if comm is not None:
            _destroy(comm)


def _destroy(comm) -> None:
    try:
        comm.destroy()  # vLLM's PyNcclCommunicator: ncclCommAbort
    except Exception as e:
        log.warning("closing an NCCL communicator: %r", e)


def _awaited(future: Future, timeout_s: float, what: str) -> Callable[[], None]:
    """A call that waits for ``future`` at most ``timeout_s`` and raises SyncError, naming
    ``what``, when it failed or is still running."""
    def wait() -> None:
        try:
            future.result(timeout_s)
        except FutureTimeout:
            raise SyncError(f"{what} did not finish within {timeout_s:.0f} s (a member gone?)") from None
        except Exception as e:
            raise SyncError(f"{what} failed: {e!r}") from e

    return wait


class NcclBroadcast:
    """Learner rank 0's NCCL data plane for one generation (the sender's ``device`` seam,
    as weight_sync/ipc.py's ``IpcBroadcast`` is): one :class:`NcclPair` per member. GPU
    only: its CUDA calls have never run here, and are untested without a GPU."""

    transport = "nccl"

    def __init__(self, buffer_bytes: int, timeout_s: float):
        self.buffer_bytes, self.timeout_s = buffer_bytes, timeout_s
        self.rule = StragglerRule(timeout_s)
        self.pairs: dict[int, NcclPair] = {}  # member rank -> its communicator
        self.gpu: torch.device | None = None  # this rank's, read in the caller's thread (not a pair's)

    def open(self, group: GlooGroup, rule: StragglerRule | None = None) -> dict[int, str]:
        """After the gloo generation formed, each member in its pair's thread at once: the
        handshake, then its communicator's NCCL init, which the member's ranks enter as soon
        as they have the answer. One wait per member (:func:`joining`: the sync timeout for
        each of the two), so a member that never joins delays no other's; returns those
        that did not join in time (rank -> why), given up on alone. ``rule``: the
        sender's, for the versions."""
        self.close()
        self.rule, failed, self.gpu = rule or self.rule, {}, self._device()
        self.pairs = {rank: NcclPair(rank) for rank in range(1, group.world_size)}
        joins = {rank: pair.run(self._join, group, pair) for rank, pair in self.pairs.items()}
        self._finish(joins, failed, "joining the NCCL transfer", joining(2 * self.rule.timeout_s))
        return failed

    def _join(self, group: GlooGroup, pair: NcclPair) -> None:
        unique_id = self._unique_id()
        world = shake_hands(group, pair.rank, unique_id, self.buffer_bytes)
        pair.join(partial(self._init, unique_id, world))

    def broadcast(self, manifest: Manifest, tensors: Mapping[str, torch.Tensor],
                  gather: Callable[[list[str]], Mapping[str, torch.Tensor]] | None,
                  ranks: Iterable[int] | None = None) -> dict[int, str]:
        """One version, in the manifest's order and dtypes, packed in chunks of
        ``buffer_bytes`` as vLLM's consumer cuts them, over each of ``ranks``' communicator
        (every member's by default), up to ``NUM_BUFFERS`` chunks in flight; returns the
        members that failed or were given up on (rank -> why), who got no chunk after it."""
        failed: dict[int, str] = {}
        live = [rank for rank in (self.pairs if ranks is None else ranks) if rank in self.pairs]
        items = wire_tensors(manifest, tensors, self._device(), gather)
        sending: list[dict[int, Future]] = []  # each chunk's sends, oldest first
        while any(rank not in failed for rank in live) and (chunk := self._pack(items)) is not None:
            if len(sending) == NUM_BUFFERS:
                self._finish(sending.pop(0), failed, "NCCL broadcast")
            ready = self._ready()
            sending.append({rank: self.pairs[rank].run(self._send, self.pairs[rank], chunk, ready)
                            for rank in live if rank not in failed})
        for works in sending:
            self._finish(works, failed, "NCCL broadcast")
        return failed

    def _finish(self, works: dict[int, Future], failed: dict[int, str], what: str,
                rule: StragglerRule | None = None) -> None:
        """One step's wait per member, under ``rule`` (the sender's by default); a late
        member is abandoned."""
        rule = rule or self.rule
        waits = {rank: _awaited(future, rule.timeout_s, f"{what} with rank {rank}")
                 for rank, future in works.items() if rank not in failed}
        rule.wait(waits, failed, self.abandon)

    def abandon(self, rank: int) -> None:
        """Give up on one member: its communicator is aborted, the others' are untouched."""
        pair = self.pairs.pop(rank, None)
        if pair is not None:
            pair.close()

    def _pack(self, items: Iterator[tuple[str, torch.Tensor]]) -> torch.Tensor | None:
        """The next chunk of ``items``, packed by vLLM's ``pack_tensors`` (what its producer
        packs with and its consumer cuts by: tensors until past ``buffer_bytes``)."""
        from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

        chunk = pack_tensors(items, lambda item: item[1], self.buffer_bytes)
        return None if chunk is None else chunk.packed_tensor

    # -- the CUDA calls (vLLM's and torch's), the only part the CPU tests replace ------------
    def _unique_id(self) -> bytes:
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

        return bytes(NCCLLibrary().ncclGetUniqueId().internal)

    def _init(self, unique_id: bytes, world: int):
        from vllm.distributed.weight_transfer.nccl_common import uid_init_process_group

        return uid_init_process_group(unique_id, 0, world, self.gpu.index)  # in the pair's thread: named

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.accelerator.current_device_index())

    def _ready(self):
        """An event after the chunk just packed (on this thread's stream), which each pair's
        stream waits for before sending it."""
        event = torch.cuda.Event()
        event.record()
        return event

    def _send(self, pair: NcclPair, chunk: torch.Tensor, ready) -> None:
        """In ``pair``'s thread: broadcast ``chunk`` over its communicator on a stream of its
        own, once packed, and wait until it is sent (a member that hung holds it here, until
        :meth:`NcclPair.close` aborts the communicator)."""
        with torch.cuda.device(chunk.device):
            if pair.stream is None:
                pair.stream = torch.cuda.Stream()
            pair.stream.wait_event(ready)
            chunk.record_stream(pair.stream)  # not reused while this stream may still read it
            pair.comm.broadcast(chunk, src=0, stream=pair.stream)
            pair.stream.synchronize()

    def close(self) -> None:
        for pair in self.pairs.values():
            pair.close()
        self.pairs = {}


# -- the seam weight_sync/device_plane.py reads (this transport's row names this module) -----
def broadcast(bucket_bytes: int, timeout_s: float) -> NcclBroadcast:
    """The learner's half: packed buffers of ``bucket_bytes`` over each member's pair."""
    return NcclBroadcast(bucket_bytes, timeout_s)


async def engine_init_info(group: GlooGroup, engine_ranks: int) -> dict:
    """The engine's init info: its place in the learner's NCCL pair, from the handshake."""
    return await asyncio.to_thread(worker_handshake, group, engine_ranks)


async def engine_receive(group: GlooGroup, manifest: Manifest, load: Callable[[dict], Awaitable]) -> None:
    """A version's bytes into the engine: one packed broadcast, described by the manifest."""
    await load(update_info(manifest))
