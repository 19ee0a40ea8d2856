"""The learner's HTTP interface: ``/healthz``, ``/metrics`` (Prometheus) and ``/status`` (JSON;
needs the bearer token when ``RLPIPE_API_TOKEN`` is set, see rlpipe/auth.py).

Served by uvicorn in a daemon thread next to the training loop; it only reads the
learner's state. A connection must send a request's header within
``learner.http_header_timeout_s`` and its body within ``learner.http_body_timeout_s``
(rlpipe/http_timeouts.py): its sockets are the training process's.
"""

from __future__ import annotations

import threading

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rlpipe.auth import api_token, require_token
from rlpipe.http_timeouts import timed_http
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
        return learner_status(learner)

    return app


def learner_status(learner) -> dict:
    """What ``GET /status`` returns: the learner's state, read from its running loop."""
    return {
        "status": learner.status,
        "step": learner.step,
        "version": learner.version,
        "lr": learner.opt.param_groups[0]["lr"],
        "lr_schedule": learner.schedule.state(),
        "training": {"dtype": learner.cfg.learner.dtype, "is_mode": learner.cfg.learner.is_mode,
                     "advantage": learner.cfg.learner.advantage, "loss_agg": learner.cfg.learner.loss_agg,
                     "loss_scale": learner.scaler.scale, "skipped_steps_total": learner.scaler.skipped_steps,
                     "ranks": learner.ranks.world, "parallel": learner.ranks.parallel},
        "checkpoint": {"dir": str(learner.ckpt_root), "last": learner.last_checkpoint,
                       "every": learner.cfg.learner.checkpoint_every, "unacked_groups": len(learner.ledger.not_durable()),
                       "async": learner.cfg.learner.async_checkpoint},
        "trained_groups_total": learner.run_counters.trained_groups,
        **learner.fleet.status(learner.version),
        "dropped_stale_total": learner.run_counters.dropped_stale_total,
        "last_metrics": learner.last_metrics,
    }


def serve_in_thread(learner, host: str, port: int) -> str:
    """Start the app; returns the bound ``host:port``. (uvicorn leaves signals alone outside
    the main thread, so SIGTERM still reaches the training loop.)"""
    import uvicorn

    sock = bind_socket(host, port)
    lc = learner.cfg.learner
    server = uvicorn.Server(uvicorn.Config(create_app(learner), log_level="warning",
                                           http=timed_http(lc.http_header_timeout_s, lc.http_body_timeout_s)))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="learner-http", daemon=True).start()
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"
