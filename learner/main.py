"""Entry point of the learner process (``rlpipe learner --config run.yaml``)."""

from __future__ import annotations

import logging
import signal

from rlpipe import registry
from rlpipe.config import RunConfig

log = logging.getLogger(__name__)


def main(cfg: RunConfig) -> int:
    from learner.app import serve_in_thread
    from learner.train import Learner

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    learner = Learner(cfg)
    address = serve_in_thread(learner, cfg.learner.host, cfg.learner.port)
    registry.set_learner_state(learner.r, learner.keys, address=address)
    log.info("learner serving /status at http://%s", address)
    try:
        learner.run()
    except KeyboardInterrupt:
        log.info("learner stopped at step %d", learner.step)
        learner.sender.drop()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return 0
