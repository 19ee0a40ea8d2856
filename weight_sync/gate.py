"""The gate in front of the learner's sync store: only holders of the sync token get through.

torch's ``TCPStore`` authenticates nobody, and its server is not built to face strangers.
Measured with torch 2.13 (tests/test_sync_auth.py checks the first point):

- any client can list, overwrite and delete every key, so no key name is a secret and a
  check-in written by a worker can be overwritten after it;
- it listens on every interface whatever host it is given;
- its libuv server resolves each new peer's address by reverse DNS on its only thread:
  here about one connection in 50 (IPv4-mapped peers, not in /etc/hosts) stalled every
  client of the store for 5 s, and a peer that controls its own reverse zone can make
  each of its connections do so;
- it parses a partly received request from its start again on every read: one
  never-finished 125 MiB multi-key request kept it busy for ~10 minutes, stalling the
  others by up to 4 s per read (1 GiB is allowed).

So the store listens on IPv4 loopback only (handed a socket bound there, where peers
resolve from /etc/hosts), and workers reach it through a :class:`Gate` on ``sync.host``.

The handshake is mutual, and the pipe after it is authenticated (issue 33, item 10: the
gate used to prove nothing to the worker, so whoever could write ``master_port`` in Redis
could relay a worker's proof to the real gate and then read and write the store, or
stand in for the store and feed the worker forged addresses):

1. the gate sends a random nonce ``g``;
2. the worker answers its own nonce ``w`` and ``mac(token, "worker", g, w)``;
3. the gate checks it (``hmac.compare_digest``) and answers ``ACCEPTED`` and
   ``mac(token, "gate", g, w)``, which the worker checks: a gate without the token is
   refused;
4. every byte after it travels in frames ``length | data | mac(key, seq, data)``, under a
   key per direction derived from the token and both nonces, with a counter per direction.
   A relay in the middle can pass frames on (the worker's own requests), but cannot add,
   change, drop-and-reorder or replay one: the gate closes the connection at the first
   frame that fails, before anything reaches the store.

Anything else is closed unread after at most ``handshake_s``. Fresh nonces on both sides
mean a recorded handshake or frame cannot be replayed on another connection. On the worker,
:class:`GateClient` proves the token and relays the one connection its ``TCPStore`` client
makes, and only that one: its loopback port is open to every local process, and one that
connected first would get the authenticated pipe (it happened in tests/test_sync_auth.py:
the flood's connection to a just-closed gate's port reached a relay that had been given
the same port number), so it checks that the peer is a socket of its own process.
Bytes after the handshake are authenticated, not encrypted: someone on the network path
can read what a worker asks the store (no secret travels there), not write. Local users
of the learner's host can still reach the store's loopback port. Gloo's own
connections, which carry the weights between addresses the members exchange through
this store, are not gated.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import socket
import threading

import psutil

log = logging.getLogger(__name__)

NONCE_BYTES = 32
ACCEPTED = b"\x01"
# The gate's accept queue (the kernel caps it at net.core.somaxconn): a flood's connections,
# often closed before the gate accepts them, must not fill it, or a real worker's connection
# waits for a SYN retransmission (1 s, then 3 s, 7 s...) and misses its generation.
GATE_BACKLOG = 4096


MAC_BYTES = 32
# A frame's data is at most what one read returns (the pumps read 64 KiB): a longer length
# is an attack or a desync, and closes the connection before anything is allocated.
MAX_FRAME = 1 << 16


def proof(token: str, role: bytes, gate_nonce: bytes, worker_nonce: bytes) -> bytes:
    """``role`` ("worker", "gate", "up", "down") keeps each side's proof and each
    direction's key apart, so one can never be replayed as the other."""
    return hmac.new(token.encode(), b"rlpipe-sync-gate|" + role + b"|" + gate_nonce + worker_nonce,
                    hashlib.sha256).digest()


class ForgedFrame(ConnectionError):
    """A frame whose length or MAC fails: changed, injected or replayed on the way."""


class FrameMac:
    """One direction's frames: ``len (4) | data | hmac(key, seq (8) | data)``, seq counting
    from 0, so a frame cannot be altered, dropped, reordered or replayed unnoticed."""

    def __init__(self, key: bytes):
        self.key, self.seq = key, 0

    def _mac(self, data: bytes) -> bytes:
        mac = hmac.new(self.key, self.seq.to_bytes(8, "big") + data, hashlib.sha256).digest()
        self.seq += 1
        return mac

    def seal(self, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + data + self._mac(data)

    def length(self, header: bytes) -> int:
        n = int.from_bytes(header, "big")
        if not 0 < n <= MAX_FRAME:
            raise ForgedFrame(f"a sync frame of {n} bytes")
        return n

    def open(self, data: bytes, mac: bytes) -> bytes:
        if not hmac.compare_digest(mac, self._mac(data)):
            raise ForgedFrame("a sync frame failed its MAC (changed, injected or replayed)")
        return data


def session_macs(token: str, gate_nonce: bytes, worker_nonce: bytes) -> tuple[FrameMac, FrameMac]:
    """(worker-to-gate, gate-to-worker) frame keys of one connection."""
    return (FrameMac(proof(token, b"up", gate_nonce, worker_nonce)),
            FrameMac(proof(token, b"down", gate_nonce, worker_nonce)))


def listening_socket(host: str, backlog: int = 128) -> socket.socket:
    """A socket listening on ``host`` only (not every interface), on a port the OS picks."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, 0), family=family, backlog=backlog)


class Gate:
    """Accepts on ``host`` and forwards connections that prove ``token`` to the store on
    loopback ``store_port``; everything runs on one asyncio loop in a daemon thread, so a
    flood of connections costs sockets, not threads. At most ``max_pending`` connections
    may be mid-handshake, so a flood cannot take every file descriptor of the learner; a
    new one beyond that closes the *oldest*, not itself. Refusing the newest instead let
    ``max_pending`` silent connections, renewed every ``handshake_s`` (~50 a second), turn
    every real worker away; now a flood must open ``max_pending`` connections within one
    worker's handshake round trip to cut it off."""

    def __init__(self, host: str, store_port: int, token: str, handshake_s: float = 5.0, max_pending: int = 256):
        self.store_port, self.token = store_port, token
        self.handshake_s, self.max_pending = handshake_s, max_pending
        self.refused = self.admitted = self.forged = 0
        self._handshaking: dict[asyncio.StreamWriter, None] = {}  # mid-handshake, the oldest first
        self._closing = False
        self._writers: set[asyncio.StreamWriter] = set()
        sock = listening_socket(host, GATE_BACKLOG)
        self.port = sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlpipe-sync-gate", daemon=True)
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._serve, sock=sock, backlog=GATE_BACKLOG))

    def _call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing:
            writer.close()
            return
        self._writers.add(writer)
        upstream = None
        try:
            nonces = await self._handshake(reader, writer)
            if nonces is None:
                self.refused += 1
                return
            up_reader, upstream = await asyncio.open_connection("127.0.0.1", self.store_port)
            self._writers.add(upstream)
            self.admitted += 1
            writer.write(ACCEPTED + proof(self.token, b"gate", *nonces))
            up, down = session_macs(self.token, *nonces)
            await asyncio.gather(_unseal_pipe(reader, upstream, up, self), _seal_pipe(up_reader, writer, down))
        except OSError as e:  # the store is gone (the generation was dropped)
            log.debug("sync gate: %r", e)
        finally:
            for w in (writer, upstream):
                if w is not None:
                    w.close()
                    self._writers.discard(w)

    async def _handshake(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> tuple[bytes, bytes] | None:
        """The (gate, worker) nonces of a worker that proved the token; None otherwise."""
        if len(self._handshaking) >= self.max_pending:
            oldest = next(iter(self._handshaking))
            del self._handshaking[oldest]
            oldest.close()  # its read ends, and it is refused
        self._handshaking[writer] = None
        try:
            nonce = os.urandom(NONCE_BYTES)
            writer.write(nonce)
            reply = await asyncio.wait_for(reader.readexactly(NONCE_BYTES + MAC_BYTES), self.handshake_s)
            theirs, mac = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
            return (nonce, theirs) if hmac.compare_digest(mac, proof(self.token, b"worker", nonce, theirs)) else None
        except (OSError, EOFError, asyncio.TimeoutError):  # closed, reset, or silent past handshake_s
            return None
        finally:
            self._handshaking.pop(writer, None)

    @property
    def pending(self) -> int:
        """Connections mid-handshake."""
        return len(self._handshaking)

    def close(self) -> None:
        """Stop accepting and close every connection, the relayed ones included."""
        if self._loop.is_closed():
            return

        async def shut():
            self._closing = True
            self._server.close()
            for w in list(self._writers):
                w.close()  # each connection's reads then end, and so does its task
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if tasks:
                await asyncio.wait(tasks, timeout=5)

        try:
            self._call(shut())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
        if self.refused:
            log.warning("sync gate on port %d refused %d connections that did not prove the sync token",
                        self.port, self.refused)


async def _seal_pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, mac: FrameMac) -> None:
    """The store's answers to the worker, each read sealed as one frame."""
    try:
        while data := await reader.read(MAX_FRAME):
            writer.write(mac.seal(data))
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()  # the other direction then ends too: the store's protocol never half-closes


async def _unseal_pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, mac: FrameMac,
                       gate: Gate) -> None:
    """The worker's frames to the store, each checked before a byte of it is passed on."""
    try:
        while True:
            n = mac.length(await reader.readexactly(4))
            data = await reader.readexactly(n)
            writer.write(mac.open(data, await reader.readexactly(MAC_BYTES)))
            await writer.drain()
    except ForgedFrame as e:
        gate.forged += 1
        log.warning("sync gate: closed a connection: %s", e)
    except (OSError, EOFError):  # asyncio.IncompleteReadError included: the worker closed
        pass
    finally:
        writer.close()


class GateUnproven(ConnectionError):
    """A gate answered without proving the sync token: someone else's, not the learner's."""


class GateClient:
    """A worker's way through the gate at ``host:port``: proves ``token`` at once (raising
    ``ConnectionError`` if the gate refuses it), then relays the first connection made to
    its loopback ``port`` (the worker's ``TCPStore`` client makes exactly one) to the store."""

    def __init__(self, host: str, port: int, token: str, timeout_s: float):
        self.local: socket.socket | None = None
        self.upstream = socket.create_connection((host, port), timeout=timeout_s)
        try:
            theirs, mine = _recv_exactly(self.upstream, NONCE_BYTES), os.urandom(NONCE_BYTES)
            self.upstream.sendall(mine + proof(token, b"worker", theirs, mine))
            if _recv_exactly(self.upstream, 1) != ACCEPTED:
                raise ConnectionError("unexpected answer")
            if not hmac.compare_digest(_recv_exactly(self.upstream, MAC_BYTES), proof(token, b"gate", theirs, mine)):
                raise GateUnproven(f"the sync gate at {host}:{port} let this worker in without proving the "
                                   "sync token: not the learner's gate (a forged sync address in Redis?)")
        except GateUnproven:
            self.upstream.close()
            raise
        except OSError as e:  # ConnectionError and timeouts included
            self.upstream.close()
            raise ConnectionError(f"the sync gate at {host}:{port} did not let this worker in "
                                  f"(is RLPIPE_SYNC_TOKEN the learner's?): {e}") from e
        self.up, self.down = session_macs(token, theirs, mine)
        self.upstream.settimeout(None)  # from here on the store's own timeouts apply
        # Room for strays (turned away in _relay) queued before the store client's connection.
        self.listener = listening_socket("127.0.0.1", backlog=16)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._relay, name="rlpipe-sync-relay", daemon=True).start()

    def _relay(self) -> None:
        try:
            while True:
                conn, _ = self.listener.accept()
                if _from_this_process(conn):
                    self.local = conn
                    break
                log.warning("sync relay: refused a connection from another local process")
                conn.close()
        except OSError:  # closed before the store connected
            return
        finally:
            self.listener.close()  # one connection only
        threading.Thread(target=_pump, args=(self.local, self.upstream, self.up.seal), daemon=True).start()
        _pump(self.upstream, self.local, unseal=self.down)

    def close(self) -> None:
        for s in (self.listener, self.local, self.upstream):
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()


def _from_this_process(conn: socket.socket) -> bool:
    """Whether the peer of a loopback connection is a socket of this process."""
    host, port = conn.getpeername()[:2]
    return any(c.laddr and c.laddr.port == port and c.laddr.ip.removeprefix("::ffff:") == host
               for c in psutil.Process().net_connections("tcp"))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed by the gate")
        data += chunk
    return bytes(data)


def _pump(src: socket.socket, dst: socket.socket, seal=None, unseal: FrameMac | None = None) -> None:
    """Copies ``src`` to ``dst`` until either closes: sealing each read as a frame, or
    passing on only frames whose MAC holds (a failed one closes both)."""
    try:
        if unseal is None:
            while data := src.recv(MAX_FRAME):
                dst.sendall(seal(data))
        while unseal is not None:
            n = unseal.length(_recv_exactly(src, 4))
            dst.sendall(unseal.open(_recv_exactly(src, n), _recv_exactly(src, MAC_BYTES)))
    except ForgedFrame as e:
        log.warning("sync relay: closed the store connection: %s", e)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_RDWR)  # wakes the pump of the other direction
        except OSError:
            pass
