"""Data-parallel learner ranks under ``torchrun`` (DDP; gloo on CPU, NCCL on CUDA).

Rank 0 is the only one that talks to Redis, the workers and the disk; it hands every
rank the whole batch, and each rank trains on its share of the rows (row r of every
minibatch goes to rank r mod world). Loss denominators come from the whole minibatch,
so the averaged gradient equals the single-process one. Per-row results that the
metrics need (pi_old, entropy) are put back together with one all-reduce, as each
rank fills only its own rows.

FSDP2 (``fully_shard``) shards parameters, which the tiny models that fit a CPU do not
need; DDP keeps the loop identical on both. Without ``WORLD_SIZE`` in the environment
(a plain ``rlpipe learner``) every method here is a no-op.

Tested on CPU only (2 gloo ranks, tests/test_ddp.py); the NCCL branch is the same calls
with CUDA devices and has not been run.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist

# Ranks other than 0 wait in a broadcast while rank 0 waits for rollouts: a long wait is normal.
IDLE_TIMEOUT = timedelta(hours=6)


class Ranks:
    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.world > 1 and not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, timeout=IDLE_TIMEOUT)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.world == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[self.local_rank] if torch.cuda.is_available() else None)

    def no_sync(self, model: torch.nn.Module, sync: bool):
        """Gradient accumulation under DDP: backward passes inside skip the all-reduce,
        except the one with ``sync`` (the last micro-batch's)."""
        if sync or not hasattr(model, "no_sync"):
            return contextlib.nullcontext()
        return model.no_sync()

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def mine(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[self.rank :: self.world]

    def share_rows(self, local: torch.Tensor, rows: torch.Tensor, n_rows: int) -> torch.Tensor:
        """Every rank's per-row results, ``local`` holding this rank's ``rows``, as one (n_rows, ...) tensor."""
        full = torch.zeros((n_rows, *local.shape[1:]), dtype=local.dtype, device=local.device)
        full[rows] = local
        if self.world > 1:
            dist.all_reduce(full)
        return full

    def sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
