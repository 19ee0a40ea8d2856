"""The names of a run's Redis keys, and of the queue's consumer group and counters (docs/design.md, 'Redis keys').

Its own module because nearly every part of rlpipe needs a key's name (the registry, the weight
sync, the evaluators, the launcher, the tests) and none of them need the queue to get it. It
imports nothing, so anything may import it.
"""

from __future__ import annotations

# The consumer group the learner reads the ``traj`` stream in.
CONSUMER_GROUP = "learner"
# Whether a stream entry was counted in ``produced`` is the queue's own record, never the
# entry's: the push that adds it also adds its id to the ``traj:counted`` set, and whatever
# removes it (acknowledgement, dead letter) removes the id. An entry whose id is not there came
# from somewhere else (a raw XADD) and was never counted, so it is dead-lettered and counted as
# produced and dead at once: the books stay balanced and it takes no worker's place under
# back-pressure. (Entries once carried a ``counted`` field that said so, and a raw XADD could
# carry it too: the books were off by one for each, issue 33 item 16.)


class Keys:
    """Every Redis key of one run, under ``rlpipe:{run_id}:``."""

    def __init__(self, run_id: str):
        self.prefix = f"rlpipe:{run_id}:"
        self.traj = self.prefix + "traj"
        self.dead = self.prefix + "traj:dead"
        # Not in docs/design.md's table: the ids of the stream's entries counted in ``produced``
        # (a set), written only by the push scripts and removed with their entries.
        self.counted = self.prefix + "traj:counted"
        self.learner = self.prefix + "learner"
        # Not in docs/design.md's table: the learner lease's epoch (rlpipe/fence.py).
        self.epoch = self.prefix + "learner:epoch"
        self.sync = self.prefix + "sync"
        # Not in docs/design.md's table: each sync hash's generation counter, only ever advanced
        # (weight_sync/rendezvous.py next_generation): numbers never repeat when a hash is lost.
        self.sync_generations = self.prefix + "sync_generations"
        self.cursor = self.prefix + "prompts:cursor"
        # Not in docs/design.md's table: prompt indices handed out but given back unfinished (a
        # worker shut down, or its reward could not be computed); handed out again first.
        self.returned = self.prefix + "prompts:returned"
        # Not in docs/design.md's table: a bitmap of the prompt indices whose group was dropped as stale.
        self.dropped = self.prefix + "prompts:dropped"
        # Not in docs/design.md's table: how many times each re-issued prompt index was handed out before.
        self.attempts = self.prefix + "prompts:attempts"
        # Not in docs/design.md's table: how many times a reward or environment failed on each prompt
        # index (counted ones only, see rlpipe/queue.py reward_failed); cleared when it is pushed or dead.
        self.reward_failures = self.prefix + "prompts:reward_failures"
        # Not in docs/design.md's table: each leased prompt index's weights version when it was handed out
        # (a sorted set): the oldest group in flight holds back the fleet's allowance (rlpipe/queue_scripts.py).
        self.lease_versions = self.prefix + "prompts:lease_versions"
        # Not in docs/design.md's table: the counters behind the no-loss invariant (rlpipe/queue.py).
        self.counters = self.prefix + "counters"
        # Not in docs/design.md's table: held-out evaluation (rollout_service/evals.py, learner/evals.py):
        # the learner's requests (a stream read in one consumer group), the workers' results (a
        # stream), the versions already requested (a hash) and the last result the learner logged.
        self.eval_requests = self.prefix + "eval:requests"
        self.eval_results = self.prefix + "eval:results"
        self.eval_requested = self.prefix + "eval:requested"
        self.eval_logged = self.prefix + "eval:logged"
        self.eval_answered = self.prefix + "eval:answered"  # version -> the results entry logged for it

    def leases(self, worker_id: str) -> str:
        return f"{self.prefix}prompts:leases:{worker_id}"

    @property
    def lease_pattern(self) -> str:
        return f"{self.prefix}prompts:leases:*"

    def sync_channel(self, precision: str = "") -> str:
        """The sync rendezvous of the workers of one precision: ``sync`` when every worker
        runs the same precision, ``sync:<precision>`` in a mixed fleet (``rollout.fleet``)."""
        return f"{self.sync}:{precision}" if precision else self.sync

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}workers:{worker_id}"

    @property
    def worker_pattern(self) -> str:
        return f"{self.prefix}workers:*"


# The fields of the ``counters`` hash, each 0 until first counted (rlpipe/queue.py TrajectoryQueue.counters).
COUNTERS = ("produced", "trained", "dropped_stale", "dead", "duplicate", "filtered", "leased", "rejected_push",
            "reissued", "skipped", "lost_writes", "foreign", "dead_prompts")
