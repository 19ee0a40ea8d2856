"""``rollout.engine``: vLLM engine arguments a run passes through, checked against vLLM's own.

Users tune the engine (``gpu_memory_utilization``, ``max_num_seqs``,
``enable_prefix_caching``, ...) without rlpipe naming each knob. The keys must be fields of
vLLM's ``EngineArgs``, so a typo is an error naming it and vLLM's closest fields, not a
setting silently ignored; checked at launch (rlpipe.config.validate_run) and when an engine
starts. Values are vLLM's to check, when the engine starts.

Some fields rlpipe sets itself: the error names the run's key that sets them. Tensor,
pipeline and data parallelism are refused for now: the weight follower
(rollout_service/worker_ext.py) receives each update in the one engine process of the
``uni`` executor, and an engine spread over several processes would need each of them to
receive its part. That is the GPU-cluster work still open, so a TP engine fails here, at
launch, not at its first weight sync.
"""

from __future__ import annotations

import dataclasses
import difflib
from functools import cache

# EngineArgs fields rlpipe sets, and the run's key (or the reason) behind each.
SET_BY_RLPIPE = {
    "model": "model.path",
    "tokenizer": "model.path",
    "seed": "seed (each worker's engine seed follows from it)",
    "dtype": "rollout.precision",
    "quantization": "rollout.precision",
    "max_model_len": "rollout.max_model_len",
    "max_num_batched_tokens": "rollout.max_num_batched_tokens",
    "enforce_eager": "rollout.enforce_eager",
    "worker_extension_cls": "nothing: it is rlpipe's weight follower",
    "logprobs_mode": "nothing: behavior log-probs must be the sampling distribution's (processed_logprobs)",
    "distributed_executor_backend": "nothing: it follows from the parallel sizes",
    "disable_log_stats": "nothing: the worker exports its own metrics",
}
PARALLEL = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


@cache
def engine_fields() -> frozenset[str]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))


def engine_args_problems(engine: dict) -> list[str]:
    """What is wrong with ``rollout.engine``, one line per key ([] when nothing)."""
    if not engine:
        return []
    problems = []
    fields = engine_fields()
    for key, value in engine.items():
        where = f"rollout.engine.{key}"
        if key in SET_BY_RLPIPE:
            problems.append(f"{where}: rlpipe sets this engine argument; set {SET_BY_RLPIPE[key]}")
        elif key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=3)
            problems.append(f"{where}: not a vLLM engine argument" + (f" (did you mean {', '.join(close)}?)"
                                                                      if close else ""))
        elif key in PARALLEL and value not in (None, 1):
            problems.append(f"{where}: {value}: an engine over several processes is not supported yet (the "
                            "weight follower receives updates in one engine process); run more workers instead")
    return problems
