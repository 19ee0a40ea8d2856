"""The collective that carries weight buckets: a gloo group formed outside any global state.

Both sides use plain ``torch.distributed`` objects (a ``TCPStore`` and a
``ProcessGroupGloo``) rather than ``init_process_group``, so the group can live next to
vLLM's own groups inside an engine worker and be torn down and re-formed for every sync
generation. Every operation carries a timeout: a dead peer raises within it (usually at
once, as "connection closed by peer"), it never hangs the caller.

Tearing a group down does not wake a peer blocked in one of its collectives (measured:
it waits out its full timeout), which is why weights travel point-to-point (see
:meth:`GlooGroup.send`).

Forming a generation takes two steps on the learner's store, so that one missing worker
costs one timeout and not the whole generation: every *candidate* checks in (or refuses,
with a reason), the learner waits for them until its deadline, and then tells each one
whether it is in and under which rank (:func:`admit`, :func:`check_in`). Only the
admitted ranks build the gloo group, and they are all known to be alive.

On CUDA the same interface would be served by NCCL (vLLM's ``PyNcclCommunicator`` over a
``StatelessProcessGroup``); only gloo is implemented and tested here, on CPU.
"""

from __future__ import annotations

import datetime
import json
import time

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import ProcessGroupGloo


class SyncError(RuntimeError):
    """A collective failed or timed out; the caller keeps its previous weights."""


class LeftOut(SyncError):
    """This worker checked in too late (or refused): the generation formed without it."""


def _key(generation: int, what: str) -> str:
    return f"rlpipe/gen{generation}/{what}"


def admit(store: TCPStore, generation: int, candidates: int, deadline: float) -> tuple[list[int], dict[int, str]]:
    """The learner's half of forming a generation: wait (until the monotonic ``deadline``)
    for candidate ranks ``1..candidates`` to check in, then publish who is in.

    Returns the admitted candidate ranks and, for those left out, why. Admitted candidate
    ``c`` gets rank ``admitted.index(c) + 1`` in a world of ``1 + len(admitted)``.
    """
    keys = {c: _key(generation, f"in/{c}") for c in range(1, candidates + 1)}
    try:
        store.wait(list(keys.values()), datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
    except Exception:  # some never checked in: the deadline passed
        pass
    admitted, left_out = [], {}
    for c, key in keys.items():
        answer = store.get(key).decode() if store.check([key]) else "did not check in before the deadline"
        if answer == "ok":
            admitted.append(c)
        else:
            left_out[c] = answer
    ranks = {str(c): i + 1 for i, c in enumerate(admitted)}
    store.set(_key(generation, "go"), json.dumps({"ranks": ranks, "world": 1 + len(admitted)}))
    return admitted, left_out


def check_in(store: TCPStore, generation: int, candidate: int, timeout_s: float,
             refuse: str | None = None) -> tuple[int, int]:
    """A worker's half: check in (or refuse, saying why) and wait for the learner's answer.

    Returns ``(rank, world_size)``; raises :class:`LeftOut` when the generation formed
    without this worker and :class:`SyncError` when the answer did not come in time."""
    store.set(_key(generation, f"in/{candidate}"), "ok" if refuse is None else refuse)
    if refuse is not None:
        raise LeftOut(refuse)
    try:
        store.wait([_key(generation, "go")], datetime.timedelta(seconds=timeout_s))
        go = json.loads(store.get(_key(generation, "go")))
    except Exception as e:
        raise SyncError(f"generation {generation} was never confirmed: {e}") from e
    if str(candidate) not in go["ranks"]:
        raise LeftOut(f"generation {generation} formed without candidate {candidate} (checked in too late)")
    return go["ranks"][str(candidate)], go["world"]


class GlooGroup:
    """Rank 0 is the learner; ranks 1..world-1 are rollout workers."""

    def __init__(self, store: TCPStore, rank: int, world_size: int, host: str, generation: int,
                 timeout_s: float, join_timeout_s: float):
        """Blocks until all ``world_size`` ranks joined (at most ``join_timeout_s``);
        every later operation fails after at most ``timeout_s``."""
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        opts = ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=join_timeout_s)
        opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
        try:
            self.pg = ProcessGroupGloo(PrefixStore(_key(generation, "pg/"), store), rank, world_size, opts)
        except Exception as e:  # gloo raises RuntimeError/DistStoreError on timeouts
            raise SyncError(f"forming generation {generation} (rank {rank}/{world_size}) failed: {e}") from e

    @staticmethod
    def listen(host: str, timeout_s: float) -> TCPStore:
        """The learner's store, on a port the OS picks (published through Redis)."""
        return TCPStore(host, 0, None, is_master=True,
                        timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)

    @staticmethod
    def connect(host: str, port: int, timeout_s: float) -> TCPStore:
        return TCPStore(host, port, None, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """One collective broadcast (the benchmark's baseline; sync itself uses :meth:`send`)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.timeout = self.timeout
        try:
            self.wait(self.pg.broadcast([tensor], opts))
        except SyncError:
            raise
        except Exception as e:
            raise SyncError(f"broadcast failed: {e}") from e

    def send(self, tensor: torch.Tensor, dst: int, tag: int):
        """Start sending ``tensor`` to one peer; returns the handle for :meth:`wait`.

        Weight sync fans buckets out with one send per worker instead of a collective
        broadcast: gloo's broadcast is the same fan-out from the root, but point-to-point a
        dead or stuck worker fails only its own sends, and the others still get the
        version (a failed collective leaves every peer waiting out its timeout)."""
        try:
            return self.pg.send([tensor], dst, tag)
        except Exception as e:
            raise SyncError(f"send to rank {dst} failed: {e}") from e

    def recv(self, tensor: torch.Tensor, src: int, tag: int):
        try:
            return self.pg.recv([tensor], src, tag)
        except Exception as e:
            raise SyncError(f"receive from rank {src} failed: {e}") from e

    def wait(self, work) -> None:
        try:
            work.wait(self.timeout)
        except Exception as e:
            raise SyncError(f"transfer failed: {e}") from e

    def close(self) -> None:
        self.pg = None
        self.store = None
