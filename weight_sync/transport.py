"""The collective that carries weight buckets: a gloo group formed outside any global state.

Both sides use plain ``torch.distributed`` objects (a ``TCPStore`` and a
``ProcessGroupGloo``) rather than ``init_process_group``, so the group can live next to
vLLM's own groups inside an engine worker and be torn down and re-formed for every sync
generation. Every operation carries a timeout: a dead peer raises within it (usually at
once, as "connection closed by peer"), it never hangs the caller.

On CUDA the same interface would be served by NCCL (vLLM's ``PyNcclCommunicator`` over a
``StatelessProcessGroup``); only gloo is implemented and tested here, on CPU.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import ProcessGroupGloo


class SyncError(RuntimeError):
    """A collective failed or timed out; the caller keeps its previous weights."""


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
            self.pg = ProcessGroupGloo(PrefixStore(f"rlpipe/gen{generation}/", store), rank, world_size, opts)
        except Exception as e:  # gloo raises RuntimeError/DistStoreError on timeouts
            raise SyncError(f"forming generation {generation} (rank {rank}/{world_size}) failed: {e}") from e

    @staticmethod
    def listen(host: str, world_size: int, timeout_s: float) -> TCPStore:
        """The learner's store, on a port the OS picks (published through Redis)."""
        return TCPStore(host, 0, world_size, is_master=True,
                        timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)

    @staticmethod
    def connect(host: str, port: int, world_size: int, timeout_s: float) -> TCPStore:
        return TCPStore(host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.timeout = self.timeout
        try:
            self.pg.broadcast([tensor], opts).wait(self.timeout)
        except Exception as e:
            raise SyncError(f"broadcast failed: {e}") from e

    def close(self) -> None:
        self.pg = None
        self.store = None
