"""``rollout.engine``: vLLM engine arguments a run passes through, checked against vLLM's own.

Users tune the engine (``gpu_memory_utilization``, ``max_num_seqs``,
``enable_prefix_caching``, ...) without rlpipe naming each knob. The keys must be fields of
vLLM's ``EngineArgs``, so a typo is an error naming it and vLLM's closest fields, not a
setting silently ignored; checked at launch (launch.checks.validate_run) and when an engine
starts. Values are vLLM's to check, when the engine starts.

Some fields rlpipe sets itself: the error names the run's key that sets them.

Tensor and pipeline parallelism need a transport whose row of rlpipe/transports.py feeds
``sharded_engines`` (nccl: vLLM's nccl weight-transfer engine gives every process of the
engine its own rank and loads each its shard, weight_sync/nccl.py). Under the others an
engine must be one process, each row saying why (gloo: the weight follower,
rollout_service/worker_ext.py, receives each update in the one engine process of the
``uni`` executor; ipc: the learner's buffer is exported from one GPU, and vLLM's ipc engine
maps it only on that GPU), so such an engine is refused at launch, not at its first weight
sync. Data parallelism inside one engine is refused under every transport: run more
workers instead (each is its own engine and member).
"""

from __future__ import annotations

import dataclasses
import difflib
from functools import cache

from rlpipe.transports import SPECS, STAGED, either, spec

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
    "disable_log_stats": "rollout.vllm_metrics",
    "weight_transfer_config": "sync.transport",
}
PARALLEL = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


def engine_processes(engine: dict) -> int:
    """How many processes (and GPUs) an engine of these arguments runs: tensor x pipeline parallel."""
    return int(engine.get("tensor_parallel_size") or 1) * int(engine.get("pipeline_parallel_size") or 1)


@cache
def engine_fields() -> frozenset[str]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))


def engine_args_problems(engine: dict, transport: str = STAGED) -> list[str]:
    """What is wrong with ``rollout.engine`` under the run's resolved ``transport``, one line
    per key ([] when nothing)."""
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
        elif key in PARALLEL and value not in (None, 1) and (key == "data_parallel_size"
                                                              or not spec(transport).sharded_engines):
            why = ("an engine's own data parallelism is not supported" if key == "data_parallel_size" else
                   f"under {transport} {spec(transport).one_process_why}; it needs sync.transport {sharding()}")
            problems.append(f"{where}: {value}: {why}; run more workers instead")
    return problems


def sharding() -> str:
    """The transports that feed an engine of several processes, each marked (CUDA) where it needs it."""
    return either(f"{s.name} (CUDA)" if s.cuda else s.name for s in SPECS.values() if s.sharded_engines)
