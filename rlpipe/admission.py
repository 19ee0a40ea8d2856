"""Whether a well-formed group record belongs to this run and may reach a batch (docs/design.md,
'Trajectory wire schema': the checks against the run).

:func:`rlpipe.schema.decode_group` checks that an entry is well-formed. That is not enough:
a record of 2,048-token samples, a future ``policy_version`` or a token id past the
vocabulary is well-formed and would crash or poison the learner (a long record OOM-killed
it on every restart). :class:`RunCheck` holds what the run fixes and raises
:class:`~rlpipe.schema.SchemaError` with the reason, so the reader dead-letters the entry
like a malformed one. It is pure: the reader gives it the Redis-side facts it needs (how
many prompts the dispatcher has handed out, and how many times a prompt was re-issued).

Multi-turn episodes (a sample with a ``mask``, rlpipe/schema.py): ``sampling.max_tokens``
bounds each *model turn*, a run of consecutive model tokens, not the whole episode (the
environment's messages and the turns add up past it); the episode as a whole is bounded by
``rollout.max_model_len`` with the prompt, as a single response is. A session always puts
at least one environment token between two turns (the chat template's turn markers), so
a run longer than ``max_tokens`` is a turn the run's engines could not have sampled.
Model tokens' per-token versions must lie in the record's span; environment tokens' may
reach the learner's version (a message appended after an update that no model token saw).
Whether decode_group's rule holds (behavior log-prob exactly 0 at every environment
position) is checked there, on every record, since it needs nothing of the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rlpipe.schema import GroupRecord, SchemaError

# What the run fixes in each record's ``sampling`` map (the rest: ``seed``, any int).
FIXED_SAMPLING = ("temperature", "top_p", "top_k", "max_tokens")
# A restarted Redis may have lost its last second of writes (AOF everysec), the cursor's and
# the re-issue counts' increments among them, while workers still push groups for what was
# handed out then: the chaos run saw groups for prompts 184-191 with the cursor back at 176.
# So a prompt index is refused only past twice the cursor plus this, and an attempt past
# the re-issues plus ATTEMPT_SLACK: still far below what breaks anything (the trained-prompt
# bitmap holds 2x the cursor in bits).
INDEX_SLACK = 1024
ATTEMPT_SLACK = 2
# The most prompt indices a run hands out (67M groups; 8 MB as a bitmap). The learner keeps
# the indices it trained and Redis those dropped as dense bitmaps, 1 bit per index up to the
# highest: a cursor overwritten to 2**31 grew the learner's to 2 GB and its checkpoints to
# 525 MB. The hand-out never goes past this (rlpipe/queue.py) and the reader refuses past it.
MAX_PROMPT_INDEX = 1 << 26


def longest_model_turn(mask) -> int:
    """The longest run of consecutive model tokens (mask 1) in an episode's mask."""
    edges = np.diff(np.concatenate(([0], np.asarray(mask, dtype=np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return int((ends - starts).max()) if len(starts) else 0


@dataclass
class RunCheck:
    run_id: str
    vocab_size: int  # the learner's embedding rows: a token id must index them
    n: int  # samples per group
    sampling: dict  # the values of FIXED_SAMPLING the run's workers sample with
    max_tokens: int  # longest response
    max_model_len: int  # longest prompt + response an engine of the run holds
    precisions: tuple[str, ...]  # the fleet's
    version: int = 0  # the learner's weights version, kept current by the learner
    # routing replay: the model's (MoE layers, top_k, experts) every record's routes must have; None: no routes
    routing: tuple[int, int, int] | None = None
    # score centering (learner.score_centering_k): the sampler's top-k every record must carry; 0: none
    sampler_topk: int = 0

    @classmethod
    def for_run(cls, cfg, vocab_size: int, routing: tuple[int, int, int] | None = None) -> "RunCheck":
        s = cfg.sampling
        return cls(run_id=cfg.run_id, vocab_size=vocab_size, n=s.n,
                   sampling={"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                             "max_tokens": s.max_tokens},
                   max_tokens=s.max_tokens, max_model_len=cfg.rollout.max_model_len,
                   precisions=tuple(cfg.rollout.precisions), routing=routing,
                   sampler_topk=cfg.learner.score_centering_k)

    def check(self, rec: GroupRecord, handed_out: int, reissued: int) -> None:
        """Raise SchemaError naming the first field that does not fit the run.

        ``handed_out``: the dispatcher's cursor (indices below it were handed out);
        ``reissued``: how many times ``rec.prompt_index`` was handed out again."""
        if rec.run_id != self.run_id:
            raise SchemaError(f"run_id: {rec.run_id!r} is not this run ({self.run_id!r})")
        if rec.precision not in self.precisions:
            raise SchemaError(f"precision: {rec.precision!r} is not one of this run's {list(self.precisions)}")
        if not 0 <= rec.policy_version <= rec.policy_version_end <= self.version:
            raise SchemaError(f"policy_version: {rec.policy_version}..{rec.policy_version_end} is not within "
                              f"0..{self.version}, the learner's version")
        self._check_sampling(rec.sampling)
        self._check_routing(rec.routing)
        if rec.sampler_topk != self.sampler_topk:
            raise SchemaError(f"sampler_topk: {rec.sampler_topk}, this run's learner.score_centering_k is "
                              f"{self.sampler_topk}")
        if len(rec.samples) != self.n:
            raise SchemaError(f"samples: {len(rec.samples)} samples, the run's sampling.n is {self.n}")
        prompt = len(rec.prompt_tokens)
        self._check_tokens("prompt_tokens", rec.prompt_tokens)
        for i, s in enumerate(rec.samples):
            where = f"samples[{i}]."
            if not len(s.tokens):
                raise SchemaError(f"{where}tokens: empty response")
            if s.mask is None and len(s.tokens) > self.max_tokens:
                raise SchemaError(f"{where}tokens: {len(s.tokens)} tokens, more than sampling.max_tokens "
                                  f"{self.max_tokens}")
            if s.mask is not None and (turn := longest_model_turn(s.mask)) > self.max_tokens:
                raise SchemaError(f"{where}mask: a model turn of {turn} tokens (a run of mask 1), more than "
                                  f"sampling.max_tokens {self.max_tokens}")
            if prompt + len(s.tokens) > self.max_model_len:
                raise SchemaError(f"{where}tokens: prompt {prompt} + response {len(s.tokens)} tokens exceed "
                                  f"rollout.max_model_len {self.max_model_len}")
            self._check_tokens(where + "tokens", s.tokens)
            if s.topk_ids is not None:
                self._check_tokens(where + "topk_ids", s.topk_ids)
            if s.versions is not None:
                self._check_versions(where, rec, s)
        if rec.prompt_index >= 0:  # -1: not from the cursor (imported data, tools)
            if rec.prompt_index >= MAX_PROMPT_INDEX:
                raise SchemaError(f"prompt_index: {rec.prompt_index} is beyond the run's limit of {MAX_PROMPT_INDEX} "
                                  f"prompts")
            if rec.prompt_index >= 2 * handed_out + INDEX_SLACK:
                raise SchemaError(f"prompt_index: {rec.prompt_index} was never handed out (the cursor is at "
                                  f"{handed_out})")
            if rec.attempt > reissued + ATTEMPT_SLACK:
                raise SchemaError(f"attempt: {rec.attempt}, but prompt {rec.prompt_index} was re-issued "
                                  f"{reissued} times")

    def _check_versions(self, where: str, rec: GroupRecord, s) -> None:
        """Model tokens' versions lie in the record's span; an environment token's (the version
        in force when it was appended) from ``policy_version`` to the learner's version: an
        episode may end on a message appended after an update that no model token saw."""
        model = s.model_mask()
        for versions, high, what in ((s.versions[model], rec.policy_version_end, "per-token versions"),
                                     (s.versions[~model], self.version, "environment tokens' versions")):
            if len(versions) and (versions.min() < rec.policy_version or versions.max() > high):
                raise SchemaError(f"{where}versions: {what} {int(versions.min())}..{int(versions.max())} outside "
                                  f"policy_version {rec.policy_version}..{high}")

    def _check_routing(self, routing) -> None:
        """Routes (checked for shape by decode_group) are this model's: its MoE layers, top_k and
        experts; a run that replays routing refuses a record without them, and one that does
        not, a record with them (routes it would silently ignore)."""
        if routing == self.routing:
            return
        if self.routing is None:
            raise SchemaError(f"routing: {routing}, but this run does not replay routing (rollout.routing_replay)")
        if routing is None:
            raise SchemaError(f"routing: missing, and this run replays routing (rollout.routing_replay): "
                              f"(layers, top_k, experts) {self.routing}")
        raise SchemaError(f"routing: (layers, top_k, experts) {routing}, this run's model has {self.routing}")

    def _check_sampling(self, sampling: dict) -> None:
        for key, want in self.sampling.items():
            got = sampling.get(key)
            if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
                raise SchemaError(f"sampling.{key}: expected a finite number, got {got!r}")
            if got != want:
                raise SchemaError(f"sampling.{key}: {got!r}, the run samples with {want!r}")
        seed = sampling.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise SchemaError(f"sampling.seed: expected an int, got {seed!r}")

    def _check_tokens(self, where: str, tokens) -> None:
        if len(tokens) and int(tokens.max()) >= self.vocab_size:
            raise SchemaError(f"{where}: token id {int(tokens.max())} is outside the vocabulary "
                              f"({self.vocab_size} ids)")
