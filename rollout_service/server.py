"""Run one rollout worker: ``rlpipe rollout --config run.yaml --worker-id w0``.

Serves the FastAPI app with uvicorn on ``rollout.host:rollout.port`` (port 0 = any free
port; the address is published in the worker registry and, with ``--address-file``,
written to a file once the socket is bound).

A connection must send each request's whole header within ``rollout.http_header_timeout_s``,
and its whole body within ``rollout.http_body_timeout_s`` of the header
(rlpipe/http_timeouts.py); uvicorn alone waits forever for either.

SIGTERM (what Kubernetes sends) drains: the worker stops taking prompts at once, lets
the groups in flight finish for ``rollout.shutdown_deadline_s``, aborts the rest and gives
their prompts back to the shared cursor, then leaves the registry and exits.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from rlpipe.config import RunConfig
from rlpipe.http_timeouts import timed_http
from rlpipe.proc import bind_socket

log = logging.getLogger(__name__)


def check_tokenizer(cfg: RunConfig) -> None:
    """``task.chat_template`` with a tokenizer that has none, or a ``rollout.chat_template`` file
    that cannot be read: exit 2 naming the field, before the socket, Redis and the engine (a
    failure in the app's start-up would be uvicorn's exit 3 after a traceback)."""
    from rlpipe.config import ConfigError
    from rollout_service.sessions import load_chat_template

    try:
        if cfg.rollout.chat_template:  # its text, or a file: no tokenizer needed to read it
            load_chat_template(cfg.rollout.chat_template, None)
        if cfg.task.chat_template:
            from transformers import AutoTokenizer

            from rollout_service.tasks import PromptEncoder

            PromptEncoder(cfg.task, AutoTokenizer.from_pretrained(cfg.model.path), cfg.model.path)
    except ConfigError as e:
        print(f"rlpipe: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def serve(cfg: RunConfig, worker_id: str, address_file: str | None = None) -> None:
    import uvicorn

    check_tokenizer(cfg)

    from rollout_service.app import create_app

    sock = bind_socket(cfg.rollout.host, cfg.rollout.port)
    host, port = sock.getsockname()[:2]
    address = f"{host}:{port}"
    if address_file:
        Path(address_file).write_text(address)
    redis_client = None
    if cfg.redis_url:  # before the engine starts: waits for Redis (saying so) up to redis_wait_s
        from rlpipe.redis_link import connect

        redis_client = connect(cfg.redis_url, cfg.redis_wait_s)
    app = create_app(cfg, worker_id, address, redis_client)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # Stop taking prompts the moment SIGTERM arrives, not after uvicorn has drained
            # its connections; the groups in flight get rollout.shutdown_deadline_s at shutdown.
            if self.started and not self.should_exit:
                asyncio.get_running_loop().call_soon_threadsafe(app.state.worker.drain)
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal once it has shut down, so the process would die
            # "by SIGTERM" even after a clean drain; exit 0 instead (1 after a fatal error).
            getattr(self, "_captured_signals", []).clear()

    server = Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=15,
                                   http=timed_http(cfg.rollout.http_header_timeout_s,
                                                   cfg.rollout.http_body_timeout_s)))
    server.run(sockets=[sock])
    if app.state.worker.fatal:
        raise SystemExit(f"rollout worker {worker_id} stopped: {app.state.worker.fatal}")
