"""``rlpipe demo``: a whole run on this machine, from nothing to a reward curve.

Builds (or reuses) the toy model, starts a private Redis, N rollout workers and the
learner as separate processes, shows a progress bar while the learner trains for
``steps`` steps, then stops everything and leaves in ``runs/<id>/``:

    config.yaml     the resolved config every role read
    metrics.jsonl   one line of learner metrics per step
    metrics.png     reward and mismatch KL over steps
    summary.json    the table printed at the end
    logs/           one log per process; commands.txt has their command lines
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from launch.checks import check_model_path, validate_run
from launch.gpus import launch_plan
from launch.launcher import ChildFailed, Launcher, learner_env, make_run_dir, signals_held, worker_env
from launch.redis_server import EmbeddedRedis
from launch.role_setup import parse_cpus
from rlpipe import registry
from rlpipe.config import ConfigError, RunConfig, dump_config, secret_env, without_secrets
from rlpipe.keys import Keys
from rlpipe.machine import auto_precision, cpu_name
from rlpipe.paths import BUILTIN_NAMES
from rlpipe.queue import TrajectoryQueue
from rlpipe.redis_link import connect


def resolve_model(cfg: RunConfig, log=print) -> str:
    """The model directory: ``model.path`` if given, the cached built-in model it names
    (``smollm2-135m-instruct``, prepared once), else the cached toy model for this config.
    ``model.path: toy-llama`` (or ``toy-qwen2``, the default's architecture) builds, once, the
    toy model of that architecture from the same ``model.toy_*`` keys and task (an existing
    directory of that name is loaded as it is). The task's ``arith_style`` is part of the spec:
    a ``worked`` run gets a toy warm-started on worked answers, cached under its own key."""
    path = cfg.model.path
    check_model_path(path)
    if path and Path(path).is_dir():
        return path
    if path in BUILTIN_NAMES:
        from launch.builtin_models import ensure_builtin_model

        return str(ensure_builtin_model(path, log=log))
    from launch.toy import ensure_toy_model, toy_spec
    from rlpipe.arith import ArithmeticProblems
    from rlpipe.paths import TOY_PREFIX
    from rlpipe.task_config import ArithTask

    arch = path[len(TOY_PREFIX):] if path else None  # toy-<arch> (check_model_path) or null
    # The toy is warm-started on the arithmetic task: the run's own, or the default one under a dataset task.
    arith = cfg.task if isinstance(cfg.task, ArithTask) else ArithTask()
    spec = toy_spec(
        arch or "qwen2",
        hidden_size=cfg.model.toy_hidden_size,
        num_layers=cfg.model.toy_layers,
        task=ArithmeticProblems(digits=arith.digits, ops=arith.ops, style=arith.arith_style),
        seed=cfg.seed,
        target_sampled_accuracy=cfg.model.toy_target_sampled_accuracy,
        tool_calls=cfg.model.toy_tool_calls,
    )
    return str(ensure_toy_model(spec, log=log))


def calibration_sequences(cfg: RunConfig, model_path: str) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids to calibrate on and the held-out probe set of the monitors: lines of
    ``quant.int8.calibration_file``, else the task's prompts followed by their reference answers
    (what a policy that solves the task would read and write; with ``task.chat_template`` the prompt ids are the
    chat template's, as the rollout workers give them to the engine)."""
    from transformers import AutoTokenizer

    q = cfg.quant.int8
    want = q.calibration_samples + q.probe_samples
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if q.calibration_file:
        path = Path(q.calibration_file)
        if not path.is_file():
            raise FileNotFoundError(f"quant.int8.calibration_file: {path} does not exist")
        texts = [line for line in path.read_text().splitlines() if line.strip()]
        if len(texts) < 2:
            raise ValueError(f"quant.int8.calibration_file: {path} needs at least 2 non-empty lines")
        ids = [tokenizer(t)["input_ids"] for t in texts[:want]]
    else:
        from rollout_service.tasks import PromptEncoder, make_task

        task = make_task(cfg.task)
        prompts = [task.prompt(i) for i in range(want)]
        if cfg.task.chat_template:
            encode = PromptEncoder(cfg.task, tokenizer, model_path)
            ids = [encode(p.text) + tokenizer(p.answer, add_special_tokens=False)["input_ids"] for p in prompts]
        else:
            ids = [tokenizer(p.text + p.answer)["input_ids"] for p in prompts]
    ids = [x[: cfg.rollout.max_model_len] for x in ids]
    n_probe = min(q.probe_samples, max(1, len(ids) // 4))
    return ids[: len(ids) - n_probe], ids[len(ids) - n_probe:]


def resolve_quant_profile(cfg: RunConfig, model_path: str, out_dir: str | Path | None = None, progress: bool = True,
                          log=print, apart: bool = False) -> str:
    """The int8 profile directory: ``quant.int8.profile`` if given, else one calibrated now and
    cached by the fingerprints of the model, the calibration set and the settings.
    ``apart``: calibrate in a child process (the launchers, which live as long as the run:
    calibrating SmolLM2 in-process left them 3.2 GB resident for the whole run)."""
    if out_dir is None and cfg.quant.int8.profile:
        return cfg.quant.int8.profile
    from quant.calibrate import cache_key, ensure_profile, int8_scheme, log_stderr
    from quant.quant_profile import model_fingerprint
    from rlpipe.paths import cache_root

    calib, probe = calibration_sequences(cfg, model_path)
    q = cfg.quant.int8
    scheme = int8_scheme(q.weights)
    if out_dir is None:
        key = cache_key(model_fingerprint(model_path), calib, probe, q.alpha, q.activations, scheme)
        out_dir = cache_root() / "quant" / f"int8-{key}"
    args = (model_path, calib, probe, q.alpha, q.activations, out_dir, progress)
    if apart:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(1) as pool:  # its memory goes back when it ends
            return str(pool.apply(ensure_profile, (*args, log_stderr, scheme)))
    return str(ensure_profile(*args, log, scheme))


def prepare_run(cfg: RunConfig, runs_dir: str, say) -> tuple[RunConfig, Path, EmbeddedRedis | None]:
    """Resolve a run for local roles (``rlpipe demo``, ``rlpipe up``): its directory, the
    model, Redis (embedded unless ``REDIS_URL`` is set), the int8 profile; write the
    config every role reads to ``<run_dir>/config.yaml``, without its secrets."""
    validate_run(cfg)
    check_cpus(cfg)
    launch_plan(cfg)  # cores and GPUs that cannot work here fail now, before anything starts
    run_id = cfg.run_id or time.strftime("%Y%m%d-%H%M%S") + f"-s{cfg.seed}"
    run_dir = make_run_dir(runs_dir, run_id)
    say(f"rlpipe: run {run_id} in {run_dir}")
    model_path = resolve_model(cfg, log=say)
    if model_path != cfg.model.path:  # a toy or built-in model: the checks that read it need its directory
        resolved = cfg.model_copy(deep=True)
        resolved.model.path = model_path
        validate_run(resolved)
    redis_server = None
    redis_url = os.environ.get("REDIS_URL", "")
    if not redis_url:
        redis_server = EmbeddedRedis(run_dir / "redis").start()
        redis_url = redis_server.url
    cfg = cfg.model_copy(deep=True)
    cfg.run_id, cfg.run_dir, cfg.redis_url, cfg.model.path = run_id, str(run_dir), redis_url, model_path
    if "int8" in cfg.rollout.precisions:
        cfg.quant.int8.profile = resolve_quant_profile(cfg, model_path, log=say, apart=True)
    if cfg.learner.threads == 0 and not cfg.learner.cpus and cfg.workers >= len(os.sched_getaffinity(0)):
        # Every core already runs a worker: a multi-threaded learner would fight them
        # (OpenMP threads wait on each other at every barrier) and run slower than one.
        cfg.learner.threads = 1
    dump_config(without_secrets(cfg), run_dir / "config.yaml")  # the children get them in secret_env(cfg)
    return cfg, run_dir, redis_server


def check_cpus(cfg: RunConfig) -> None:
    """``rollout.cpus`` and ``learner.cpus`` must name cores this launcher may use: a role
    pinned to another would fail at start, after the others had begun."""
    allowed = os.sched_getaffinity(0)
    for key, spec in (("rollout.cpus", cfg.rollout.cpus), ("learner.cpus", cfg.learner.cpus)):
        missing = sorted(set(parse_cpus(spec)) - allowed)
        if missing:
            raise ConfigError(f"{key}: cores {missing} are not among this machine's usable cores {sorted(allowed)}")


def role_envs(cfg: RunConfig) -> tuple[list[dict[str, str]], dict[str, str]]:
    """The environment of each worker and of the learner: their cores, OMP threads and GPUs."""
    cores = parse_cpus(cfg.rollout.cpus) or None
    gpus = launch_plan(cfg)
    learner_cores = parse_cpus(cfg.learner.cpus)
    return ([{**worker_env(i, cfg.workers, cores, learner_cores), **gpus.worker_env(i)} for i in range(cfg.workers)],
            {**learner_env(cfg), **gpus.learner_env()})


def run_demo(cfg: RunConfig, runs_dir: str = "runs", timeout_s: float | None = None, progress: bool = True) -> dict:
    """The run's summary (also in ``summary.json``); ``interrupted`` in it after a Ctrl-C or
    SIGTERM, which stop the run in order (launch.launcher) and still summarize it. A role that
    exits with an error, or ``timeout_s`` passing (None: no limit), stops the run the same way,
    and ``stopped`` in the summary says which, in one line."""
    t_start = time.time()
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    cfg, run_dir, redis_server = prepare_run(cfg, runs_dir, say)
    cfg_path = run_dir / "config.yaml"
    launcher = Launcher(run_dir, secret_env(cfg))
    r = connect(cfg.redis_url)
    keys = Keys(cfg.run_id)
    learner_done = interrupted = False
    stopped = None
    try:
        worker_envs, learner_vars = role_envs(cfg)
        for i in range(cfg.workers):
            launcher.spawn(f"rollout-{i}", ["rollout", "--config", str(cfg_path), "--worker-id", f"w{i}",
                                            "--precision", cfg.rollout.worker_precision(i)], worker_envs[i])
        launcher.spawn("learner", ["learner", "--config", str(cfg_path)], learner_vars)
        learner_done = _follow(cfg, launcher, r, keys, run_dir, t_start, timeout_s, progress)
        # A done learner exits by itself (under torchrun, every rank, then torchrun): let it,
        # rather than signal it in the middle of that.
        launcher.wait("learner", 30)
    except KeyboardInterrupt:
        interrupted = True
        say("\ninterrupted: the learner finishes its step and checkpoints, then every process stops")
    except (ChildFailed, TimeoutError) as e:
        stopped = str(e)
        say(f"\nrlpipe: {stopped}; stopping every process" + (f"\n{e.tail}" if isinstance(e, ChildFailed) else ""))
    finally:
        with signals_held(say):
            launcher.stop_all()
            summary = _summarize(cfg, run_dir, t_start, learner_done, interrupted)
            if learner_done and cfg.eval.exported:  # the workers are gone: the cores are the evaluation's
                from launch.evaluate import score_exported

                summary.update(score_exported(cfg, run_dir, say))
                (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            if stopped:
                summary["stopped"] = stopped
            if redis_server:
                redis_server.stop()
    return summary


def _follow(cfg, launcher, r, keys, run_dir, t_start, timeout_s, progress) -> bool:
    """Show progress until the learner reports done; raise if a child fails or time runs out."""
    from tqdm import tqdm

    from learner.metrics import read_jsonl

    bar = tqdm(total=cfg.steps, desc="starting", unit="step", disable=not progress, file=sys.stderr,
               bar_format="{desc} |{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]{postfix}")
    last_step = 0
    try:
        while True:
            launcher.check()
            state = registry.learner_state(r, keys)
            step = int(state.get("step", 0))
            if step > last_step:
                rows = read_jsonl(run_dir / "metrics.jsonl")
                if rows:
                    m = rows[-1]
                    bar.set_postfix_str(f" version {m['learner_version']}  reward {m['reward_mean']:.3f}  "
                                        f"kl {m['mismatch_kl']:.1e}")
                bar.set_description("training")
                bar.update(step - last_step)
                last_step = step
            elif step == 0 and state.get("status") == "evaluating":
                bar.set_description("evaluating the base model")
            elif step == 0:
                up = len(registry.live_workers(r, keys))
                bar.set_description(f"starting ({up}/{cfg.workers} workers up)")
            # a run resumed under its run id finds its last run's "done" in Redis: only this run's counts
            if state.get("status") == "done" and float(state.get("heartbeat", 0)) >= t_start:
                return True
            if timeout_s is not None and time.time() - t_start > timeout_s:
                raise TimeoutError(f"demo did not finish within {timeout_s:.0f}s (step {step}/{cfg.steps})")
            time.sleep(0.5)
    finally:
        bar.close()


def sign_test(first: dict, last: dict, key: str = "rows_right") -> tuple[set, set, int, int, float]:
    """Two evaluations of the same rows compared row by row: the rows each got right
    (``key``), the rows gained and lost, and the exact two-sided sign test (McNemar's) on
    them: how likely a change at least this one-sided is if the two versions were equally good."""
    rows = set(first["rows_evaluated"]) & set(last["rows_evaluated"])
    before, after = set(first[key]) & rows, set(last[key]) & rows
    gained, lost = len(after - before), len(before - after)
    n, k = gained + lost, min(gained, lost)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0
    return before, after, gained, lost, p


def paired_change(first: dict, last: dict, key: str = "rows_right") -> str:
    """:func:`sign_test`, in words."""
    rows = set(first["rows_evaluated"]) & set(last["rows_evaluated"])
    before, after, gained, lost, p = sign_test(first, last, key)
    return (f"{len(before)}/{len(rows)} -> {len(after)}/{len(rows)} "
            f"({100 * (len(after) - len(before)) / max(len(rows), 1):+.1f} points): {gained} rows gained, "
            f"{lost} lost, sign test p = {p:.3g}")


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _summarize(cfg: RunConfig, run_dir: Path, t_start: float, learner_done: bool, interrupted: bool = False) -> dict:
    """The run in one table, from ``metrics.jsonl`` and the queue's books. Called with every
    role stopped and Redis still up; if Redis is unreachable even so (an external one, down),
    the books are left out and the rest is still summarized."""
    import redis

    from learner.metrics import read_jsonl

    rows = read_jsonl(run_dir / "metrics.jsonl")
    try:  # no waiting out redis_wait_s here: the summary is due now
        r = connect(cfg.redis_url)
        queue = TrajectoryQueue(r, cfg.run_id)
        counters, pending, unacknowledged = queue.counters(), queue.length(), queue.pending()
        r.close()
    except redis.RedisError as e:
        counters, pending, unacknowledged = dict.fromkeys(("produced", "trained", "filtered", "dropped_stale", "dead")), None, None
        print(f"rlpipe: the queue's books are left out of the summary: Redis is unreachable ({e})", file=sys.stderr)
    k = min(3, max(1, len(rows) // 4)) if rows else 0
    summary = {
        "run_id": cfg.run_id,
        "seed": cfg.seed,
        "precision": ",".join(cfg.rollout.fleet) or cfg.rollout.precision,
        "learner_dtype": cfg.learner.dtype + (f", LoRA rank {cfg.learner.lora.rank}" if cfg.learner.lora.rank else ""),
        "machine": cpu_name(),
        "auto_picks": "rollout {}, learner {}: {}".format(*auto_precision()),
        "is_mode": cfg.learner.is_mode,
        "completed": learner_done,
        "interrupted": interrupted,
        "steps": len(rows),
        **({"train_budget": _budget_line(cfg, len(rows), learner_done)} if cfg.train_budget_s else {}),
        "final_version": rows[-1]["learner_version"] if rows else 0,
        "wall_seconds": round(time.time() - t_start, 1),
        "rl_seconds": round(rows[-1]["time"], 1) if rows else 0.0,
        "reward_start": sum(x["reward_mean"] for x in rows[:k]) / k if k else None,
        "reward_end": sum(x["reward_mean"] for x in rows[-k:]) / k if k else None,
        "mismatch_kl_mean": sum(x["mismatch_kl"] for x in rows) / len(rows) if rows else None,
        "mismatch_log_ppl_abs_diff_mean": sum(x["mismatch_log_ppl_abs_diff"] for x in rows) / len(rows) if rows else None,
        "lr_end": rows[-1]["learner_lr"] if rows else None,
        "staleness_mean": sum(x["staleness_mean"] for x in rows) / len(rows) if rows else None,
        "groups_produced": counters["produced"],
        "groups_trained": counters["trained"],
        "groups_filtered": counters["filtered"],  # equal rewards: settled untrained (learner.dynamic_sampling)
        "groups_dropped_stale": counters["dropped_stale"],
        "groups_pending": pending,
        "groups_unacknowledged": unacknowledged,  # read by the learner, not yet covered by a checkpoint
        "groups_dead": counters["dead"],
    }
    if "quant_kl_vs_bf16" in (rows[-1] if rows else {}):
        summary["quant_profile_end"] = rows[-1].get("quant_profile")
        summary["quant_kl_vs_bf16_mean"] = _mean(x.get("quant_kl_vs_bf16") for x in rows)
        summary["quant_act_clip_fraction_max"] = max(x.get("quant_act_clip_fraction", 0) for x in rows)
        summary["quant_recalibrations_total"] = rows[-1].get("quant_recalibrations_total", 0)
    evals = read_jsonl(run_dir / "metrics.jsonl", kind="eval")
    summary.update(_eval_summary(evals))
    if evals:
        summary["eval_of"] = _what_was_evaluated(cfg)
    if cfg.rollout.fleet:  # each precision's reward and mismatch, side by side
        summary.update(_fleet_summary(cfg, rows, k))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if rows:
        from launch.plots import plot_run

        summary["plot"] = str(plot_run(rows, run_dir / "metrics.png",
                                       title=f"{cfg.run_id}: {summary['precision']}, {cfg.learner.is_mode}",
                                       evals=evals))
    return summary


def _budget_line(cfg: RunConfig, steps: int, done: bool) -> str:
    """What ``train_budget_s`` did: ended training before ``steps``, or left it to them."""
    if done and steps < cfg.steps:
        return f"{cfg.train_budget_s:.0f} s spent after {steps} of {cfg.steps} steps: training ended there"
    return f"{cfg.train_budget_s:.0f} s, not spent: {steps} of {cfg.steps} steps"


def _what_was_evaluated(cfg: RunConfig) -> str:
    """Whether the held-out numbers are those of the model a user keeps: an fp32 engine serves
    the weights ``rlpipe export`` writes (the adapter applied unmerged: the same sums, rounded
    once more); any other precision serves a rounded or quantized copy, which starts below the
    model the user gave."""
    precision = ",".join(cfg.rollout.fleet) or cfg.rollout.precision
    if precision == "fp32":
        return "the exported model against the model given: fp32 engines serve the unquantized weights"
    kept = ("the eval_exported_* lines below score the exported model against the model given" if cfg.eval.exported
            else "evaluate `rlpipe export`'s output against the model given (`rlpipe eval`) for the gain a user keeps")
    return f"the served {precision} policy against the {precision} base, not the exported model: {kept}"


def _eval_summary(evals: list[dict]) -> dict:
    """Held-out accuracy at the first and the last version evaluated, with 95% intervals."""
    summary = {}
    if evals:
        first, last = min(evals, key=lambda e: e["version"]), max(evals, key=lambda e: e["version"])
        for name, e in (("start", first), ("end", last)):
            summary[f"eval_pass@1_{name}"] = (f"{e['pass_at_1']:.3f} [{e['pass_at_1_low']:.3f}, "
                                              f"{e['pass_at_1_high']:.3f}] at version {e['version']}"
                                              + (" (kept from an earlier run: eval.reuse_base)" if e.get("reused") else ""))
            if "pass_at_1_lenient" in e:
                summary[f"eval_pass@1_lenient_{name}"] = (f"{e['pass_at_1_lenient']:.3f} "
                                                          f"[{e['pass_at_1_lenient_low']:.3f}, "
                                                          f"{e['pass_at_1_lenient_high']:.3f}]")
            if e.get("mean_at_k") is not None:
                summary[f"eval_mean@{e['k']}_{name}"] = e["mean_at_k"]
            if "rows_using_tool" in e:  # task.tool: the greedy answers that used it, and the same rows without it
                summary[f"eval_rows_using_tool_{name}"] = f"{e['rows_using_tool']}/{e['rows']} ({e['tool_calls']} values)"
            if "pass_at_1_without_tool" in e:
                summary[f"eval_pass@1_without_tool_{name}"] = (f"{e['pass_at_1_without_tool']:.3f} "
                                                               f"[{e['pass_at_1_without_tool_low']:.3f}, "
                                                               f"{e['pass_at_1_without_tool_high']:.3f}]")
        summary["eval_dataset"] = f"{first['dataset']} ({first['rows']} rows)"
        for name, key in (("strict", "rows_right"), ("lenient", "rows_right_lenient"),
                          ("without_tool", "rows_right_without_tool")):
            if key in first and key in last and first is not last:
                summary[f"eval_paired_{name}"] = paired_change(first, last, key)
    return summary


def _fleet_summary(cfg: RunConfig, rows: list[dict], k: int) -> dict:
    """Each precision's reward and mismatch, side by side (a mixed fleet): the rewards at the
    start and the end average the first and the last ``k`` of ``rows``."""
    summary = {}
    for p in sorted(cfg.rollout.precisions):
        summary[f"reward_start[{p}]"] = _mean(x.get("reward_by_precision", {}).get(p) for x in rows[:k])
        summary[f"reward_end[{p}]"] = _mean(x.get("reward_by_precision", {}).get(p) for x in rows[-k:])
        summary[f"mismatch_kl_mean[{p}]"] = _mean(x.get("mismatch_by_precision", {}).get(p, {}).get("mismatch_kl")
                                                  for x in rows)
        summary[f"groups[{p}]"] = sum(x.get("groups_by_precision", {}).get(p, 0) for x in rows)
        summary[f"dropped_stale[{p}]"] = rows[-1].get("dropped_stale_by_precision_total", {}).get(p, 0) \
            if rows else 0
        lags = [(x["staleness_by_precision"][p]["staleness_mean"], x["groups_by_precision"][p])
                for x in rows if p in x.get("staleness_by_precision", {})]
        summary[f"staleness_mean[{p}]"] = sum(s * n for s, n in lags) / sum(n for _, n in lags) if lags else None
    return summary


def format_summary(summary: dict, title: str = "rlpipe demo summary") -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    width = max(map(len, summary))
    lines = ["", title, "-" * (width + 24)]
    lines += [f"{k.ljust(width)}  {fmt(v)}" for k, v in summary.items()]
    return "\n".join(lines)
