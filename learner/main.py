"""Entry point of the learner process (``rlpipe learner --config run.yaml``, or under torchrun)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from rlpipe import registry
from rlpipe.config import RunConfig
from rlpipe.fence import Fenced

log = logging.getLogger(__name__)


def main(cfg: RunConfig) -> int:
    from learner.allocator import set_mmap_threshold
    from learner.app import serve_in_thread
    from learner.dist import exit_rank
    from learner.train import Learner
    from weight_sync.transport import IncompatibleWorker

    set_mmap_threshold(cfg.learner.mmap_threshold_mib)  # before the model's tensors are allocated
    learner = Learner(cfg)

    def on_term(signum, frame):
        # First SIGTERM: finish the step in hand, checkpoint, acknowledge, exit. A second one: now.
        if learner.stop_requested:
            raise KeyboardInterrupt
        log.info("stop requested: finishing step %d", learner.step + 1)
        learner.request_stop()

    signal.signal(signal.SIGTERM, on_term)
    if learner.ranks.is_main:
        address = serve_in_thread(learner, cfg.learner.host, cfg.learner.port)
        registry.set_learner_state(learner.r, learner.keys, address=address)
        log.info("learner serving /status at http://%s", address)
    elif cfg.learner.nodes > 1 and learner.ranks.local_rank == 0:  # every other node's probe (learner/node_health.py)
        from learner.node_health import serve_node_health

        address = serve_node_health(cfg.learner.host, cfg.learner.port, cfg.learner.rendezvous, cfg.learner.node_rank)
        log.info("node %d serving /healthz at http://%s", cfg.learner.node_rank, address)
    try:
        learner.run()
        if cfg.learner.on_done == "serve" and learner.status == "done" and learner.ranks.is_main:
            log.info("all %d steps trained: serving /metrics until SIGTERM", cfg.steps)
            while not learner.stop_requested:
                time.sleep(0.5)
    except Fenced as e:
        # Paused or partitioned past its lease, this learner is a zombie: another one owns the run now.
        log.critical("Redis refused a write of this learner (%s): stopping without touching the run", e)
        os._exit(3)
    except KeyboardInterrupt:
        log.info("learner stopped at step %d", learner.step)
        if learner.ranks.is_main:
            learner.fleet.drop()
    except IncompatibleWorker as e:  # a worker runs another model or quantization: no sync can reach it
        log.error("stopping at step %d: %s", learner.step, e)
        print(f"rlpipe: error: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        learner.metrics.close()
        learner.ranks.close()
    if learner.ranks.world > 1:
        exit_rank(0)
    return 0
