"""The rollout worker's side of weight sync, the counterpart of :class:`WeightSender`:
follow the learner's generations and versions (docs/design.md, 'Weight sync protocol') and
drive an engine through the small :class:`SyncEngine` protocol.

- A new generation that lists this worker means: check in and join (or refuse, when the
  engine cannot load its manifest: the learner stops, naming it and the reason, when the
  manifest is the learner's). First of all, the learner's own manifest is read from its
  store (token-gated, unlike Redis) and replaces a rewritten one; then the manifest is checked against the
  ``manifest_hash`` beside it: either can be rewritten in Redis without the sync token,
  and a check-in signed for the learner's hash but judging another manifest would answer
  the learner about weights it never sent. A generation whose manifest is not its hash's
  is skipped (logged, never checked in to, never refused) and the worker asks back in. So
  does a refusing worker: where its refusal stopped the learner that costs nothing, and
  where it did not (a manifest and hash rewritten together: the refusal was signed for
  another hash, which the learner never reads) the learner takes the worker back. A
  Redis writer without the token may cost a worker a version, never more. With a
  sync token the check-in is signed for this worker's id and incarnation, the generation
  and its manifest: the follower computes that MAC
  (:func:`~weight_sync.transport.check_in_slot`) and hands it to the engine as the slot to
  check in under, so the engine needs no more than the token in its environment (for the
  learner's gate). It signs for the incarnation the learner lists
  when that is one this follower has held: the learner may have read the registry just
  before a redraw (a restarted worker redraws as soon as it sees a generation formed
  without it), and it then admits the process it listed, as it did before check-ins
  were signed, instead of waiting out its deadline; the next sync sees the new
  incarnation and re-forms.
  A generation is new when its identity (number and random id) is one not seen before,
  not only when its number is higher: the learner never uses a number twice
  (weight_sync/rendezvous.py), but anyone who can write the sync hash can.
  The generation's manifest is parsed once, here, when joining; the engine's stager
  keeps its own for the generation (parsed once, on its side of vLLM's
  ``collective_rpc``), so an update crosses with its version and the manifest's hash.
- A higher version in the joined generation means: receive it and load it.
- A worker left out (it checked in late, a transfer failed, or the learner had not seen
  it yet) catches up from the newest checkpoint on disk and asks back in by drawing a
  new *incarnation*, the token the learner keys membership on.

The engine protocol is what ``rollout_service.engine.RolloutEngine`` implements for vLLM.
An update runs one way from here: the follower, the engine (which pauses generation to
load), its worker process's binding (rollout_service/worker_ext.py), the
:class:`~weight_sync.stager.WeightStager` there, and its
:class:`~weight_sync.receiver.WeightReceiver`. The weight-sync tests drive the same
follower with stand-in engines over the same stager.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable, Protocol

import redis

from rlpipe.auth import sync_token
from weight_sync.manifest import Manifest, manifest_hash
from weight_sync.rendezvous import SyncState, read_sync
from weight_sync.transport import check_in_slot, read_manifest

log = logging.getLogger(__name__)


def new_incarnation() -> str:
    return uuid.uuid4().hex[:12]


@dataclass
class SyncOutcome:
    """What one engine operation (join, update, load a checkpoint) came to."""

    ok: bool
    error: str = ""
    refused: bool = False  # the engine declined the generation: it cannot load these weights
    timings: dict[str, float] = field(default_factory=dict)  # transfer_s, read_s, load_s, pause_s
    activated_at: float = 0.0  # wall clock when the engine resumed on the new weights (0: not said)

    @classmethod
    def failed(cls, error: str, refused: bool = False) -> "SyncOutcome":
        return cls(False, error, refused)

    @classmethod
    def of(cls, reply: dict) -> "SyncOutcome":
        """An engine process's JSON-able reply (weight_sync/stager.py, through
        ``collective_rpc``) as a typed outcome: its ``*_s`` keys are its timings."""
        return cls(bool(reply.get("ok")), reply.get("error") or "", bool(reply.get("refused")),
                   {k: v for k, v in reply.items() if k.endswith("_s")}, float(reply.get("activated_at", 0.0)))


@dataclass
class Synced:
    """A version the engine now serves, and where it came from."""

    version: int
    source: str  # "learner" or "checkpoint"
    generation: int
    timings: dict[str, float]
    activated_at: float  # wall clock when the engine began serving it (weight_sync/convergence.py)


@dataclass
class Checkpoint:
    """The newest checkpoint a worker could catch up from."""

    path: str
    version: int
    quant_profile: str | None = None


class SyncEngine(Protocol):
    version: int

    async def join(self, host: str, port: int, slot: str, generation: int, manifest: Manifest,
                   timeout_s: float) -> SyncOutcome:
        """Check in under ``slot`` and join ``generation``, or refuse it (``WeightStager.join``)."""

    async def update(self, version: int, manifest: Manifest) -> SyncOutcome:
        """Receive and load ``version`` of the joined generation, whose manifest is ``manifest``."""

    async def load_checkpoint(self, path: str, version: int, quant_profile: str | None) -> SyncOutcome: ...


class WeightFollower:
    """Follows one sync rendezvous (``sync_key``) for ``worker_id``.

    ``latest_checkpoint`` returns what to catch up from (or None); ``on_synced`` and
    ``on_failed`` report to the worker (metrics, registry); ``on_incarnation`` publishes a
    new incarnation. Exceptions of the engine that mean it must not serve again propagate
    out of :meth:`run`; anything else (Redis away for a moment) is logged and retried.
    """

    def __init__(self, r: redis.Redis, sync_key: str, worker_id: str, engine: SyncEngine, timeout_s: float,
                 latest_checkpoint: Callable[[], Checkpoint | None],
                 on_synced: Callable[[Synced], None], on_failed: Callable[[str], None],
                 on_incarnation: Callable[[str], Awaitable[None]], fatal: tuple[type[Exception], ...] = ()):
        self.r, self.sync_key, self.worker_id = r, sync_key, worker_id
        self.engine, self.timeout_s = engine, timeout_s
        self.latest_checkpoint = latest_checkpoint
        self.on_synced, self.on_failed, self.on_incarnation = on_synced, on_failed, on_incarnation
        self.fatal = fatal
        self.generation = 0  # the number of the newest generation seen
        self.seen: set[tuple[int, str]] = set()  # the identity (number, id) of every generation seen
        self.incarnation = new_incarnation()
        self.held = {self.incarnation}  # every incarnation this follower has had
        self.token = sync_token()
        self.joined = False
        self.manifest: Manifest | None = None  # the joined generation's, parsed once

    async def run(self, stopping: asyncio.Event, poll_s: float = 0.05) -> None:
        await self.catch_up()
        must_receive = False
        while not stopping.is_set():
            try:
                st = await asyncio.to_thread(read_sync, self.r, self.sync_key)
                if st.generation and st.identity not in self.seen:
                    must_receive = await self.join(st)
                if self.joined and (must_receive or st.version > self.engine.version):
                    must_receive = not await self.update(st.version)
            except asyncio.CancelledError:
                raise
            except self.fatal:
                raise
            except Exception as e:  # Redis hiccup: keep serving, try again
                log.warning("sync follower: %r", e)
            await asyncio.sleep(poll_s)

    async def join(self, st: SyncState) -> bool:
        """Join a generation not seen before, or stay out of it; True when joined. Its
        manifest is parsed here, once: the engine keeps it for the generation."""
        self.seen.add(st.identity)
        self.generation, self.joined, self.manifest = st.generation, False, None
        candidate = st.candidate_of(self.worker_id)
        if candidate is None:
            await self.ask_back("a generation formed without this worker")
            return False
        res = await self.check_in(st, candidate)
        self.joined = res.ok
        if not res.ok:
            self.on_failed(res.error)
            # A refusal is not mended from disk (and a checkpoint's error would hide it): only asked back.
            await self.ask_back(res.error, catch_up=not res.refused)
        return res.ok

    async def check_in(self, st: SyncState, candidate: int) -> SyncOutcome:
        """Have the engine check in to generation ``st`` as ``candidate`` (or refuse it), once
        its manifest proved to be the one its hash names (see the module docstring)."""
        st = await self._learners_manifest(st)
        if manifest_hash(st.manifest) != st.manifest_hash:
            why = (f"generation {st.generation}'s manifest is not the one its manifest_hash {st.manifest_hash!r} "
                   f"names (the sync hash was rewritten?): skipped")
            log.warning("sync follower: %s", why)
            return SyncOutcome.failed(why)
        try:
            self.manifest = Manifest.from_json(st.manifest)
        except (ValueError, KeyError, TypeError) as e:
            return SyncOutcome.failed(f"generation {st.generation}'s manifest is unreadable: {e!r}")
        listed = st.incarnation_of(self.worker_id)
        slot = check_in_slot(self.token, st.generation, candidate, self.worker_id,
                             listed if listed in self.held else self.incarnation, st.manifest_hash)
        return await self.engine.join(st.master_addr, st.master_port, slot, st.generation, self.manifest,
                                      self.timeout_s)

    async def _learners_manifest(self, st: SyncState) -> SyncState:
        """``st`` with the manifest the learner published on its own store (weight_sync/transport.py
        ``publish_manifest``), where the sync hash's differs from it: the store takes no client
        without the token, Redis takes any writer, so a manifest or hash rewritten there is
        replaced here, and the worker checks in for the learner's own, at once. (Without it the
        worker skipped the generation and the learner waited out its check-in deadline, a minute
        of training per forgery.) A store that cannot be read leaves ``st`` as it is."""
        try:
            own = await asyncio.to_thread(read_manifest, st.master_addr, st.master_port, st.generation,
                                          self.timeout_s, self.token)
        except Exception as e:  # noqa: BLE001 - unreachable store: the join below fails and says so
            log.debug("sync follower: generation %d's store unreadable (%r)", st.generation, e)
            return st
        if own is None or (own == st.manifest and manifest_hash(own) == st.manifest_hash):
            return st
        log.warning("sync follower: generation %d's manifest in Redis is not the one on the learner's store "
                    "(rewritten in the sync hash?): checking in for the learner's", st.generation)
        return replace(st, manifest=own, manifest_hash=manifest_hash(own))

    async def update(self, version: int) -> bool:
        """Receive and load ``version`` of the joined generation; out of it when that fails."""
        res = await self.engine.update(version, self.manifest)
        if res.ok:
            self.on_synced(Synced(self.engine.version, "learner", self.generation, res.timings,
                                  res.activated_at or time.time()))
            return True
        self.joined = False
        self.on_failed(res.error)
        await self.ask_back(res.error)
        return False

    async def catch_up(self) -> None:
        """Load the newest checkpoint on disk if it is newer than the engine's weights."""
        ckpt = await asyncio.to_thread(self.latest_checkpoint)
        if ckpt is None or ckpt.version <= self.engine.version:
            return
        res = await self.engine.load_checkpoint(ckpt.path, ckpt.version, ckpt.quant_profile)
        if res.ok:
            log.info("caught up to version %d from %s", ckpt.version, ckpt.path)
            self.on_synced(Synced(self.engine.version, "checkpoint", self.generation, res.timings,
                                  res.activated_at or time.time()))
        else:
            self.on_failed(res.error)

    async def ask_back(self, why: str, catch_up: bool = True) -> None:
        log.info("out of the sync generation (%s): %sasking back in", why, "catching up from disk, " * catch_up)
        if catch_up:
            await self.catch_up()
        self.incarnation = new_incarnation()
        self.held.add(self.incarnation)
        await self.on_incarnation(self.incarnation)
