"""Run one rollout worker: ``rlpipe rollout --config run.yaml --worker-id w0``.

Serves the FastAPI app with uvicorn on ``rollout.host:rollout.port`` (port 0 = any free
port; the address is published in the worker registry and, with ``--address-file``,
written to a file once the socket is bound).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from rlpipe.config import RunConfig
from rlpipe.proc import bind_socket

log = logging.getLogger(__name__)


def apply_cpu_affinity() -> None:
    """Pin this worker (and the engine process it starts) to ``RLPIPE_CPU_AFFINITY``
    (e.g. ``"1"`` or ``"0-3"``), as the launcher does to give each worker its own cores."""
    spec = os.environ.get("RLPIPE_CPU_AFFINITY", "")
    if not spec:
        return
    cpus = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    os.sched_setaffinity(0, cpus)


def serve(cfg: RunConfig, worker_id: str, address_file: str | None = None) -> None:
    import uvicorn

    apply_cpu_affinity()

    from rollout_service.app import create_app

    sock = bind_socket(cfg.rollout.host, cfg.rollout.port)
    host, port = sock.getsockname()[:2]
    address = f"{host}:{port}"
    if address_file:
        Path(address_file).write_text(address)
    app = create_app(cfg, worker_id, address)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=15))
    server.run(sockets=[sock])
    if app.state.fatal:
        raise SystemExit(f"rollout worker {worker_id} stopped: {app.state.fatal}")
