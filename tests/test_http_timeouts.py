"""Header and body deadlines on rlpipe's HTTP servers (rlpipe/http_timeouts.py): a slow-loris
client, trickling its header or its body, is cut off within the timeout, while other
clients are served and a request whose body has arrived is never cut, however long it takes.

The learner's server is the real one (learner/app.py ``serve_in_thread``, which only reads
the learner's config until a request asks for its state); the body deadline is shown on a
small app that reads its body, as the rollout worker's POST routes do (the worker's own
wiring: tests/test_api.py)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import SimpleNamespace

import httpx
from fastapi import FastAPI, Request

from rlpipe.config import build_config
from rlpipe.http_timeouts import timed_http
from rlpipe.proc import bind_socket

HEADER_S, BODY_S = 1.0, 1.0
SLACK_S = 6.0  # a loaded machine's scheduling


def learner_http() -> str:
    from learner.app import serve_in_thread

    cfg = build_config({}, environ={}, **{"learner.http_header_timeout_s": HEADER_S,
                                          "learner.http_body_timeout_s": BODY_S})
    return serve_in_thread(SimpleNamespace(cfg=cfg), "127.0.0.1", 0)


def trickle(address: str, first: bytes, byte: bytes, every_s: float = 0.1) -> tuple[float, bytes]:
    """Send ``first``, then ``byte`` every ``every_s`` until the server closes the connection;
    returns how long that took and what the server answered meanwhile. Between bytes,
    another client must be served."""
    host, port = address.rsplit(":", 1)
    answered = b""
    with socket.create_connection((host, int(port))) as sock:
        opened = time.monotonic()
        sock.sendall(first)
        sock.settimeout(every_s)
        while time.monotonic() - opened < HEADER_S + BODY_S + SLACK_S:
            try:
                sock.sendall(byte)
                data = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:  # reset by the server
                break
            if data == b"":
                break
            answered += data
        return time.monotonic() - opened, answered


def test_the_learners_http_cuts_off_a_header_sent_byte_by_byte():
    address = learner_http()
    served = []

    def others():
        while not done.is_set():
            served.append(httpx.get(f"http://{address}/healthz", timeout=10).status_code)
            time.sleep(0.2)

    done = threading.Event()
    other = threading.Thread(target=others)
    other.start()
    try:
        took, answered = trickle(address, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ", b"a")
    finally:
        done.set()
        other.join()
    assert HEADER_S - 0.2 <= took < HEADER_S + SLACK_S, f"cut after {took:.1f}s"
    assert answered == b"" and served and set(served) == {200}


def test_a_learner_node_other_than_0_cuts_off_a_header_sent_byte_by_byte():
    """learner/node_health.py's /healthz (nodes other than 0) is the standard library's server,
    whose socket timeout bounds one read: a header trickled a byte every 0.1 s held its thread
    for as long as the client liked. It is cut TIMEOUT_S after connecting, and a probe that
    sends its request at once is still answered."""
    from learner.node_health import TIMEOUT_S, serve_node_health

    store = socket.create_server(("127.0.0.1", 0))
    try:
        address = serve_node_health("127.0.0.1", 0, f"127.0.0.1:{store.getsockname()[1]}", node_rank=1)
        took, answered = trickle(address, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ", b"a")
        # trickle gives up by itself after 8 s: a cut comes well before
        assert answered == b"" and TIMEOUT_S - 0.2 <= took < TIMEOUT_S + 3, f"cut after {took:.1f}s"
        assert httpx.get(f"http://{address}/healthz", timeout=10).status_code == 200
    finally:
        store.close()


def test_the_learners_http_cuts_off_a_body_sent_byte_by_byte():
    """/healthz answers without reading the body; the rest of it, trickled, still has to
    stop: the connection is closed by the next header's deadline."""
    address = learner_http()
    took, answered = trickle(address, b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n", b"a")
    assert answered.startswith(b"HTTP/1.1 200")
    assert took < HEADER_S + SLACK_S, f"cut after {took:.1f}s"


def serve_app(app: FastAPI, header_s: float, body_s: float) -> str:
    import uvicorn

    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=timed_http(header_s, body_s)))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


def test_a_body_must_follow_its_header_in_time_and_a_long_request_is_never_cut():
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        body = await request.body()
        await asyncio.sleep(float(request.query_params.get("think", 0)))
        return {"bytes": len(body)}

    address = serve_app(app, header_s=30.0, body_s=BODY_S)  # only the body's deadline can cut here
    took, answered = trickle(address, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n", b"a")
    assert answered == b"" and BODY_S - 0.2 <= took < BODY_S + SLACK_S, f"cut after {took:.1f}s"
    # a whole body, then a handler that takes longer than both deadlines: served
    resp = httpx.post(f"http://{address}/echo", params={"think": 2 * BODY_S + 0.5}, content=b"x" * 1000, timeout=30)
    assert resp.status_code == 200 and resp.json() == {"bytes": 1000}
