"""The learner: consume groups, take a PPO step with mismatch correction, sync, checkpoint.

Read top to bottom, one learner step is:

    collect     XREADGROUP until ``groups_per_step`` admitted, fresh groups (learner/ledger.py: records that
                do not fit the run are dead-lettered, too-stale ones dropped and counted)
    train       advantages, pi_old, IS weights and the PPO-clip update (learner/step.py)
    publish     version += 1, LR schedule, broadcast the weights to every live worker
    checkpoint  every ``checkpoint_every`` steps; then XACK + XDEL what it covers, counted as trained

Exactly once: an entry is acknowledged only after a durable checkpoint holds the step
that trained it, and the checkpoint lists the group ids it trained since the previous
one. A restarted learner loads the newest complete checkpoint, takes over its pending
entries, acknowledges those the checkpoint already trained and trains the rest: every
group is trained once in the lineage of the final weights, or dropped as stale
(learner/ledger.py keeps these books).

Run it with ``rlpipe learner --config run.yaml``, or ``torchrun --nproc-per-node N -m
launch.cli learner ...`` for data parallelism (learner/dist.py).
"""

from __future__ import annotations

import logging
import os
import time
from functools import partial
from pathlib import Path

import torch

from learner import checkpoint
from learner.batch import collate
from learner.channels import Collectives, FleetSync
from learner.checkpoint import RunCounters
from learner.checkpointer import Checkpointer, checkpoint_roles
from learner.dist import Ranks
from learner.distillation import load_teacher
from learner.durability import Durability
from learner.evals import Evals
from learner.ledger import Ledger
from learner.lora import trainable, training_policy
from learner.metrics import LearnerMetrics
from learner.optim import make_optimizer
from learner.policy import LossScaler, compile_layers, enable_activation_checkpointing, token_logprobs
from learner.reference import load_reference
from learner.retokenize import Retokenizer
from learner.routing import install as install_routing
from learner.routing import replay_problem, routing_shape
from learner.schedule import LRSchedule, TrainBudget, apply_lr
from learner.step import PPOStep
from rlpipe import registry
from rlpipe.admission import RunCheck
from rlpipe.autoscale import FleetSizer
from rlpipe.checkpoints import checkpoint_root
from rlpipe.config import RunConfig, sharded_problem, without_secrets
from rlpipe.faults import STEP_DELAY_ENV, crash_at, crash_on_poison, injected_delay
from rlpipe.proc import process_age_s
from rlpipe.queue import Entry, TrajectoryQueue
from rlpipe.redis_link import connect

log = logging.getLogger(__name__)



def acquire_lease(r, keys, ttl_s: float, run_id: str) -> registry.LearnerLease:
    """Wait until no other learner holds the run's lease (registry.LearnerLease); losing
    it later stops this process at once. (The run's state hash belongs to the holder:
    nothing is published while waiting.)"""
    lease = registry.LearnerLease(r, keys, ttl_s)

    def waiting():
        log.warning("another learner holds the lease of run %s; waiting for it", run_id)

    def lost():
        log.critical("lost the learner lease to another learner: stopping")
        os._exit(3)

    lease.acquire(on_wait=waiting, on_lost=lost)
    return lease


class Learner(Durability):
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
        if why := sharded_problem(cfg, self.ranks.sharded):
            raise SystemExit(why)  # validate_run says so at launch; this is for a torchrun started by hand
        if lc.threads:
            torch.set_num_threads(lc.threads)
        torch.manual_seed(cfg.seed)
        self.device = self.ranks.device
        self.ckpt_root = checkpoint_root(cfg)
        if self.ranks.is_main:  # first: a Redis that is down is reported before minutes of loading
            self.r = connect(cfg.redis_url, cfg.redis_wait_s)
            self.queue = TrajectoryQueue(self.r, cfg.run_id)
            self.keys = self.queue.keys
        # With main_reads (across nodes, full format) every rank starts from the base model and
        # rank 0 sends the others what it read of the checkpoint (Checkpointer.load).
        sharded, main_reads = checkpoint_roles(lc, self.ranks.sharded, self.ranks.world)
        resume = self.ranks.broadcast(checkpoint.latest(self.ckpt_root) if self.ranks.is_main else None)
        restore_weights = main_reads or lc.lora.rank > 0  # a LoRA checkpoint holds the adapter, not the base
        self.model = training_policy(cfg, str(cfg.model.path if restore_weights else resume or cfg.model.path))
        self.model = self.model.to(self.device)
        if lc.activation_checkpointing:
            enable_activation_checkpointing(self.model)
        if lc.compile:
            compile_layers(self.model)
        self.train_model = self.ranks.wrap(self.model, lc.dtype, lc.fp32_lm_head)
        self.opt = make_optimizer(lc.optimizer, trainable(self.model), lc.lr, lc.weight_decay)
        self.checkpoints = Checkpointer(self.ckpt_root, self.model, self.opt, self.ranks, sharded, lc.async_checkpoint,
                                        cfg.model.path, lc.checkpoint_keep, main_reads)
        # What the other ranks do when rank 0 asks (learner/dist.py Command): under FSDP,
        # gather a bucket of parameters for the weight sync, or snapshot for a checkpoint
        # (whole, or their own optimizer shards, which they write: learner.checkpoint_format).
        self._commands = {"gather": partial(self.ranks.full_tensors, self.model),
                          "probe": partial(self.ranks.probe, self.model),
                          "snapshot": self.checkpoints.snapshot, "shards": self.checkpoints.write_shards,
                          "restore": self._restore_newer}
        self.schedule = LRSchedule(lc.schedule, lc.lr, cfg.steps)
        self.budget = TrainBudget(cfg.train_budget_s)  # rank 0 decides; the others are released as after a stop
        self.fleet_sizer = FleetSizer(cfg.autoscale)
        self.fleet_advice: dict = {}  # the rule's last output, published for `rlpipe up --autoscale`
        self.scaler = LossScaler(lc.dtype, lc.loss_scale_init, self.device.type)
        self.retokenizer = Retokenizer(str(cfg.model.path)) if lc.retokenize else None
        run_dir = Path(cfg.run_dir) if cfg.run_dir and self.ranks.is_main else None
        self.metrics = LearnerMetrics(run_dir / "metrics.jsonl" if run_dir else None, lc.trackers, cfg.run_id,
                                      without_secrets(cfg).model_dump(mode="json"),  # trackers write it down
                                      lc.wandb, lc.mlflow)
        self.run_counters = RunCounters()
        self.ppo = PPOStep(cfg, self.ranks, self.model, self.train_model, self.opt, self.scaler, self.run_counters,
                           self.metrics.staleness, load_reference(cfg, self.device, self.model, self.ranks.sharded),
                           load_teacher(cfg, self.device))
        # An MoE's routers count their load; with rollout.routing_replay they replay the rollout's experts too
        for model in (m for m in (self.model, self.ppo.reference)
                      if isinstance(m, torch.nn.Module) and replay_problem(m) is None):
            install_routing(model, replay=cfg.rollout.routing_replay and lc.replay_routes)
        if self.ranks.is_main:
            # One sync channel per rollout precision: what its workers get (cast, or quantized
            # here with the profile) and its generation, and when to sync (learner/channels.py).
            collectives = Collectives(self._gather, self._probe) if self.ranks.sharded else None
            self.fleet = FleetSync(cfg, self.r, self.keys, self.metrics, collectives, fence=self.queue.fence)
            # The reader admits only records that fit this run and this model (rlpipe/admission.py).
            self.queue.check = RunCheck.for_run(cfg, self.model.get_input_embeddings().num_embeddings,
                                                routing_shape(self.model) if cfg.rollout.routing_replay else None)
            self.ledger = Ledger(cfg, self.queue, self.run_counters, self.metrics.dropped_stale, self._try_alone)
            self.ledger.on_redis_restart = self.fleet.drop  # the sync hash may have gone back: re-form
            # Dead letters from before this process: its Prometheus counter counts only its own,
            # or every restart would re-raise the dead-letter alert of an old one.
            self.dead_seen = self.queue.counters()["dead"]
            self.evals = Evals(cfg, self.r, self.keys, self.metrics)  # held-out evaluation (learner/evals.py)
        self.last_metrics: dict = {}
        self.last_checkpoint: dict | None = None
        self.status = "starting"
        self.stop_requested = False
        self.started_at = time.time()
        self._last_membership_check = 0.0
        if resume:
            self._restore(resume, weights=restore_weights)
        # The LR of the next step comes from the schedule's state, not from the optimizer's
        # saved param groups, so a changed learner.lr takes effect on resume.
        apply_lr(self.opt, self.schedule.next_lr())

    # -- the loop ----------------------------------------------------------------------
    def run(self) -> None:
        if self.ranks.is_main:
            # From now on Redis refuses this learner's acknowledgements, dead letters, state and weights once
            # another learner takes the lease (rlpipe/fence.py): the queue's fence is also the sync's.
            self.lease = self.queue.fence.lease = acquire_lease(self.r, self.keys, self.cfg.learner.lease_ttl_s,
                                                                self.cfg.run_id)
            if newer := self.checkpoints.newer():  # another learner trained while this one waited
                self.ranks.command("restore", str(newer))
                self._restore_newer(str(newer))
            self.queue.check.version = self.version  # what is taken over is admitted against the restored version
            self.ledger.take_over_pending()
            self.metrics.set(learner_step=self.step, learner_version=self.version)
            if self.evals.due(self.step):  # step 0 (or a restart's step): the base model
                self._set_status("evaluating")  # while eval.base_at_rest waits for it
                self.evals.start(self.version, self.step)
            self._set_status("running")
        while self.step < self.cfg.steps and not (self.ranks.is_main and self.budget.spent(self.step, self.cfg.steps)):
            t_wait = time.perf_counter()
            entries = self.collect() if self.ranks.is_main else None
            if self.ranks.is_main and entries is None:  # asked to stop (the others go after the last checkpoint)
                break
            work = self.ranks.exchange(None if entries is None else ([e.record for e in entries], self.version),
                                       self._commands)
            if work is None:  # released by rank 0
                break
            records, self.run_counters.version = work
            crash_at(f"collected:{self.step}")
            crash_on_poison({r.prompt_id for r in records})
            t0 = time.perf_counter()
            self.budget.start(t0)
            step_metrics = self.train(records)
            time.sleep(injected_delay(STEP_DELAY_ENV))
            train_s = time.perf_counter() - t0
            self.run_counters.step += 1
            self.run_counters.version += 1
            apply_lr(self.opt, self.schedule.update(self.step, step_metrics["response_length_mean"]))
            if not self.ranks.is_main:
                continue
            self.ledger.trained(entries)
            step_metrics["dropped_stale_step"], self.ledger.dropped_this_step = self.ledger.dropped_this_step, 0
            step_metrics.update(self.ledger.sampling_metrics(entries))
            crash_at(f"trained:{self.step}")
            step_metrics.update(self.fleet.sync(self.model, self.version, self.step))
            crash_at(f"synced:{self.step}")
            if self.evals.due(self.step) and self.step < self.cfg.steps:
                self.evals.request(self.version, self.step)  # the workers have this version now
            self.evals.poll(self.step)
            if self.step % self.cfg.learner.checkpoint_every == 0 or self.step == self.cfg.steps:
                self.checkpoint()
            self._finish_checkpoint(block=False)  # a background write that is done: acknowledge
            step_metrics["learner_wait_seconds"] = t0 - t_wait
            step_metrics["learner_train_seconds"] = train_s
            self._finish_step(step_metrics, train_s, time.perf_counter() - t0)
        if self.ranks.is_main:
            if self.ledger.unacked:  # stopped between checkpoints
                self.checkpoint()
            self._finish_checkpoint()
            if self.finished:
                self._set_status("evaluating")
                self.evals.finish(self.version, self.step)
            self._set_status("done" if self.finished else "stopped")
            self.metrics.done.set(float(self.finished))
            self.fleet.drop()
            self.lease.release()
        self.ranks.release(self._commands)
        self.checkpoints.close()

    def train(self, records) -> dict:
        """One PPO step on ``records``: under ``learner.retokenize`` (a comparison arm) on their answers' text
        tokenized again (learner/retokenize.py), counting the tokens that changed."""
        if self.retokenizer is None:
            return self.ppo.train_step(records)
        m = self.ppo.train_step([self.retokenizer(r) for r in records])
        m["retokenized_changed_tokens"], self.retokenizer.changed = self.retokenizer.changed, 0
        return m

    @property
    def finished(self) -> bool:
        """The run's training is over: every step trained, or ``train_budget_s`` spent."""
        return self.step >= self.cfg.steps or self.budget.reached

    def request_stop(self) -> None:
        """Finish the step in hand, checkpoint, acknowledge, and return from ``run``."""
        self.stop_requested = True

    def collect(self) -> list[Entry] | None:
        """The next batch's entries (None: asked to stop), admitted against this version."""
        self.queue.check.version = self.version
        return self.ledger.collect(self.cfg.learner.groups_per_step, lambda: self.stop_requested,
                                   self._between_reads, self._make_durable)

    def _try_alone(self, entry: Entry) -> None:
        """A forward of one group on its own (the ledger's poison check): if this kills the
        learner, the group alone is to blame. Under FSDP rank 0 cannot forward alone (each
        layer gathers its shards from every rank): suspects are then not tried, and a poison
        record takes the innocent groups pending beside it to the dead letters too."""
        if self.ranks.sharded:
            return
        crash_on_poison({entry.record.prompt_id})
        with torch.no_grad():
            token_logprobs(self.model, collate([entry.record], torch.zeros(1, len(entry.record.samples)),
                                               self.version).to(self.device))
        log.info("entry %s, delivered more than once, went through a forward alone", entry.entry_id)

    def _gather(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Rank 0 under FSDP: the named parameters whole, gathered with every rank (weight sync, one bucket)."""
        self.ranks.command("gather", names)
        return self.ranks.full_tensors(self.model, names)

    def _probe(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Rank 0 under FSDP: the policy on a batch with every rank (int8's monitors, on a layer sample)."""
        self.ranks.command("probe", input_ids, attention_mask)
        self.ranks.probe(self.model, input_ids, attention_mask)

    def _between_reads(self) -> None:
        """While waiting for groups (twice a second at most): publish the state, re-issue dead
        workers' leases, and bring joined or departed workers into a new sync generation."""
        now = time.monotonic()
        if now - self._last_membership_check < 0.5:
            return
        self._last_membership_check = now
        self._finish_checkpoint(block=False)  # a write that finished while we wait: acknowledge it now
        self._publish_state()
        reissued = self.queue.reclaim_dead() if now > self.ledger.reclaim_after else 0
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
        # A Redis restart may take back the last second's dead letters (they are dead-lettered again
        # when read again): the counter only counts what is new beyond the most it has seen.
        self.metrics.queue_dead.inc(max(0, counters["dead"] - self.dead_seen))
        self.dead_seen = max(self.dead_seen, counters["dead"])
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
            # every precision of the fleet, from 0: its series exists before its first group
            **{name: {p: by.get(p, 0) for p in dict.fromkeys([*self.queue.check.precisions, *by])}
               for name, by in (("trained_groups_by_precision_total", self.run_counters.trained_by_precision),
                                ("dropped_stale_by_precision_total", self.run_counters.dropped_stale_by_precision))},
            "learner_ranks": self.ranks.world,
            "learner_parallel": self.ranks.parallel,  # none, ddp or fsdp
            "checkpoint_step": self.last_checkpoint["step"] if self.last_checkpoint else 0,
            "checkpoint_blocking_seconds": self.checkpoints.blocking_s,  # of this step: snapshot + waiting for a write
            # how long this process took from its start (a restart) to its first trained step
            **({"learner_start_to_first_step_seconds": process_age_s()}
               if not self.last_metrics else {}),
            "rollout_idle_seconds_total": idle_s,
            "rollout_workers": workers,
            "lr_schedule": self.schedule.state(),
            "time": now - self.started_at,
        })
        self.fleet_advice = self.fleet_sizer.observe(m)
        m.update(self.fleet_advice)
        self.last_metrics = m
        self.checkpoints.blocking_s = 0.0
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
        registry.set_learner_state(self.r, self.keys, self.queue.fence, status=self.status, step=self.step,
                                   version=self.version, consumed=self.run_counters.trained_groups,
                                   sample_ratio=round(self.run_counters.sample_ratio, 3), **self.fleet_advice)
