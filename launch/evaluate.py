"""``rlpipe eval``: a run's held-out evaluation of any model, outside a run, paired against another.

A run's summary scores the policy its workers serve. What a user keeps is another model: the
exported weights (``rlpipe export``: the adapter merged), served unquantized, against the model
they gave. This scores both the way the run does: the same task settings, rows
(``eval.dataset``, ``eval.size``, ``eval.drop_shared``), prompts, answers (greedy, with the tool of
``task.tool`` and, with ``eval.without_tool``, without it) and scoring as the workers'
evaluation (rollout_service/evals.py ``EvalRunner.score_rows``, the same code), on a vLLM engine
started here at an unquantized precision, and pairs them row by row (launch/demo.py
``sign_test``).

A model is a Hugging Face model directory, a run directory (its newest complete checkpoint) or a
checkpoint directory; a checkpoint is exported first (launch/export.py) into a scratch directory.
``eval.exported`` (:func:`score_exported`) is the same at the end of a demo, on its last checkpoint.
A result is kept in the evaluation cache (rollout_service/eval_cache.py), keyed by the weights'
contents, the rows and the settings, so the model a user gave is scored once across runs.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from pathlib import Path

from rlpipe.config import ConfigError, RunConfig
from rlpipe.machine import auto_precision
from rlpipe.precisions import SPECS

log = logging.getLogger(__name__)

UNQUANTIZED = tuple(name for name, spec in SPECS.items() if not spec.scheme)  # plain casts: fp32, bf16, fp16


def unquantized_precision(cfg: RunConfig) -> str:
    """The precision a user serves their model in: the run's own where it is a plain cast
    (fp32, bf16, fp16), else the fastest cast of this machine (``auto``): never int8 or fp8."""
    precision = cfg.rollout.precision
    return precision if precision in UNQUANTIZED else auto_precision()[0]


def resolve_model(cfg: RunConfig, spec: str, scratch: Path) -> tuple[str, str]:
    """``(model directory, what it is)`` for ``spec``: a model directory as it is, a model rlpipe
    prepares by name (``smollm2-135m-instruct``, ``toy-qwen2``: as ``model.path`` would), a run
    or checkpoint directory exported into ``scratch``."""
    from launch.demo import resolve_model as prepared
    from launch.export import ExportError, _is_checkpoint, export
    from rlpipe.paths import BUILTIN_NAMES, TOY_PREFIX

    path = Path(spec)
    if not path.is_dir() and (spec in BUILTIN_NAMES or spec.startswith(TOY_PREFIX)):
        named = cfg.model_copy(deep=True)
        named.model.path = spec
        return prepared(named, log=lambda m: log.info("%s", m)), f"the model rlpipe prepares as {spec}"
    if not path.is_dir():
        raise ConfigError(f"{spec}: no such directory (a model directory, a run directory, a checkpoint, or "
                          f"a model rlpipe prepares: {', '.join(BUILTIN_NAMES)}, toy-<arch>)")
    if (path / "config.json").is_file() and not _is_checkpoint(path):
        return str(path), "model directory"
    try:
        out = export(path, scratch / f"exported-{len(list(scratch.iterdir()))}")
    except ExportError as e:
        raise ConfigError(str(e)) from None
    return str(out), f"exported from {spec}"


def score_model(cfg: RunConfig, model_dir: str, precision: str) -> dict:
    """The run's held-out evaluation of ``model_dir`` on an engine of ``precision`` started here
    (and shut down after): the fields of an evaluation result (rollout_service/evals.py), from
    the cache when these weights, rows and settings were scored before."""
    cfg = cfg.model_copy(deep=True)
    cfg.model.path = model_dir
    cfg.rollout.precision = precision
    cfg.rollout.fleet = []
    return asyncio.run(_score(cfg))


async def _score(cfg: RunConfig) -> dict:
    from transformers import AutoTokenizer

    from quant.precision_profile import profile_for
    from rollout_service import eval_cache
    from rollout_service.engine import RolloutEngine
    from rollout_service.evals import EvalRunner, make_eval_task
    from rollout_service.tasks import PromptEncoder

    encode = PromptEncoder(cfg.task, AutoTokenizer.from_pretrained(cfg.model.path), cfg.model.path)
    profile = profile_for(cfg.rollout.precision, quant=cfg.quant, model_path=cfg.model.path)
    engine = RolloutEngine(cfg.model.path, profile, cfg.rollout, seed=cfg.seed)
    runner = EvalRunner(cfg, "eval", engine, None, make_eval_task(cfg), encode)
    key = runner.base_key()
    if (fields := eval_cache.load(key)) is not None:
        log.info("eval: %s at %s kept from an earlier evaluation (key %s)", cfg.model.path, profile.precision, key)
        return {**fields, "reused": True}
    t0 = time.monotonic()
    await engine.start()
    try:
        fields = await runner.score_rows()
    finally:
        engine.shutdown()
    eval_cache.store(key, fields)
    return {**fields, "reused": False, "seconds": time.monotonic() - t0}


def compare(cfg: RunConfig, models: list[str], precision: str | None = None, say=print) -> dict:
    """Score each of ``models`` (the first is the one judged; the others are paired against it)
    and return a report: each model's numbers and, for each other model, the paired changes."""
    from launch.demo import paired_change

    if not cfg.eval.dataset and cfg.task.type != "arith":
        raise ConfigError("eval.dataset: not set; rlpipe eval scores the held-out set a run's summary names "
                          "(e.g. --set eval.dataset=mawps:singleeq)")
    precision = precision or unquantized_precision(cfg)  # a given one is the config's: validated there
    report = {"dataset": cfg.eval.dataset, "precision": precision, "models": []}
    with tempfile.TemporaryDirectory(prefix="rlpipe-eval-") as scratch:
        for spec in models:
            model_dir, what = resolve_model(cfg, spec, Path(scratch))
            say(f"rlpipe eval: {spec} ({what}) at {precision} on {cfg.eval.dataset}")
            fields = score_model(cfg, model_dir, precision)
            report["models"].append({"model": spec, "what": what, **summary_lines(fields), "result": fields})
    first = report["models"][0]["result"]
    for other in report["models"][1:]:
        base = other["result"]
        other["paired"] = {"strict": paired_change(base, first),
                           "lenient": paired_change(base, first, "rows_right_lenient")}
        if "rows_right_without_tool" in first and "rows_right_without_tool" in base:
            other["paired"]["without_tool"] = paired_change(base, first, "rows_right_without_tool")
    return report


def score_exported(cfg: RunConfig, run_dir: Path, say) -> dict:
    """``eval.exported``: the run's last checkpoint exported (``rlpipe export``) to
    ``<run_dir>/exported`` and scored, with the model given, on an unquantized engine (launch/evaluate.py):
    the summary's lines of the gain a user keeps. A failure here is a line, never a lost summary."""
    from launch.export import export

    out = run_dir / "exported"
    say(f"scoring the exported model ({out}) and the model given, unquantized")
    try:
        if not out.exists():
            export(run_dir, out)
        report = compare(cfg, [str(out), cfg.model.path], say=say)
    except Exception as e:  # noqa: BLE001 - the run's own summary stands; this line says what failed
        return {"eval_exported_error": f"{type(e).__name__}: {e}"}
    exported, given = report["models"]
    lines = {"eval_exported_of": f"{out} ({exported['result']['rows']} rows) against the model given "
                                 f"({cfg.model.path}), both at {report['precision']}",
             "eval_given_pass@1": given["pass@1"], "eval_exported_pass@1": exported["pass@1"]}
    if "pass@1_without_tool" in exported:
        lines["eval_exported_pass@1_without_tool"] = exported["pass@1_without_tool"]
    lines.update({f"eval_exported_paired_{k}": v for k, v in given["paired"].items()})
    return lines


def summary_lines(e: dict) -> dict:
    """One evaluation's numbers in the words of a run's summary."""
    lines = {"pass@1": f"{e['pass_at_1']:.3f} [{e['pass_at_1_low']:.3f}, {e['pass_at_1_high']:.3f}] "
                       f"over {e['rows']} rows",
             "pass@1_lenient": f"{e['pass_at_1_lenient']:.3f}"}
    if "rows_using_tool" in e:
        lines["rows_using_tool"] = f"{e['rows_using_tool']}/{e['rows']} ({e['tool_calls']} values)"
    if "pass_at_1_without_tool" in e:
        lines["pass@1_without_tool"] = (f"{e['pass_at_1_without_tool']:.3f} [{e['pass_at_1_without_tool_low']:.3f}, "
                                        f"{e['pass_at_1_without_tool_high']:.3f}]")
    return lines
