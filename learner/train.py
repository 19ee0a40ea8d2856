"""The learner: consume groups, take a PPO step with mismatch correction, sync, checkpoint.

Read top to bottom, one learner step is:

    collect     XREADGROUP until ``groups_per_step`` fresh groups (too-stale ones are dropped and counted)
    score       advantages per group (GRPO, RLOO or REINFORCE++); all-equal groups carry no signal: skipped
    recompute   pi_old with the training policy (no grad); mismatch metrics and IS weights vs mu
    update      ppo_epochs x minibatches optimizer steps on the PPO-clip loss, in the training precision
    publish     version += 1, LR schedule, broadcast the weights to every live worker
    checkpoint  every ``checkpoint_every`` steps; then XACK + XDEL what it covers, counted as trained

Exactly once: an entry is acknowledged only after a durable checkpoint holds the step
that trained it, and the checkpoint lists the group ids it trained since the previous
one. A restarted learner loads the newest complete checkpoint, takes over its pending
entries (XAUTOCLAIM), acknowledges those the checkpoint already trained and trains the
rest: every group is trained once in the lineage of the final weights, or dropped as stale.

Run it with ``rlpipe learner --config run.yaml``, or ``torchrun --nproc-per-node N -m
rlpipe.cli learner ...`` for data parallelism (learner/dist.py).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from learner import checkpoint
from learner.batch import Batch, collate, microbatches
from learner.channels import FleetSync
from learner.checkpoint import RunCounters
from learner.dist import Ranks
from learner.loss import (
    RATIO_AGAINST_MU,
    compute_advantages,
    importance_weights,
    loss_denominator,
    loss_sum,
    masked_mean,
    mismatch_metrics,
    ppo_clip_terms,
)
from learner.metrics import LearnerMetrics
from learner.policy import LossScaler, compile_layers, enable_activation_checkpointing, load_policy, token_logprobs
from learner.schedule import LRSchedule, apply_lr
from rlpipe import registry
from rlpipe.checkpoints import checkpoint_root
from rlpipe.config import RunConfig, learner_quantized, without_secrets
from rlpipe.proc import process_age_s
from rlpipe.queue import Entry, IndexSet, RestartWatch, TrajectoryQueue, connect

log = logging.getLogger(__name__)

# Fault injection for the exactly-once tests: RLPIPE_CRASH_AT=<point>:<step> SIGKILLs the
# learner at that point of that step (points: collected, trained, synced, checkpoint_written,
# checkpointed). Unset in normal runs.
CRASH_AT = os.environ.get("RLPIPE_CRASH_AT", "")
RECENT_ACKS_S = 30.0  # how long the learner remembers what it acknowledged (a lost write is redone)


@dataclass
class UpdateStats:
    """What the optimizer steps of one learner step measured."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    skipped: int = 0  # fp16 steps skipped on overflow
    ppo_rows: list[dict] = field(default_factory=list)  # PPO statistics per minibatch


@dataclass
class StepOutcome:
    """Everything a learner step's metrics are computed from."""

    records: list
    rewards: torch.Tensor  # (G, n)
    informative: torch.Tensor  # (G,) bool: groups with a learning signal
    batch: Batch
    pi_old: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor  # the batch's, less rows bypass never measured
    is_metrics: dict
    update: UpdateStats


def _done(value) -> Future:
    future = Future()
    future.set_result(value)
    return future


def _token_weighted(parts: list[tuple[dict, float]]) -> dict:
    """Per-micro-batch PPO statistics (token means) as one mean over all their tokens."""
    if len(parts) == 1:
        return parts[0][0]
    tokens = sum(n for _, n in parts) or 1.0
    return {k: sum(m[k] * n for m, n in parts) / tokens for k in parts[0][0]}


class Learner:
    consumer = "learner-0"

    @property
    def step(self) -> int:
        return self.run_counters.step

    @property
    def version(self) -> int:
        return self.run_counters.version

    @property
    def dropped_stale_total(self) -> int:
        return self.run_counters.dropped_stale_total

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        lc = cfg.learner
        self.ranks = Ranks(lc.parallel)
        if self.ranks.sharded and learner_quantized(cfg):
            # Quantizing on the learner (and int8's monitors, which run the model) needs the
            # whole model on rank 0; the sharded sync streams cast weights only. (validate_run
            # says so at launch for learner.ranks; this is for a torchrun started by hand.)
            raise SystemExit(f"learner.parallel: fsdp cannot quantize for {'/'.join(learner_quantized(cfg))} "
                             f"workers yet (it needs the whole model on rank 0): use learner.parallel: ddp")
        if lc.threads:
            torch.set_num_threads(lc.threads)
        torch.manual_seed(cfg.seed)
        self.device = self.ranks.device
        self.ckpt_root = checkpoint_root(cfg)
        if self.ranks.is_main:  # first: a Redis that is down is reported before minutes of loading
            self.r = connect(cfg.redis_url, cfg.redis_wait_s)
            self.queue = TrajectoryQueue(self.r, cfg.run_id)
            self.keys = self.queue.keys
            self.redis_restarts = RestartWatch(self.r)
        resume = self.ranks.broadcast(checkpoint.latest(self.ckpt_root) if self.ranks.is_main else None)
        self.model = load_policy(str(resume or cfg.model.path)).to(self.device)
        if lc.activation_checkpointing:
            enable_activation_checkpointing(self.model)
        if lc.compile:
            compile_layers(self.model)
        self.train_model = self.ranks.wrap(self.model, lc.dtype, lc.fp32_lm_head)
        # What the other ranks do when rank 0 asks (learner/dist.py Command): under FSDP,
        # gather a bucket of parameters for the weight sync, or snapshot for a checkpoint.
        self._commands = {"gather": partial(self.ranks.full_tensors, self.model), "snapshot": self._snapshot}
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lc.lr, weight_decay=lc.weight_decay)
        self.schedule = LRSchedule(lc.schedule, lc.lr, cfg.steps)
        self.scaler = LossScaler(lc.dtype, lc.loss_scale_init, self.device.type)
        self.loss_norm_length = lc.loss_norm_length or cfg.sampling.max_tokens
        run_dir = Path(cfg.run_dir) if cfg.run_dir and self.ranks.is_main else None
        self.metrics = LearnerMetrics(run_dir / "metrics.jsonl" if run_dir else None, lc.trackers, cfg.run_id,
                                      without_secrets(cfg).model_dump(mode="json"),  # trackers write it down
                                      lc.wandb, lc.mlflow)
        if self.ranks.is_main:
            # One sync channel per rollout precision: what its workers get (cast, or quantized
            # here with the profile) and its generation, and when to sync (learner/channels.py).
            self.fleet = FleetSync(cfg, self.r, self.keys, self.metrics,
                                   gather=self._gather if self.ranks.sharded else None)
        self.run_counters = RunCounters()
        self.dropped_this_step = 0  # while collecting the next batch: the drop rate per step
        # The prompt indices this lineage trained (in every checkpoint) and the run dropped (in
        # Redis, see queue.ack): a second group for one of them (a zombie worker's, or one
        # replayed after Redis lost writes) is a duplicate, never trained.
        self.trained_indices, self.dropped_indices = IndexSet(), IndexSet()
        # Dead letters from before this process: its Prometheus counter counts only its own,
        # or every restart would re-raise the dead-letter alert of an old one.
        self.dead_seen = self.queue.counters()["dead"] if self.ranks.is_main else 0
        self.last_metrics: dict = {}
        self.last_checkpoint: dict | None = None
        self.status = "starting"
        self.stop_requested = False
        self.started_at = time.time()
        self._backlog: list[Entry] = []
        self._unacked: list[Entry] = []  # trained, waiting for a checkpoint
        # Background checkpoint writes (learner.async_checkpoint): one at a time; the one being
        # written (future, the entries it covers, when it was taken), acknowledged once durable.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint") if lc.async_checkpoint else None
        self._writing: tuple[Future, list[Entry], dict] | None = None
        self.checkpoint_blocking_s = 0.0  # this step's time spent on checkpoints (the critical path)
        self._trained_before_restart: set[str] = set()
        self._last_membership_check = 0.0
        # Redis restarts: the entries this process acknowledged lately (id -> how), to acknowledge
        # again the same way if a restarted Redis lost the acknowledgement, and when dead
        # workers' leases may be re-issued again (once live workers had time to heartbeat).
        self._recent_acks: dict[str, tuple[str, float]] = {}
        self._reclaim_after = 0.0
        if resume:
            self._restore(resume)
        # The LR of the next step comes from the schedule's state, not from the optimizer's
        # saved param groups, so a changed learner.lr takes effect on resume.
        apply_lr(self.opt, self.schedule.next_lr())

    # -- the loop ----------------------------------------------------------------------
    def run(self) -> None:
        if self.ranks.is_main:
            self._acquire_lease()
            self._take_over_pending()
            self._set_status("running")
            self.metrics.set(learner_step=self.step, learner_version=self.version)
        while self.step < self.cfg.steps:
            t_wait = time.perf_counter()
            entries = self.collect() if self.ranks.is_main else None
            if self.ranks.is_main and entries is None:  # asked to stop (the others go after the last checkpoint)
                break
            work = self.ranks.exchange(None if entries is None else ([e.record for e in entries], self.version),
                                       self._commands)
            if work is None:  # released by rank 0
                break
            records, self.run_counters.version = work
            self._crash_point("collected")
            t0 = time.perf_counter()
            step_metrics = self.train_step(records)
            train_s = time.perf_counter() - t0
            step_metrics["dropped_stale_step"], self.dropped_this_step = self.dropped_this_step, 0
            self.run_counters.step += 1
            self.run_counters.version += 1
            apply_lr(self.opt, self.schedule.update(self.step, step_metrics["response_length_mean"]))
            self.run_counters.trained_groups += len(records)
            for rec in records:
                self.trained_indices.add(rec.prompt_index)
            self.run_counters.trained_digest = (self.run_counters.trained_digest + checkpoint.group_digest(r.group_id for r in records)) % (1 << 64)
            self._crash_point("trained")
            if self.ranks.is_main:
                step_metrics.update(self.fleet.sync(self.model, self.version, self.step))
                self._crash_point("synced")
                self._unacked += entries
                if self.step % self.cfg.learner.checkpoint_every == 0 or self.step == self.cfg.steps:
                    self.checkpoint()
                self._finish_checkpoint(block=False)  # a background write that is done: acknowledge
                step_metrics["learner_wait_seconds"] = t0 - t_wait
                step_metrics["learner_train_seconds"] = train_s
                self._finish_step(step_metrics, train_s, time.perf_counter() - t0)
        if self.ranks.is_main:
            if self._unacked:  # stopped between checkpoints
                self.checkpoint()
            self._finish_checkpoint()
            self._set_status("done" if self.step >= self.cfg.steps else "stopped")
            self.metrics.done.set(float(self.step >= self.cfg.steps))
            self.fleet.drop()
            self.lease.release()
        self.ranks.release(self._commands)

    def request_stop(self) -> None:
        """Finish the step in hand, checkpoint, acknowledge, and return from ``run``."""
        self.stop_requested = True

    def collect(self) -> list[Entry] | None:
        """Block until ``groups_per_step`` groups fresh enough to train on are in hand
        (None if a stop was requested meanwhile; what was read stays pending)."""
        want = self.cfg.learner.groups_per_step
        batch: list[Entry] = []
        deferred: list[Entry] = []
        while len(batch) < want:
            if self.stop_requested:
                return None
            self._between_reads()
            if self._backlog:
                entries, self._backlog = self._backlog[: want - len(batch)], self._backlog[want - len(batch):]
            else:
                entries = self.queue.read(self.consumer, want - len(batch), self.cfg.learner.read_block_ms)
            if self.redis_restarts.restarted():  # Redis restarted meanwhile: these may be replays
                self._backlog, deferred = entries + deferred + self._backlog, []
                self._after_redis_restart(batch)
                continue
            stale, fresh, duplicate = [], [], []
            in_batch = {e.record.prompt_index for e in batch}
            for e in entries:
                index = e.record.prompt_index
                if index >= 0 and index in in_batch:  # its twin is not trained yet: decided after this batch
                    deferred.append(e)
                elif index >= 0 and (index in self.trained_indices or index in self.dropped_indices):
                    duplicate.append(e)
                else:
                    in_batch.add(index)
                    too_old = self.version - e.record.policy_version > self.cfg.queue.max_staleness
                    (stale if too_old else fresh).append(e)
            unacked_indices = {u.record.prompt_index for u in self._not_durable()} if duplicate else set()
            if any(e.record.prompt_index in unacked_indices for e in duplicate):
                # A twin trained since the last durable checkpoint may be the prompt's only copy
                # (Redis lost its push): make it durable before the duplicate goes.
                if self._unacked:
                    self.checkpoint()
                self._finish_checkpoint()
            if stale or duplicate:
                # A drop is final whatever happens to the weights later: acknowledged at once.
                self._ack([], stale, duplicate)
                for e in stale:
                    self.dropped_indices.add(e.record.prompt_index)
                self.run_counters.dropped_stale_total += len(stale)
                self.dropped_this_step += len(stale)
                self.metrics.dropped_stale.inc(len(stale))
                if stale:
                    log.info("dropped %d groups older than %d versions", len(stale), self.cfg.queue.max_staleness)
                if duplicate:
                    log.warning("acknowledged %d duplicate groups (prompts %s already settled) without training them",
                                len(duplicate), sorted(e.record.prompt_index for e in duplicate))
            batch += fresh
        self._backlog = list({e.entry_id: e for e in deferred + self._backlog}.values())
        return batch

    def train_step(self, records) -> dict:
        """One optimizer step's worth of PPO on ``records``; returns the step's metrics.

        Every rank holds every record; each computes and trains on its own rows (dist.py).
        """
        lc = self.cfg.learner
        rewards = torch.tensor([r.rewards for r in records], dtype=torch.float32)  # (G, n)
        advantages, informative = compute_advantages(rewards, lc.advantage, lc.adv_std_norm)
        batch = collate(records, advantages, self.version).to(self.device)
        self.model.eval()  # no dropout: pi_old and pi must be the same function of the weights
        if lc.is_mode == "bypass":
            return self._train_step_bypass(records, rewards, informative, batch)
        pi_old, entropy = self._recompute_pi_old(batch)
        mu = batch.behavior_logprobs
        weights, is_metrics = importance_weights(pi_old, mu, batch.mask, lc.is_mode, lc.is_cap, lc.geo_low,
                                                 lc.geo_high, lc.log_ratio_clamp)
        ref = mu if lc.is_mode in RATIO_AGAINST_MU else pi_old
        update = self._update(batch, informative, weights, ref)
        return self._step_metrics(StepOutcome(records, rewards, informative, batch, pi_old, entropy, batch.mask,
                                              is_metrics, update))

    def _recompute_pi_old(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """pi_old and the entropy of every row under the current weights, in the training
        precision (each rank computes its rows, then every rank has all of them)."""
        lc, ranks = self.cfg.learner, self.ranks
        n_rows = len(batch.rewards)
        mine = ranks.mine(torch.arange(n_rows, device=self.device))
        with torch.no_grad():
            lp, ent = token_logprobs(self.model, batch.select(mine), lc.dtype, lc.fp32_lm_head)
        return ranks.share_rows(lp, mine, n_rows), ranks.share_rows(ent, mine, n_rows)

    def _train_step_bypass(self, records, rewards, informative, batch) -> dict:
        """``is_mode: bypass``: pi_old is taken to be mu, so there is no recompute pass; the
        mismatch is measured on the first epoch's forward passes instead (of the rows that
        took part in one: groups without signal are never forwarded)."""
        lc, ranks = self.cfg.learner, self.ranks
        mu, n_rows = batch.behavior_logprobs, len(batch.rewards)
        everyone = torch.arange(n_rows, device=self.device)
        pi_old, entropy, seen = torch.zeros_like(mu), torch.zeros_like(mu), torch.zeros(n_rows, device=self.device)
        weights, is_metrics = importance_weights(mu, mu, batch.mask, lc.is_mode, lc.is_cap, lc.geo_low, lc.geo_high,
                                                 lc.log_ratio_clamp)

        def first_epoch(rows, pi, ent, took_part):  # pi may be trimmed to the rows' longest
            pi_old[rows, : pi.shape[1]], entropy[rows, : ent.shape[1]] = pi.detach(), ent.detach()
            seen[rows] = float(took_part)

        update = self._update(batch, informative, weights, mu, first_epoch)
        pi_old = ranks.share_rows(pi_old[seen.bool()], everyone[seen.bool()], n_rows)
        entropy = ranks.share_rows(entropy[seen.bool()], everyone[seen.bool()], n_rows)
        mask = batch.mask * ranks.share_rows(seen, everyone, n_rows).clamp(max=1)[:, None]
        return self._step_metrics(StepOutcome(records, rewards, informative, batch, pi_old, entropy, mask,
                                              is_metrics, update))

    def _update(self, batch, informative, weights, ref, first_epoch=None) -> UpdateStats:
        """``ppo_epochs`` x ``minibatches`` optimizer steps on the PPO-clip loss of the
        informative groups; ``first_epoch(rows, pi, entropy, took_part)`` sees epoch 0's forwards.

        Each rank's rows of a minibatch go forward in micro-batches of at most
        ``learner.max_tokens_per_microbatch`` padded tokens, and their gradients accumulate
        into one optimizer step; the loss denominator is the whole minibatch's, so the step
        is the same as one padded forward of all of them."""
        lc, ranks = self.cfg.learner, self.ranks
        groups = torch.nonzero(informative).squeeze(1).to(self.device)
        out = UpdateStats()
        for epoch in range(lc.ppo_epochs if len(groups) else 0):
            order = groups[torch.randperm(len(groups)).to(self.device)]
            for mb_groups in order.chunk(lc.minibatches):
                rows = torch.nonzero(torch.isin(batch.group_index, mb_groups)).squeeze(1)
                denom = loss_denominator(batch.mask[rows], lc.loss_agg, self.loss_norm_length)  # the whole minibatch's
                local = ranks.mine(rows)
                share = ranks.world if len(local) else 0.0  # a rank with no rows still joins the all-reduce
                local = local if len(local) else rows[:1]
                parts = microbatches(batch, local, lc.max_tokens_per_microbatch)
                n_parts = len(parts)
                if ranks.sharded:  # every rank must run as many forwards (each one gathers the layers)
                    parts += [parts[-1][:1]] * (ranks.max(n_parts) - n_parts)  # with weight 0
                self.opt.zero_grad(set_to_none=True)
                total, ppo_parts = 0.0, []
                for i, part in enumerate(parts):
                    mb = batch.select(part).trimmed() if len(parts) > 1 else batch.select(part)
                    width = mb.mask.shape[1]
                    weight = share if i < n_parts else 0.0
                    with ranks.no_sync(self.train_model, sync=i == len(parts) - 1):
                        pi, ent = token_logprobs(self.train_model, mb, lc.dtype, lc.fp32_lm_head)
                        if first_epoch and epoch == 0 and i < n_parts:
                            first_epoch(part, pi, ent, share > 0)
                        per_token, ppo_m = ppo_clip_terms(pi, ref[part, :width], mb.advantages, mb.mask,
                                                          weights[part, :width], lc.eps_low, lc.eps_high,
                                                          lc.log_ratio_clamp)
                        part_total = loss_sum(per_token, mb.mask, lc.loss_agg)  # this rank's rows
                        # DDP and FSDP average gradients over ranks; scaling by the world size makes it the sum.
                        self.scaler.backward(part_total * weight / denom)
                    if i < n_parts:
                        total += part_total.item()
                        ppo_parts.append((ppo_m, mb.mask.sum().item()))
                out.ppo_rows.append(_token_weighted(ppo_parts))
                grad_norm, was_skipped = self.scaler.step(self.opt, self.model.parameters(), lc.grad_clip)
                out.skipped += was_skipped
                out.grad_norms.append(grad_norm)
                out.losses.append(ranks.sum([total * (share > 0)])[0] / denom)
        return out

    def _step_metrics(self, o: StepOutcome) -> dict:
        records, rewards, informative, batch = o.records, o.rewards, o.informative, o.batch
        pi_old, mu, mask, entropy = o.pi_old, batch.behavior_logprobs, o.mask, o.entropy
        losses, grad_norms, skipped, ppo_rows = o.update.losses, o.update.grad_norms, o.update.skipped, o.update.ppo_rows
        is_metrics = o.is_metrics
        clamp = self.cfg.learner.log_ratio_clamp
        finite = [g for g in grad_norms if math.isfinite(g)]
        if finite:
            step_norm = sum(finite) / len(finite)
            a = self.cfg.learner.grad_norm_ema
            self.run_counters.grad_norm_smoothed = step_norm if self.run_counters.grad_norm_smoothed is None else \
                a * self.run_counters.grad_norm_smoothed + (1 - a) * step_norm
        self.run_counters.groups_skipped_total += int((~informative).sum())
        by_precision = {}
        precisions = [r.precision for r in records for _ in r.samples]
        for p in sorted(set(precisions)):
            rows = torch.tensor([q == p for q in precisions], device=mask.device)
            by_precision[p] = mismatch_metrics(pi_old[rows], mu[rows], mask[rows], clamp)
        fresh = batch.staleness == 0  # the precision effect alone, without policy lag
        staleness = Counter(int(self.version - r.policy_version) for r in records)
        for s, count in staleness.items():
            for _ in range(count):
                self.metrics.staleness.observe(s)
        return {
            "reward_mean": rewards.mean().item(),
            "response_length_mean": batch.mask.sum(1).float().mean().item(),
            "entropy": masked_mean(entropy, mask).item(),
            "learner_loss": sum(losses) / len(losses) if losses else 0.0,
            "learner_grad_norm": sum(finite) / len(finite) if finite else 0.0,
            "learner_grad_norm_max": max(finite) if finite else 0.0,
            "learner_grad_norm_smoothed": self.run_counters.grad_norm_smoothed or 0.0,
            "learner_lr": self.opt.param_groups[0]["lr"],
            "learner_loss_scale": self.scaler.scale,
            "learner_skipped_steps": skipped,
            "learner_skipped_steps_total": self.scaler.skipped_steps,
            "groups": len(records),
            "groups_by_precision": {p: sum(r.precision == p for r in records) for p in sorted({r.precision for r in records})},
            "reward_by_precision": {p: rewards[[r.precision == p for r in records]].mean().item()
                                    for p in sorted({r.precision for r in records})},
            "groups_skipped_equal_reward": int((~informative).sum()),
            "groups_skipped_total": self.run_counters.groups_skipped_total,
            "tokens": int(batch.mask.sum().item()),
            "staleness_mean": batch.staleness.float().mean().item(),
            "staleness_max": int(batch.staleness.max().item()),
            "staleness_hist": {str(s): c for s, c in sorted(staleness.items())},
            **mismatch_metrics(pi_old, mu, mask, clamp),
            "mismatch_kl_fresh": mismatch_metrics(pi_old[fresh], mu[fresh], mask[fresh], clamp)["mismatch_kl"]
            if fresh.any() else None,
            "mismatch_by_precision": by_precision,
            **is_metrics,
            # PPO statistics averaged over the step's minibatches (on rank 0's rows under DDP)
            **{k: sum(m[k] for m in ppo_rows) / len(ppo_rows) for k in (ppo_rows[0] if ppo_rows else {})},
        }

    # -- exactly-once bookkeeping ----------------------------------------------------------
    def checkpoint(self) -> None:
        """Checkpoint the state after this step; once it is durable, acknowledge every entry
        it covers. With ``learner.async_checkpoint`` the step only waits for a copy in host
        memory (and for the previous write, if still going); the write and its fsyncs run in
        the background and the acknowledgements follow at a later step boundary
        (:meth:`_finish_checkpoint`). Either way nothing is acknowledged before it is durable,
        so a learner killed mid-write restarts from the previous checkpoint and trains the
        rest again."""
        self._finish_checkpoint()  # one write at a time, in order (its wait counts itself)
        t0 = time.perf_counter()
        state = {
            "optimizer": checkpoint.optimizer_state(self.model, self.opt),
            "schedule": self.schedule.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": torch.get_rng_state(),
            "counters": self.run_counters.state_dict(),
            "unacked_group_ids": [e.record.group_id for e in self._unacked],
            "prompt_indices": {"trained": self.trained_indices.to_bytes()},
        }
        meta = {"version": self.version, "trained_groups": self.run_counters.trained_groups,
                "trained_digest": str(self.run_counters.trained_digest), "time": time.time()}
        # What quantized workers load to catch up: this version's tensors, as last sent.
        rollout = self.fleet.rollout_tensors(self.version)
        weights = None
        if self._writer is not None or self.ranks.sharded:
            if self.ranks.sharded:
                self.ranks.command("snapshot")
            weights, state = self._snapshot(state)
        write = partial(checkpoint.save, self.ckpt_root, self.step, self.model, state, meta, self.cfg.model.path,
                        self.cfg.learner.checkpoint_keep, before_publish=partial(self._crash_point, "checkpoint_written", self.step),
                        rollout=rollout, weights=weights)
        started = {"step": self.step, "version": self.version, "started": time.perf_counter()}
        entries, self._unacked = self._unacked, []
        if self._writer is None:
            self._writing = (_done(write()), entries, started)
        else:
            self._writing = (self._writer.submit(write), entries, started)
        self.checkpoint_blocking_s += time.perf_counter() - t0
        if self._writer is None:
            self._finish_checkpoint()

    def _snapshot(self, state: dict | None = None):
        """Weights and trainer state copied to host memory (under FSDP gathered whole: every
        rank runs this, rank 0 for its checkpoint and the others on its command)."""
        return checkpoint.snapshot(self.model, state or {"optimizer": checkpoint.optimizer_state(self.model, self.opt)})

    def _gather(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Rank 0 under FSDP: the named parameters whole, gathered with every rank (weight sync, one bucket)."""
        self.ranks.command("gather", names)
        return self.ranks.full_tensors(self.model, names)

    def _finish_checkpoint(self, block: bool = True) -> None:
        """Once the checkpoint being written is durable: acknowledge what it covers."""
        if self._writing is None:
            return
        future, entries, started = self._writing
        if not block and not future.done():
            return
        t0 = time.perf_counter()
        path = future.result()  # a failed write raises here: the learner stops, its supervisor restarts it
        self.checkpoint_blocking_s += time.perf_counter() - t0 if block else 0.0
        self._writing = None
        self._crash_point("checkpointed", started["step"])
        self._ack(entries)
        self.last_checkpoint = {"path": str(path), "step": started["step"], "version": started["version"],
                                "seconds": time.perf_counter() - started["started"], "time": time.time()}
        log.info("checkpoint %s durable (%.2fs after the step)", path.name, self.last_checkpoint["seconds"])

    def _not_durable(self) -> list[Entry]:
        """Trained entries no durable checkpoint covers yet: since the last one, and in the one being written."""
        return self._unacked + (self._writing[1] if self._writing else [])

    def _ack(self, trained: list[Entry], stale: list[Entry] = (), duplicate: list[Entry] = ()) -> None:
        self.queue.ack([e.entry_id for e in trained], stale, [e.entry_id for e in duplicate])
        now = time.monotonic()  # the last RECENT_ACKS_S of them: far more than an AOF can lose
        self._recent_acks = {k: (how, t) for k, (how, t) in self._recent_acks.items() if now - t < RECENT_ACKS_S}
        for how, entries in (("trained", trained), ("stale", stale), ("duplicate", duplicate)):
            self._recent_acks.update((e.entry_id, (how, now)) for e in entries)

    def _after_redis_restart(self, batch: list[Entry]) -> None:
        """Redis restarted: its AOF may have lost the last second of writes (everysec).
        Put things back as they were:

        - the weight sync re-forms in a new generation (the sync hash may have gone back);
        - entries this learner read or acknowledged, whose read or acknowledgement was lost,
          are pending for it again: acknowledged the same way again, or trained;
        - the books are re-derived from the lineage and the stream (``lost_writes``);
        - dead workers' leases wait a heartbeat TTL, so a live worker whose heartbeat was
          lost is not taken for dead.
        """
        self._reclaim_after = time.monotonic() + self.cfg.rollout.heartbeat_ttl_s
        self.fleet.drop()
        # Everything the stream would hand this learner now: its backlog, what is pending for
        # it, and what is new (a lost read makes entries new again), each entry once; less
        # what it holds trained or in the batch it is collecting.
        held = {e.entry_id for e in self._not_durable() + batch}
        seen: dict[str, Entry] = {}
        for e in self._backlog + self.queue.claim_pending(self.consumer, min_idle_ms=0) + self._read_all_new():
            if e.entry_id not in held:
                seen.setdefault(e.entry_id, e)
        again = {how: [e for e in seen.values() if self._recent_acks.get(e.entry_id, ("",))[0] == how]
                 for how in ("trained", "stale", "duplicate")}
        self._ack(again["trained"], again["stale"], again["duplicate"])
        self._backlog = [e for e in seen.values() if e.entry_id not in self._recent_acks]
        # What this learner holds untrained (the batch it is collecting, its backlog) whose
        # stream entry Redis lost goes back into the stream and is read again like any other
        # entry. Trained from memory, its acknowledgement would count nothing while the
        # lineage's consumed count grew: one back-pressure place too many for the rest of
        # the run (measured: a group at staleness max_lag + 1 in every later step).
        lost = self.queue.missing([e.entry_id for e in batch + self._backlog])
        for e in batch + self._backlog:
            if e.entry_id in lost:
                self.queue.push(e.record)
        batch[:] = [e for e in batch if e.entry_id not in lost]
        self._backlog = [e for e in self._backlog if e.entry_id not in lost]
        # Before anything else is acknowledged: what the lineage trained that Redis forgot
        # (its push was lost after this learner read it) is counted as produced and trained.
        was_t, now_t, was_p, now_p = self.queue.rederive_counters(self.run_counters.trained_groups,
                                                                  [e.entry_id for e in self._not_durable()])
        log.warning("Redis restarted: %d acknowledgements redone, %d entries to read, %d it lost pushed again; "
                    "counters trained %d -> %d, produced %d -> %d", sum(map(len, again.values())),
                    len(self._backlog), len(lost), was_t, now_t, was_p, now_p)

    def _read_all_new(self) -> list[Entry]:
        out = []
        while chunk := self.queue.read(self.consumer, 1000, block_ms=None):
            out += chunk
        return out

    def _restore(self, path: Path) -> None:
        state = checkpoint.load_state(path)
        checkpoint.load_optimizer_state(self.model, self.opt, state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"])
        self.run_counters.load_state_dict(state["counters"])
        self._trained_before_restart = set(state["unacked_group_ids"])
        self.trained_indices = IndexSet(state.get("prompt_indices", {}).get("trained", b""))
        self.last_checkpoint = {"path": str(path), "step": self.step, "version": self.version, "restored": True}
        if self.ranks.is_main:
            published = registry.learner_version(self.r, self.keys)
            if published > self.version:
                # Workers may hold weights of versions this checkpoint never saw: the restored
                # weights get a new, higher version so versions only ever grow.
                self.run_counters.version = published + 1
        log.info("resumed from %s: step %d, version %d", path.name, self.step, self.version)

    def _acquire_lease(self) -> None:
        """Wait until no other learner holds the run's lease (registry.LearnerLease); losing
        it later stops this process at once. (The run's state hash belongs to the holder:
        nothing is published while waiting.)"""
        self.lease = registry.LearnerLease(self.r, self.keys, self.cfg.learner.lease_ttl_s)

        def waiting():
            log.warning("another learner holds the lease of run %s; waiting for it", self.cfg.run_id)

        def lost():
            log.critical("lost the learner lease to another learner: stopping")
            os._exit(3)

        self.lease.acquire(on_wait=waiting, on_lost=lost)

    def _take_over_pending(self) -> None:
        """Entries read by a previous learner and never acknowledged: the ones its last
        checkpoint trained are acknowledged now; the rest are trained again."""
        self.queue.ensure_consumer_group()
        pending = self.queue.claim_pending(self.consumer, min_idle_ms=0)
        done = [e for e in pending if e.record.group_id in self._trained_before_restart]
        self._backlog = [e for e in pending if e.record.group_id not in self._trained_before_restart]
        self.queue.ack([e.entry_id for e in done])
        self.dropped_indices = self.queue.dropped_indices()
        was_t, now_t, was_p, now_p = self.queue.rederive_counters(self.run_counters.trained_groups)
        if (was_t, was_p) != (now_t, now_p):
            log.warning("counters re-derived from the lineage and the stream: trained %d -> %d, produced %d -> %d",
                        was_t, now_t, was_p, now_p)
        if pending:
            log.info("took over %d pending groups: %d already trained, %d to train", len(pending), len(done),
                     len(self._backlog))

    def _crash_point(self, point: str, step: int | None = None) -> None:
        if CRASH_AT == f"{point}:{self.step if step is None else step}":
            log.warning("RLPIPE_CRASH_AT=%s: killing myself", CRASH_AT)
            os.kill(os.getpid(), signal.SIGKILL)

    def _between_reads(self) -> None:
        """While waiting for groups (twice a second at most): publish the state, re-issue dead
        workers' leases, and bring joined or departed workers into a new sync generation."""
        now = time.monotonic()
        if now - self._last_membership_check < 0.5:
            return
        self._last_membership_check = now
        self._finish_checkpoint(block=False)  # a write that finished while we wait: acknowledge it now
        self._publish_state()
        reissued = self.queue.reclaim_dead() if now > self._reclaim_after else 0
        if reissued:
            log.warning("re-issued %d prompts leased by workers whose heartbeat expired", reissued)
        self.fleet.maybe_resync(self.model, self.version, self.step)

    # -- bookkeeping -------------------------------------------------------------------------
    def _finish_step(self, m: dict, train_s: float, step_s: float) -> None:
        now = time.time()
        counters = self.queue.counters()
        # The fleet's idle seconds at this row's time: over any steps, its change divided by
        # workers x elapsed time is the rollout idle fraction (the learner's: wait / wall).
        idle_s, workers = registry.fleet_idle_seconds(self.r, self.keys, now)
        self.metrics.queue_dead.inc(counters["dead"] - self.dead_seen)
        self.dead_seen = counters["dead"]
        m.update({
            "step": self.step,
            "learner_step": self.step,
            "learner_version": self.version,
            "learner_step_seconds": step_s,
            "learner_tokens_per_second": m["tokens"] / train_s if train_s > 0 else 0.0,
            "dropped_stale_total": self.run_counters.dropped_stale_total,
            "queue_depth": self.queue.length(),
            "queue_pending": self.queue.pending(),
            "produced_total": counters["produced"],
            "queue_dead_total": counters["dead"],
            "trained_groups_total": self.run_counters.trained_groups,
            "learner_ranks": self.ranks.world,
            "learner_parallel": self.ranks.parallel,  # none, ddp or fsdp
            "checkpoint_step": self.last_checkpoint["step"] if self.last_checkpoint else 0,
            "checkpoint_blocking_seconds": self.checkpoint_blocking_s,  # of this step: snapshot + waiting for a write
            # how long this process took from its start (a restart) to its first trained step
            **({"learner_start_to_first_step_seconds": process_age_s()}
               if not self.last_metrics else {}),
            "rollout_idle_seconds_total": idle_s,
            "rollout_workers": workers,
            "lr_schedule": self.schedule.state(),
            "time": now - self.started_at,
        })
        self.last_metrics = m
        self.checkpoint_blocking_s = 0.0
        self.metrics.record(m)
        self._publish_state()
        log.info("step %d: reward %.3f, kl %.2e, lr %.2e, %.2fs", self.step, m["reward_mean"], m["mismatch_kl"],
                 m["learner_lr"], step_s)

    def _set_status(self, status: str) -> None:
        self.status = status
        self._publish_state()

    def _publish_state(self) -> None:
        # ``consumed``: the groups this lineage trained, what the workers' back-pressure counts
        # against (rlpipe.queue.TrajectoryQueue.lease_prompts); a restarted learner publishes its checkpoint's.
        registry.set_learner_state(self.r, self.keys, status=self.status, step=self.step, version=self.version,
                                   consumed=self.run_counters.trained_groups)

    def snapshot(self) -> dict:
        """What ``GET /status`` returns."""
        return {
            "status": self.status,
            "step": self.step,
            "version": self.version,
            "lr": self.opt.param_groups[0]["lr"],
            "lr_schedule": self.schedule.state(),
            "training": {"dtype": self.cfg.learner.dtype, "is_mode": self.cfg.learner.is_mode,
                         "advantage": self.cfg.learner.advantage, "loss_agg": self.cfg.learner.loss_agg,
                         "loss_scale": self.scaler.scale, "skipped_steps_total": self.scaler.skipped_steps,
                         "ranks": self.ranks.world, "parallel": self.ranks.parallel},
            "checkpoint": {"dir": str(self.ckpt_root), "last": self.last_checkpoint,
                           "every": self.cfg.learner.checkpoint_every, "unacked_groups": len(self._not_durable()),
                           "async": self._writer is not None},
            "trained_groups_total": self.run_counters.trained_groups,
            **self.fleet.status(self.version),
            "dropped_stale_total": self.run_counters.dropped_stale_total,
            "last_metrics": self.last_metrics,
        }
