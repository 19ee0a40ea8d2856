"""How the learner takes its checkpoints: what each rank copies, who writes what, one write
at a time, and when one is durable. The format itself is learner/checkpoint.py's.

- ``full``: rank 0 gathers the weights and the whole optimizer state (under FSDP the other
  ranks join on its command, :meth:`Checkpointer.snapshot`) and writes them.
- ``sharded`` (``learner.checkpoint_format``): the weights are gathered to rank 0 alone, for
  the Hugging Face directory, and every rank copies and writes its own optimizer shard
  into rank 0's temporary directory (:meth:`Checkpointer.write_shards` on the others),
  before rank 0 renames it into place.

With ``learner.async_checkpoint`` the step only waits for the copies in host memory (and
for the previous write, if still going); the writes and their fsyncs run in a background
thread, and :meth:`Checkpointer.durable` says when the checkpoint is durable, so that the
learner acknowledges what it covers then and not before.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Callable

from learner import checkpoint
from learner.lora import adapter_state, is_lora
from learner.policy import load_policy


def load_weights(path: Path | None, model, from_main: bool = False) -> None:
    """Checkpoint ``path``'s weights copied into ``model`` in place: its parameters stay the
    objects the optimizer, the DDP wrapper and FSDP's shards hold (each rank keeps its own
    shard). Every rank reads ``path``; or with ``from_main`` rank 0 alone (``path`` None on
    the others), which sends each tensor: scattered as shards under FSDP
    (``distribute_tensor`` from rank 0), broadcast whole otherwise."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    lora = is_lora(model)  # a LoRA checkpoint holds the adapter alone: the frozen base stays as built
    saved = (adapter_state(path, model) if lora else load_policy(str(path)).state_dict()) if path is not None else None
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if lora and not t.requires_grad:
                continue
            if saved is not None:
                value = saved[name].to(t.device, t.dtype)
            else:  # filled by rank 0's (t.shape: the whole tensor's, also of a DTensor)
                value = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            if isinstance(t, DTensor):
                value = distribute_tensor(value, t.device_mesh, t.placements, src_data_rank=0 if from_main else None)
            elif from_main:
                dist.broadcast(value, src=0)
            t.copy_(value)


def checkpoint_roles(lc, fsdp: bool, world: int) -> tuple[bool, bool]:
    """Who writes and who reads the learner's checkpoints: ``(sharded, main_reads)``.
    Sharded (``learner.checkpoint_format``; auto: under FSDP on one node), every rank writes
    its optimizer shard into rank 0's directory and reads it back, which across nodes takes
    one shared filesystem, so there it must be asked for. Otherwise rank 0 alone writes, and
    across nodes alone reads too (``main_reads``, :meth:`Checkpointer.load`): only node 0
    needs the checkpoint directory."""
    fmt = lc.checkpoint_format
    sharded = fmt == "sharded" or (fmt == "auto" and fsdp and lc.nodes == 1)
    return sharded, lc.nodes > 1 and world > 1 and not sharded


def trainer_state(schedule, scaler, counters, ledger) -> dict:
    """Rank 0: what a checkpoint holds of the trainer beside its weights and optimizer
    (:meth:`Checkpointer.start` adds the optimizer's): the LR schedule, the loss scaler, the
    RNG, the run's counters, and the ledger's books (the groups trained since the previous
    checkpoint, which this one's durability acknowledges, and the prompt indices trained)."""
    import torch

    return {
        "schedule": schedule.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": torch.get_rng_state(),
        "counters": counters.state_dict(),
        "unacked_group_ids": [e.record.group_id for e in ledger.unacked],
        "prompt_indices": {"trained": ledger.trained_indices.to_bytes()},
    }


def lineage_meta(version: int, counters, base_model: str = "") -> dict:
    """A checkpoint's meta.json: its version and the lineage of groups its weights trained on;
    a LoRA checkpoint's also the base its adapter goes on (``rlpipe export`` merges them)."""
    return {"version": version, "trained_groups": counters.trained_groups,
            "trained_digest": str(counters.trained_digest), "time": time.time(),
            **({"base_model": base_model} if base_model else {})}


def load_trainer_state(state: dict, schedule, scaler, counters) -> None:
    """Every rank: the trainer's part of :func:`trainer_state` back in place (the ledger's
    books are rank 0's, restored by the learner)."""
    import torch

    schedule.load_state_dict(state["schedule"])
    scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"])
    counters.load_state_dict(state["counters"])


def _done(value) -> Future:
    future = Future()
    future.set_result(value)
    return future


class Checkpointer:
    def __init__(self, root: Path, model, opt, ranks, sharded: bool, async_write: bool, base_model: str, keep: int,
                 main_reads: bool = False):
        self.root, self.model, self.opt, self.ranks = root, model, opt, ranks
        self.sharded, self.base_model, self.keep = sharded, base_model, keep
        self.main_reads = main_reads  # only rank 0 reads checkpoints (:meth:`load`)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint") if async_write else None
        self._writing: tuple[Future, dict] | None = None  # rank 0: the write in progress, and what it holds
        self._shards_writing: Future | None = None  # ranks other than 0: their shards of the last checkpoint
        self.blocking_s = 0.0  # time the caller spent on checkpoints since it last reset this (the critical path)
        self.loaded: tuple[str, dict] | None = None  # the checkpoint restored last: its name and meta.json

    def load(self, path: Path, weights: bool = False) -> dict:
        """Checkpoint ``path``'s trainer state, its optimizer state loaded (either format, any
        number of ranks) and, with ``weights``, its weights too (the model was built from
        another checkpoint, :meth:`newer`, or from the base model).

        With ``main_reads`` (several nodes, full format: only rank 0 writes) only rank 0 reads
        ``path``, and the other ranks get its weights, trainer state and optimizer state over
        torch.distributed (:func:`load_weights`, ``Ranks.share``): only node 0 needs the
        checkpoint volume. (A checkpoint in the sharded format, from a run on one node, still
        has every rank read its own optimizer shards.)"""
        reads = self.ranks.is_main or not self.main_reads
        if weights:
            load_weights(path if reads else None, self.model, from_main=self.main_reads)
        state = checkpoint.load_state(path) if reads else None
        if self.main_reads:
            state = self.ranks.share(state)
        checkpoint.load_optimizer(path, state, self.model, self.opt)
        if reads:
            self.loaded = (path.name, checkpoint.read_meta(path))
        return state

    def newer(self) -> Path | None:
        """Rank 0: the newest complete checkpoint if it is not the one loaded last. A learner
        restores at start, then may wait for the lease while another learner trains and
        checkpoints: continuing from what it loaded would retrain, and roll back the books of,
        every step since. The same step written again (a resumed learner that stopped at once)
        differs in its meta.json."""
        latest = checkpoint.latest(self.root)
        if latest is None or (latest.name, checkpoint.read_meta(latest)) == self.loaded:
            return None
        return latest

    @property
    def background(self) -> bool:
        return self._writer is not None

    def start(self, step: int, version: int, state: dict, meta: dict, rollout: dict,
              before_publish: Callable[[], None]) -> None:
        """Rank 0: take checkpoint ``step`` of the trainer ``state`` (the optimizer's is added
        here) and write it, in the background when asynchronous. The caller first waits for
        the previous one with :meth:`durable`."""
        t0 = time.perf_counter()
        weights, tmp, write_shards = None, None, None
        if self.sharded:  # every rank writes its optimizer shard into this temporary directory
            tmp = checkpoint.begin(self.root, step)
            self.ranks.command("shards", str(tmp))
            weights, write_shards = self._stage_shards(tmp)
            state = checkpoint.host_copy(state)
        else:
            state["optimizer"] = checkpoint.optimizer_state(self.model, self.opt)
            if self.background or self.ranks.sharded:
                if self.ranks.sharded:
                    self.ranks.command("snapshot")
                weights, state = self.snapshot(state)
        save = partial(checkpoint.save, self.root, step, self.model, state, meta, self.base_model, self.keep,
                       before_publish=before_publish, rollout=rollout, weights=weights, tmp=tmp)

        def write() -> Path:
            if write_shards is not None:
                write_shards()  # returns once every rank's shards are durable
            return save()

        started = {"step": step, "version": version, "started": time.perf_counter()}
        self._writing = (self._writer.submit(write) if self.background else _done(write()), started)
        self.blocking_s += time.perf_counter() - t0

    def durable(self, block: bool = True) -> tuple[Path, dict] | None:
        """The checkpoint being written, ``(path, {step, version, started})``, once it is
        durable (waiting for it when ``block``); None when there is none or it is still being
        written. A failed write raises here."""
        if self._writing is None:
            return None
        future, started = self._writing
        if not block and not future.done():
            return None
        t0 = time.perf_counter()
        try:
            path = future.result()
        finally:
            self.blocking_s += time.perf_counter() - t0 if block else 0.0
        self._writing = None
        return path, started

    # -- every rank ----------------------------------------------------------------------
    def snapshot(self, state: dict | None = None):
        """Weights and trainer state copied to host memory (under FSDP gathered whole: every
        rank runs this, rank 0 for its checkpoint and the others on its command)."""
        return checkpoint.snapshot(self.model, state or {"optimizer": checkpoint.optimizer_state(self.model, self.opt)})

    def _stage_shards(self, tmp: str | Path):
        """A sharded checkpoint's collectives, on every rank (rank 0 for its checkpoint, the
        others on its command): the weights gathered whole (kept by rank 0 alone, for the
        Hugging Face directory) and this rank's optimizer shard copied to host memory, with
        the function that writes it, a collective on the checkpoint group that every rank
        runs at once (in its background writer with ``learner.async_checkpoint``)."""
        weights = checkpoint.snapshot_weights(self.model, keep=self.ranks.is_main)
        shards = checkpoint.optimizer_shards(self.model, self.opt)
        return weights, partial(checkpoint.save_shards, Path(tmp) / checkpoint.SHARDS, shards,
                                self.ranks.checkpoint_group)

    def write_shards(self, tmp: str) -> None:
        """Ranks other than 0, on its command: write this rank's shards of its checkpoint."""
        if self._shards_writing is not None:
            self._shards_writing.result()  # one at a time (a failed write stops this rank, and the job)
        _, write = self._stage_shards(tmp)
        self._shards_writing = self._writer.submit(write) if self.background else _done(write())

    def close(self) -> None:
        """Before this rank exits: its shards durable (rank 0 has renamed the directory already)."""
        if self._shards_writing is not None:
            self._shards_writing.result()
