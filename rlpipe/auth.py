"""Shared-secret auth: bearer tokens for rlpipe's HTTP APIs, and the weight-sync token.

With ``RLPIPE_API_TOKEN`` set, control and generate endpoints require
``Authorization: Bearer <token>``; health, readiness and metrics stay open so probes and
Prometheus need no secret. A server refuses to listen on a non-loopback address without
a token unless the run sets ``allow_unauthenticated: true`` (e.g. behind an
authenticating proxy): anyone who can reach an open worker can make it generate.

Weight sync uses ``RLPIPE_SYNC_TOKEN`` (by default the API token): workers prove it to
reach the learner's sync store and sign their check-ins with it (weight_sync/gate.py,
weight_sync/transport.py). Without any token the learner's sync store is unauthenticated,
so it then listens on a loopback ``sync.host`` only (:func:`check_sync_exposure`); there is
no opt-out, since an open sync store lets anyone join a generation and receive the weights.
"""

from __future__ import annotations

import hmac
import ipaddress
import os

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from rlpipe.config import ConfigError

TOKEN_ENV = "RLPIPE_API_TOKEN"
SYNC_TOKEN_ENV = "RLPIPE_SYNC_TOKEN"


def api_token() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


def sync_token() -> str | None:
    """The weight-sync secret: ``RLPIPE_SYNC_TOKEN``, else the API token, else None."""
    return os.environ.get(SYNC_TOKEN_ENV) or api_token()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def check_exposure(host: str, field: str, allow_unauthenticated: bool) -> None:
    """Refuse an open API on a reachable address (the error names the config field)."""
    if not is_loopback(host) and api_token() is None and not allow_unauthenticated:
        raise ConfigError(f"{field}: {host!r} is not a loopback address and {TOKEN_ENV} is not set; "
                          f"set a token, or allow_unauthenticated: true to serve without one")


def check_sync_exposure(host: str) -> None:
    """Refuse an unauthenticated sync store on a reachable address (the learner's ``sync.host``)."""
    if not is_loopback(host) and sync_token() is None:
        raise ConfigError(f"sync.host: {host!r} is not a loopback address and neither {SYNC_TOKEN_ENV} nor "
                          f"{TOKEN_ENV} is set; workers could not prove who they are, so the learner will not "
                          f"take check-ins there: set a token (the same on the learner and every worker)")


_bearer = HTTPBearer(auto_error=False, description=f"the token in {TOKEN_ENV}, when the server has one")


def bearer_carries(authorization: str | None, token: str | None) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <token>`` (always true without a token)."""
    if token is None:
        return True
    scheme, _, credentials = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(credentials.encode(), token.encode())


def wrong_token() -> HTTPException:
    return HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})


def require_token(token: str | None):
    """A FastAPI dependency: 401 unless the request carries ``token`` (no-op without one). It runs
    after FastAPI has read the request's body: a server that takes bodies checks the header
    before that too (rollout_service/app.py ``gate``), so no body is waited for without it."""

    async def check(request: Request, _: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
        if not bearer_carries(request.headers.get("authorization"), token):  # _bearer: the OpenAPI scheme
            raise wrong_token()

    return Depends(check)
