"""The base model's held-out evaluation, kept and reused (``eval.reuse_base``).

A greedy evaluation of the same weights, prompts and settings gives the same answers (two
SmolLM2 runs agreed on every one of 472 rows), and on a 2-core CPU it takes 7 of a recipe's
60 minutes. So a worker asked for version 0 while it still serves the base model looks up a
result stored under a key of everything the answers depend on, and evaluates only on a miss:
the weights it serves (their files' contents, so a quantized checkpoint or a re-prepared
model is another key), the engine's precision and quantization, the exact token ids of every
prompt with its reference answer, the sampling settings, the engine's length limit, the
vLLM version and this module's format. Anything else in the run (the learner, the training
set, the seed) does not change a greedy answer and is not in it.

Results live under ``$RLPIPE_CACHE/evals/`` (rlpipe.paths.cache_root), one JSON file per key,
written atomically; a file that does not read back as a result is ignored and replaced.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from quant.quant_profile import model_fingerprint
from rlpipe.paths import cache_root

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the result's fields or the scoring change
REUSED_FIELDS = ("rows", "skipped_rows", "pass_at_1", "pass_at_1_low", "pass_at_1_high", "pass_at_1_lenient",
                 "pass_at_1_lenient_low", "pass_at_1_lenient_high", "rows_evaluated", "rows_right",
                 "rows_right_lenient", "k", "mean_at_k", "seconds")
# A result's fields that only some settings have (task.tool's, eval.without_tool's): kept and reused when there.
OPTIONAL_FIELDS = ("tool", "tool_calls", "rows_using_tool", "pass_at_1_without_tool", "pass_at_1_without_tool_low",
                   "pass_at_1_without_tool_high", "rows_right_without_tool")


def _vllm_version() -> str:
    try:
        return version("vllm")
    except PackageNotFoundError:
        return "none"


def base_key(model_dir: str, profile, prompts: list[tuple[list[int], str]], settings: dict) -> str:
    """The key of a base-model evaluation: ``prompts`` is each row's (token ids, reference answer),
    ``settings`` the sampling and engine settings its answers depend on."""
    blob = json.dumps({"format": FORMAT, "vllm": _vllm_version(), "weights": model_fingerprint(model_dir),
                       "precision": profile.precision, "dtype": profile.dtype,
                       "quantization": profile.quantization, "quant": profile.quant_hash,
                       "prompts": prompts, "settings": settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _path(key: str) -> Path:
    return cache_root() / "evals" / f"{key}.json"


def load(key: str) -> dict | None:
    """The stored result's fields for ``key``, or None (none stored, or not a result)."""
    try:
        stored = json.loads(_path(key).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or any(f not in stored for f in REUSED_FIELDS):
        return None
    return {f: stored[f] for f in REUSED_FIELDS + OPTIONAL_FIELDS if f in stored}


def store(key: str, result: dict) -> None:
    """Keep ``result``'s fields under ``key`` (write, then rename: a reader sees all or nothing)."""
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({f: result[f] for f in REUSED_FIELDS + OPTIONAL_FIELDS if f in result}))
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache costs the next run the evaluation, nothing else
        log.warning("eval: could not keep the base model's result (%s)", e)
