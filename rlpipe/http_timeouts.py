"""Header and body deadlines for every HTTP server rlpipe runs under uvicorn (the rollout
worker's API, rollout_service/server.py; the learner's /healthz, /metrics and /status,
learner/app.py).

uvicorn times out only idle keep-alive connections, from the end of a response until the
first new byte. A client sending a header a byte at a time (or nothing at all after
connecting), or a whole header and then its body a byte at a time, held its socket for as
long as it liked, and a few hundred such clients hold them all (a slow-loris attack); the
learner's server runs in a thread beside training, and its sockets and file descriptors
are the training process's.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def timed_http(header_timeout_s: float, body_timeout_s: float):
    """uvicorn's HTTP protocol (pass it as ``uvicorn.Config(http=...)``), closing a connection
    that has not sent a request's whole header within ``header_timeout_s`` of opening, or of
    its last response, or the request's whole body within ``body_timeout_s`` of its header.

    Both timers check uvicorn's ``cycle``, the request/response cycle both of its protocols
    (h11 and httptools) create once a header is complete, and which says whether the body
    is still coming (``more_body``) and whether the response went (``response_complete``).
    A request whose body has arrived is never cut, however long serving it takes."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class TimedHTTP(AutoHTTPProtocol):
        _header_timer = None
        _body_timer = None
        _timed_cycle = None  # the last cycle a body timer was set for

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._await_header()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            cycle = self.cycle  # a header completed in this data: its body must follow in time
            if cycle is not None and cycle is not self._timed_cycle and not self.transport.is_closing():
                self._timed_cycle = cycle
                if self._body_timer is not None:
                    self._body_timer.cancel()
                self._body_timer = self.loop.call_later(body_timeout_s, self._body_late, cycle)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_header()

        def connection_lost(self, exc) -> None:
            for timer in (self._header_timer, self._body_timer):
                if timer is not None:
                    timer.cancel()
            super().connection_lost(exc)

        def _await_header(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_late, self.cycle)

        def _header_late(self, cycle) -> None:
            if self.cycle is cycle and (cycle is None or cycle.response_complete) and not self.transport.is_closing():
                log.info("closing a connection that sent no request header within %.0fs", header_timeout_s)
                self.transport.close()

        def _body_late(self, cycle) -> None:
            if cycle.more_body and not cycle.response_complete and not self.transport.is_closing():
                log.info("closing a connection that sent no whole request body within %.0fs of its header",
                         body_timeout_s)
                self.transport.close()

    return TimedHTTP
