"""The learner's durability: checkpoint a step, acknowledge what a durable checkpoint covers, restore.

Exactly once rests on the order kept here: an entry is acknowledged only once the checkpoint that
trained it is durable (:meth:`Durability.checkpoint`, :meth:`Durability._finish_checkpoint`), and a
restored learner takes its versions past what the workers were sent (:meth:`Durability._restore`).
A mixin of learner/train.py's ``Learner``, whose attributes it uses (``cfg``, ``checkpoints``,
``ledger``, ``fleet``, ``queue``, ``run_counters``, ``schedule``, ``scaler``, ``ranks``).
"""

from __future__ import annotations

import logging
import time
from functools import partial
from pathlib import Path

from learner.checkpointer import lineage_meta, load_trainer_state, trainer_state
from learner.schedule import apply_lr
from rlpipe import registry
from rlpipe.faults import crash_at
from rlpipe.index_set import IndexSet

log = logging.getLogger(__name__)


class Durability:
    last_checkpoint: dict | None = None

    def _make_durable(self) -> None:
        if self.ledger.unacked:
            self.checkpoint()
        self._finish_checkpoint()

    def checkpoint(self) -> None:
        """Checkpoint the state after this step (learner/checkpointer.py); once it is durable,
        acknowledge every entry it covers. With ``learner.async_checkpoint`` the write runs in
        the background and the acknowledgements follow at a later step boundary
        (:meth:`_finish_checkpoint`). Either way nothing is acknowledged before it is durable,
        so a learner killed mid-write restarts from the previous checkpoint and trains the
        rest again."""
        self._finish_checkpoint()  # one write at a time, in order (its wait counts itself)
        state = trainer_state(self.schedule, self.scaler, self.run_counters, self.ledger)
        lora_base = str(self.cfg.model.path) if self.cfg.learner.lora.rank else ""  # what a LoRA checkpoint goes on
        meta = lineage_meta(self.version, self.run_counters, lora_base)
        # What quantized workers load to catch up: this version's tensors, as last sent.
        rollout = self.fleet.rollout_tensors(self.model, self.version)
        self.ledger.checkpoint_started()
        self.checkpoints.start(self.step, self.version, state, meta, rollout, partial(self._before_publish, self.step))
        if not self.checkpoints.background:
            self._finish_checkpoint()

    def _finish_checkpoint(self, block: bool = True) -> None:
        """Once the checkpoint being written is durable: acknowledge what it covers."""
        try:
            done = self.checkpoints.durable(block)  # a failed write raises: the learner stops, its supervisor restarts it
        except Exception:
            # A paused learner's write may fail because its successor cleared the half-written
            # directory: then the loss of the lease is the error to report (exit 3), not the disk.
            self.queue.fence.check()
            raise
        if done is None:
            return
        path, started = done
        crash_at(f"checkpointed:{started['step']}")
        self.ledger.durable()
        self.last_checkpoint = {"path": str(path), "step": started["step"], "version": started["version"],
                                "seconds": time.perf_counter() - started["started"], "time": time.time()}
        log.info("checkpoint %s durable (%.2fs after the step)", path.name, self.last_checkpoint["seconds"])

    def _restore_newer(self, path: str) -> None:
        """Every rank, once rank 0 holds the lease: the weights and state of a checkpoint
        written since this learner restored at start (learner/checkpointer.py ``newer``)."""
        self._restore(Path(path), weights=True)
        apply_lr(self.opt, self.schedule.next_lr())

    def _restore(self, path: Path, weights: bool = False) -> None:
        state = self.checkpoints.load(path, weights)
        load_trainer_state(state, self.schedule, self.scaler, self.run_counters)
        if self.ranks.is_main:
            self.ledger.trained_before_restart = set(state["unacked_group_ids"])
            self.ledger.trained_indices = IndexSet(state.get("prompt_indices", {}).get("trained", b""))
        self.last_checkpoint = {"path": str(path), "step": self.step, "version": self.version, "restored": True}
        if self.ranks.is_main:
            # The workers' versions too: the learner hash may be older than they are (restored, cleaned).
            published = registry.published_version(self.r, self.keys)
            if published > self.version:
                # Workers may hold weights of versions this checkpoint never saw: the restored
                # weights get a new, higher version so versions only ever grow (and their
                # records stay within the version range the reader admits).
                self.run_counters.version = published + 1
        log.info("resumed from %s: step %d, version %d", path.name, self.step, self.version)

    def _before_publish(self, step: int) -> None:
        """Just before a written checkpoint is renamed into place (maybe in the background
        writer, after a pause): a learner that lost its lease must not put one there."""
        crash_at(f"checkpoint_written:{step}")
        self.queue.fence.check()
