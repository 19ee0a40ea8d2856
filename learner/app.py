"""The learner's HTTP interface: ``/healthz``, ``/metrics`` (Prometheus) and ``/status`` (JSON;
needs the bearer token when ``RLPIPE_API_TOKEN`` is set, see rlpipe/auth.py).

Served by uvicorn in a daemon thread next to the training loop; it only reads the
learner's state.
"""

from __future__ import annotations

import threading

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rlpipe.auth import api_token, require_token
from rlpipe.proc import bind_socket


def create_app(learner) -> FastAPI:
    app = FastAPI(title="rlpipe learner", version="1")

    @app.get("/healthz")
    def healthz():
        return {"status": "ok"}

    @app.get("/metrics")
    def metrics():
        return Response(generate_latest(learner.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status", dependencies=[require_token(api_token())])
    def status():
        return learner.snapshot()

    return app


def serve_in_thread(learner, host: str, port: int) -> str:
    """Start the app; returns the bound ``host:port``. (uvicorn leaves signals alone outside
    the main thread, so SIGTERM still reaches the training loop.)"""
    import uvicorn

    sock = bind_socket(host, port)
    server = uvicorn.Server(uvicorn.Config(create_app(learner), log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="learner-http", daemon=True).start()
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"
