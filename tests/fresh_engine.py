"""A fresh vLLM engine started from a checkpoint, as the oracle the synced engines must equal.

    python -m tests.fresh_engine CHECKPOINT REQUESTS_JSON

Runs in its own process (an in-process engine pins the caller's threads) with the rollout
engine's own arguments (``RolloutEngine.engine_kwargs``), samples every request (``prompt``
token ids, ``n``, ``max_tokens``, ``seed``) one at a time and prints the results as JSON:
per request, per sample, ``tokens`` and behavior ``logprobs``.
"""

from __future__ import annotations

import json
import os
import sys


def main(checkpoint: str, requests_path: str) -> None:
    from vllm import LLM, SamplingParams

    from quant.precision_profile import PrecisionProfile
    from rlpipe.config import RolloutConfig
    from rollout_service.engine import RolloutEngine

    # the head in the model's dtype, as the synced workers run it (tests/test_quant_engine.py MODEL_DTYPE_HEAD)
    config = RolloutConfig(engine={"hf_overrides": {}})
    kwargs = RolloutEngine(checkpoint, PrecisionProfile("fresh", "bfloat16"), config).engine_kwargs()
    kwargs.pop("worker_extension_cls")
    llm = LLM(**kwargs)
    out = []
    for req in json.loads(open(requests_path).read()):
        params = SamplingParams(n=req["n"], max_tokens=req["max_tokens"], seed=req["seed"], temperature=1.0, logprobs=0)
        res = llm.generate([{"prompt_token_ids": req["prompt"]}], params, use_tqdm=False)[0]
        out.append([{"tokens": list(c.token_ids), "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]}
                    for c in res.outputs])
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], sys.argv[2])
