"""``/healthz`` of a learner node other than node 0 (``learner.nodes`` > 1), served by the
node's first rank on ``learner.port``, so every node of a multi-node learner answers the
same HTTP probe (deploy/k8s/overlays/gpu-multinode).

Only global rank 0 (node 0) serves the learner's app (learner/app.py: /metrics and /status
read its state). A node elsewhere answers one question: are this node's ranks alive, and is
node 0 still there for them? Its signal, and why it is the simplest true one:

- the answer itself says this node's ranks live: it comes from local rank 0's process, and
  torchrun (``--max-restarts 0``) stops every rank of the node as soon as one of them exits;
- node 0's rendezvous store (``learner.rendezvous``) accepts a TCP connection: torchrun's
  agent on node 0 serves it for as long as node 0's ranks run (it exits with them). The time
  since the last collective would not do: ranks other than 0 wait in a broadcast for as long
  as rank 0 waits for rollouts, hours being normal (learner/dist.py IDLE_TIMEOUT).

A node whose node 0 is gone answers 503, is restarted by its supervisor, and meets the next
node 0 at the rendezvous, instead of waiting in a collective until it times out.

The standard library's threading HTTP server in a daemon thread: nothing here needs the
learner app's FastAPI stack, and a request that stalls holds only its own thread. Its
socket's timeout bounds one read, not a header sent a byte at a time (a slow-loris client
held its thread for as long as it liked; issue 33, item 4): a request whose header has not
arrived ``TIMEOUT_S`` after it connected is cut.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PATH = "/healthz"
TIMEOUT_S = 3.0  # the store's connect, and a client's request: below the probes' timeoutSeconds (5)


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


def node0_answers(rendezvous: str, timeout_s: float = TIMEOUT_S) -> bool:
    """Whether node 0's rendezvous store (``host:port``) accepts a connection."""
    host, port = rendezvous.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def serve_node_health(host: str, port: int, rendezvous: str, node_rank: int) -> str:
    """Serve ``GET /healthz`` in a daemon thread; returns the bound ``host:port``."""

    class Health(BaseHTTPRequestHandler):
        timeout = TIMEOUT_S  # one read

        def setup(self):
            super().setup()
            self._late = threading.Timer(TIMEOUT_S, self._cut)  # the whole header
            self._late.start()

        def _cut(self):
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        def finish(self):
            self._late.cancel()
            super().finish()

        def do_GET(self):
            self._late.cancel()  # the header is in: the answer may take node0_answers' own timeout
            if self.path != PATH:
                self._reply(404, {"detail": "not found: a node other than 0 serves only " + PATH})
            elif node0_answers(rendezvous):
                self._reply(200, {"status": "ok", "node_rank": node_rank})
            else:
                self._reply(503, {"status": f"node 0's rendezvous store {rendezvous} does not answer",
                                  "node_rank": node_rank})

        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # a probe every few seconds: not worth a log line each
            pass

    server = (_Server6 if ":" in host else _Server)((host, port), Health)
    threading.Thread(target=server.serve_forever, name="node-health", daemon=True).start()
    bound_host, bound_port = server.server_address[:2]
    return f"{bound_host}:{bound_port}"
