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

Authentication (docs/design.md, 'Prompt leases and sync authentication'). With a sync token
(``RLPIPE_SYNC_TOKEN``, by default ``RLPIPE_API_TOKEN``; rlpipe/auth.py) the store is only
reachable through the token-checking gate of weight_sync/gate.py, and a check-in carries
``hmac_sha256(token, generation|worker_id|incarnation|manifest_hash)``: the candidate
checks in *under* that MAC, at ``rlpipe/gen{g}/in/{mac}``, and reads its answer at
``rlpipe/gen{g}/go/{mac}`` (:func:`check_in_slot`). The learner knows each candidate's id
and incarnation (the Redis registry) and the manifest, computes the MAC it expects and
reads that key and no other. So a check-in with any other MAC (a wrong token, another
generation's replayed, a stale incarnation, another manifest) lands on a key nobody
reads and is left out as not checked in; and since every candidate has a key of its own
that only a token holder can name, nothing written first or later under any other key
can take a candidate's rank or lock it out. (The MAC is the key's name, so no MAC from
the wire is compared in Python; the gate's handshake is, with ``hmac.compare_digest``.)
A plain slot (the candidate's number, as before) would not do even behind the gate:
whoever writes ``in/{c}`` last wins, a stale process of the worker included.

Without any token (a local run on a loopback ``sync.host``; the learner refuses a
reachable one, rlpipe.auth.check_sync_exposure) candidates check in under their number,
unauthenticated, on a store that listens on ``sync.host`` only.

Under ``sync.transport: nccl`` this group stays the control plane (admission, the NCCL
handshake, each version's header) and the weights travel over NCCL (weight_sync/nccl.py).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import socket
import time
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import ProcessGroupGloo

from weight_sync.gate import Gate, GateClient, listening_socket

if TYPE_CHECKING:
    from weight_sync.stragglers import StragglerRule


class SyncError(RuntimeError):
    """A collective failed or timed out; the caller keeps its previous weights."""


class LeftOut(SyncError):
    """This worker checked in too late (or refused): the generation formed without it."""


class IncompatibleWorker(RuntimeError):
    """A worker refused the generation: its engine cannot load these weights (a tensor its
    model lacks or shapes differently, another quantization). Not a transient failure, as a
    :class:`SyncError` is: no later generation would reach it, and a learner whose only
    workers refuse would wait for groups forever, so the learner stops and says why."""


NOT_CHECKED_IN = "did not check in before the deadline"


def _key(generation: int, what: str) -> str:
    return f"rlpipe/gen{generation}/{what}"


def check_in_mac(token: str, generation: int, worker_id: str, incarnation: str, manifest_hash: str) -> str:
    """docs/design.md's check-in MAC: ``hmac_sha256(token, generation|worker_id|incarnation|manifest_hash)``, hex."""
    message = f"{generation}|{worker_id}|{incarnation}|{manifest_hash}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def check_in_slot(token: str | None, generation: int, candidate: int, worker_id: str, incarnation: str,
                  manifest_hash: str) -> str:
    """Where a candidate checks in and reads its answer: under its check-in MAC with a
    token, under its candidate number (unauthenticated) without one."""
    if token is None:
        return str(candidate)
    return check_in_mac(token, generation, worker_id, incarnation, manifest_hash)


def admit(store: TCPStore, generation: int, slots: list[str], deadline: float) -> tuple[list[int], dict[int, str]]:
    """The learner's half of forming a generation: wait (until the monotonic ``deadline``)
    for candidates ``1..len(slots)`` to check in, candidate ``c`` under ``slots[c - 1]``
    (:func:`check_in_slot`), then answer each one under its slot.

    Returns the admitted candidates and, for those left out, why. Admitted candidate ``c``
    gets rank ``admitted.index(c) + 1`` in a world of ``1 + len(admitted)``. Keys under any
    other slot are never read: they cannot admit anyone, delay the answer, or fail it.
    """
    keys = {c: _key(generation, f"in/{slot}") for c, slot in enumerate(slots, 1)}
    try:
        store.wait(list(keys.values()), datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
    except Exception:  # some never checked in: the deadline passed
        pass
    admitted, left_out = [], {}
    for c, key in keys.items():
        if not store.check([key]):
            left_out[c] = NOT_CHECKED_IN
            continue
        answer = store.get(key).decode(errors="replace")[:500]  # "ok", or the candidate's refusal
        if answer == "ok":
            admitted.append(c)
        else:
            left_out[c] = answer
    world = 1 + len(admitted)
    for c, slot in enumerate(slots, 1):
        answer = {"rank": admitted.index(c) + 1, "world": world} if c in admitted else {"left_out": left_out[c]}
        store.set(_key(generation, f"go/{slot}"), json.dumps(answer))
    return admitted, left_out


def check_in(store: TCPStore, generation: int, slot: int | str, timeout_s: float,
             refuse: str | None = None) -> tuple[int, int]:
    """A worker's half: check in under ``slot`` (:func:`check_in_slot`; or refuse there,
    saying why) and wait for the learner's answer there.

    Returns ``(rank, world_size)``; raises :class:`LeftOut` when the generation formed
    without this worker and :class:`SyncError` when no answer came in time (as happens
    to a check-in the learner does not expect, e.g. one with a stale incarnation)."""
    store.set(_key(generation, f"in/{slot}"), "ok" if refuse is None else refuse)
    if refuse is not None:
        # A set is not answered: a round trip makes sure the refusal reached the store
        # before the caller closes the connection (and, with a token, its relay). The
        # learner may close its store first, as it stops on reading the refusal: out either way.
        try:
            store.check([_key(generation, f"in/{slot}")])
        except Exception:
            pass
        raise LeftOut(refuse)
    try:
        store.wait([_key(generation, f"go/{slot}")], datetime.timedelta(seconds=timeout_s))
        go = json.loads(store.get(_key(generation, f"go/{slot}")))
    except Exception as e:
        raise SyncError(f"generation {generation} was never confirmed: {e}") from e
    if "rank" not in go:
        raise LeftOut(f"generation {generation} formed without this worker: {go['left_out']}")
    return go["rank"], go["world"]


def publish_manifest(store: TCPStore, generation: int, manifest_json: str) -> None:
    """The learner's own manifest of ``generation``, on its store: a copy the sync hash's
    can be checked against by whoever holds the token (or, without one, is on this host)."""
    store.set(_key(generation, "manifest"), manifest_json)


def read_manifest(host: str, port: int, generation: int, timeout_s: float, token: str | None) -> str | None:
    """The manifest the learner published for ``generation`` on its store (:func:`publish_manifest`),
    or None where it published none; raises what a connection to the store raises."""
    store, relay = GlooGroup.connect(host, port, timeout_s, token)
    try:
        key = _key(generation, "manifest")
        return store.get(key).decode() if store.check([key]) else None
    finally:
        del store
        if relay is not None:
            relay.close()


def local_address_towards(host: str) -> str:
    """The address of this machine's interface that routes to ``host`` (127.0.0.1 for a
    loopback ``host``). Connecting a UDP socket picks the route without sending anything."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


class GlooGroup:
    """Rank 0 is the learner; ranks 1..world-1 are rollout workers.

    The learner holds one two-rank gloo group *per member* (a "pair"), not one group of
    everyone: gloo's timed-out send closes every pair of its context, so in one shared group
    a member that stopped reading cost every member the version (issue 33, item 1). With a
    pair each, a member that falls behind is given up on alone (:meth:`abandon`) and the
    others go on receiving, in the same generation. A group of everyone is formed only where
    a collective is asked for (:meth:`broadcast`, the benchmark's baseline)."""

    def __init__(self, store: TCPStore, rank: int, world_size: int, host: str, generation: int,
                 timeout_s: float, join_timeout_s: float):
        """Blocks until all ``world_size`` ranks joined (at most ``join_timeout_s`` a pair);
        every later operation fails after at most ``timeout_s``."""
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.generation = generation
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._opts = ProcessGroupGloo._Options()
        self._opts._timeout = datetime.timedelta(seconds=join_timeout_s)
        # gloo binds each rank's pairs to a local interface: the learner's is ``host`` itself,
        # a worker's the one that routes to it (``host`` is not an address of a worker's pod).
        self._opts._devices = [ProcessGroupGloo.create_device(
            hostname=host if rank == 0 else local_address_towards(host))]
        self._world: ProcessGroupGloo | None = None
        self.pairs: dict[int, ProcessGroupGloo] = {}  # peer rank -> its pair (the learner's peers: every member)
        try:
            for peer in range(1, world_size) if rank == 0 else [0]:
                member = max(peer, rank)
                self.pairs[peer] = ProcessGroupGloo(PrefixStore(_key(generation, f"pair{member}/"), store),
                                                    min(rank, 1), 2, self._opts)
        except Exception as e:  # gloo raises RuntimeError/DistStoreError on timeouts
            raise SyncError(f"forming generation {generation} (rank {rank}/{world_size}) failed: {e}") from e

    def _pair(self, peer: int) -> ProcessGroupGloo:
        pair = self.pairs.get(peer)
        if pair is None:
            raise SyncError(f"rank {peer} was given up on in generation {self.generation}")
        return pair

    def abandon(self, peer: int) -> None:
        """Give up on one peer: its pair leaves the group, and the other pairs are untouched.
        (A thread still waiting on one of its sends holds it until that wait times out.)"""
        self.pairs.pop(peer, None)

    def waiter(self, peer: int, work) -> Callable[[], None]:
        """A call that waits for ``work`` (a send to or receive from ``peer``) and holds
        ``peer``'s pair until the wait ends, even once the pair was abandoned: a gloo wait
        cannot be cut short, and one that times out closes every pair of its group (of a
        pair, only its own)."""
        def wait(pair: ProcessGroupGloo | None = self.pairs.get(peer)) -> None:  # the default holds the pair
            self.wait(work)

        return wait

    def finish(self, works: Mapping[int, object], failed: dict[int, str], rule: StragglerRule) -> None:
        """Wait for one send or receive with each member (rank -> work) under ``rule``
        (weight_sync/stragglers.py): a member whose transfer fails goes into ``failed``
        (rank -> why), and one still at it ``rule.straggler_s`` after another member's
        ended is abandoned, so it holds up none of the others' next transfers."""
        rule.wait({rank: self.waiter(rank, work) for rank, work in works.items()}, failed, self.abandon)

    @staticmethod
    def listen(host: str, timeout_s: float, token: str | None) -> tuple[TCPStore, int, Gate | None]:
        """The learner's store, on a port the OS picks; returns ``(store, port to publish,
        gate)``. The store is handed a socket bound to one address (given a port, TCPStore
        would listen on every interface): loopback behind a :class:`Gate` on ``host`` with
        a token, ``host`` itself without one (loopback: WeightSender refuses any other)."""
        sock = listening_socket("127.0.0.1" if token else host)
        bound, port = sock.getsockname()[:2]
        store = TCPStore(bound, port, None, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=sock.detach())
        if token is None:
            return store, port, None
        gate = Gate(host, port, token)
        return store, gate.port, gate

    @staticmethod
    def connect(host: str, port: int, timeout_s: float, token: str | None) -> tuple[TCPStore, GateClient | None]:
        """A worker's client of the learner's store, through the gate when there is a token
        (the caller closes the returned relay after the store)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if token is None:
            # A store that is gone (a generation read before the learner dropped it) refuses at
            # once, but TCPStore's client retries a refusal for its whole timeout and more (seen:
            # 10.7 s), so a worker reached the next generation after its check-in deadline. A
            # plain connection first raises the refusal now (the gate's client does the same).
            socket.create_connection((host, port), timeout=timeout_s).close()
            return TCPStore(host, port, None, is_master=False, timeout=timeout), None
        relay = GateClient(host, port, token, timeout_s)
        try:
            return TCPStore("127.0.0.1", relay.port, None, is_master=False, timeout=timeout), relay
        except Exception:
            relay.close()
            raise

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """One collective broadcast over a group of every rank, formed at the first call on
        each (the benchmark's baseline and barrier; sync itself uses :meth:`send`)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.timeout = self.timeout
        try:
            self.wait(self.world().broadcast([tensor], opts))
        except SyncError:
            raise
        except Exception as e:
            raise SyncError(f"broadcast failed: {e}") from e

    def world(self) -> ProcessGroupGloo:
        """The group of every rank, for collectives: every rank must ask for it."""
        if self._world is None:
            self._world = ProcessGroupGloo(PrefixStore(_key(self.generation, "pg/"), self.store), self.rank,
                                           self.world_size, self._opts)
        return self._world

    def send(self, tensor: torch.Tensor, dst: int, tag: int):
        """Start sending ``tensor`` to one peer; returns the handle for :meth:`wait`.

        Weight sync fans buckets out with one send per worker, each over its own pair,
        instead of a collective broadcast: gloo's broadcast is the same fan-out from the
        root, but point-to-point a dead or stuck worker fails only its own sends, and the
        others still get the version (a failed collective leaves every peer waiting out its
        timeout)."""
        return self._on_pair("send", dst, tensor, tag)

    def post(self, tensor: torch.Tensor, tag: int, ranks: Iterable[int], failed: dict[int, str]) -> dict:
        """Start sending ``tensor`` to each of ``ranks`` not in ``failed`` (rank -> why);
        returns rank -> the handle for :meth:`finish`. A send that cannot start goes into
        ``failed``."""
        works = {}
        for rank in ranks:
            if rank not in failed:
                try:
                    works[rank] = self.send(tensor, rank, tag)
                except SyncError as e:
                    failed[rank] = str(e)
        return works

    def recv(self, tensor: torch.Tensor, src: int, tag: int):
        return self._on_pair("recv", src, tensor, tag)

    def _on_pair(self, op: str, peer: int, tensor: torch.Tensor, tag: int):
        """``op`` (send or recv) of ``tensor`` on the pair group with ``peer`` (the peer is rank 1
        of a pair, the learner rank 0); any failure of gloo's as a :class:`SyncError` naming the peer."""
        try:
            return getattr(self._pair(peer), op)([tensor], 0 if peer == 0 else 1, tag)
        except SyncError:
            raise
        except Exception as e:
            raise SyncError(f"{'send to' if op == 'send' else 'receive from'} rank {peer} failed: {e}") from e

    def wait(self, work) -> None:
        try:
            work.wait(self.timeout)
        except Exception as e:
            raise SyncError(f"transfer failed: {e}") from e

    def close(self) -> None:
        self.pairs.clear()
        self._world = None
        self.store = None
