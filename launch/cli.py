"""The ``rlpipe`` command.

    rlpipe demo [--steps N] [--seed S] [--precision bf16|fp8|...] [--learner-ranks N] [--set key=value ...]
    rlpipe rollout --config run.yaml --worker-id w0       one rollout worker
    rlpipe learner --config run.yaml                      the learner (under torchrun when learner.ranks > 1)
    rlpipe calibrate --config run.yaml [--out DIR]        int8: calibrate the base model once, write a profile
    rlpipe build-model [--seed S]                         prepare/cache the model (toy or built-in), print its path
    rlpipe plot runs/<id>                                 (re)draw metrics.png of a run
    rlpipe export runs/<id> OUT [--step N]                a checkpoint as a merged Hugging Face model (vLLM serves it)
    rlpipe up --config run.yaml                           the roles of deploy/k8s on this machine, supervised
    rlpipe status | restart ROLE | scale ROLE N           act on a running `rlpipe up` (launch/up.py)

Arguments are parsed and the config validated before anything heavy (torch, vLLM) is
imported, so ``--help`` and config errors are instant. What can be known wrong before a
role starts (the config, the model, a port: :func:`check_launch`) exits 2 with one line
naming the key, file or port.
"""

from __future__ import annotations

import argparse
import os
import sys

from launch.checks import check_model_path, validate_run
from rlpipe.config import ConfigError, load_config, parse_yaml

LEARNER_RANKS_HELP = "run the learner as N data-parallel ranks under torchrun (sets learner.ranks)"


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds above zero (``--timeout -5`` is refused, not a run that stops at once)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be above 0")
    return value


def _config_args(p):
    p.add_argument("--config", help="YAML config file (RLPIPE_<SECTION>__<KEY> env vars override it)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. --set learner.lr=1e-4 (repeatable); KEY= sets it "
                   "to the empty string, KEY=null to null")


def _run_shape_args(p):
    p.add_argument("--steps", type=int, help="learner steps to train (sets steps; train_budget_s may end it first)")
    p.add_argument("--workers", type=int, help="rollout workers to start (sets workers)")


def _runs_dir_arg(p):
    p.add_argument("--runs-dir", default="runs", help="where run directories live (default: runs)")


def _run_place_args(p):
    p.add_argument("--run-id", help="the run's name: its directory under --runs-dir and its Redis keys (default: "
                   "the start time and the seed, e.g. 20261202-141500-s0)")
    _runs_dir_arg(p)


def _seed_arg(p):
    p.add_argument("--seed", type=int, help="the run's seed: sampling, prompt order and the learner (sets seed)")


def _demo_args(p):
    _config_args(p)
    _run_shape_args(p)
    _seed_arg(p)
    p.add_argument("--precision", help="rollout precision: fp32, bf16, fp16, fp8, int8, or auto (this machine's fastest); a comma-separated "
                   "list makes a mixed fleet (e.g. int8,bf16: half the workers each)")
    p.add_argument("--is-mode", help="mismatch correction, e.g. token_tis or none")
    p.add_argument("--learner-ranks", type=int, help=LEARNER_RANKS_HELP)
    _run_place_args(p)
    p.add_argument("--timeout", type=positive_seconds, default=None,
                   help="stop the run after this many seconds, with the summary so far (default: no limit; the "
                   "run ends when its steps are done)")


def _rollout_args(p):
    _config_args(p)
    p.add_argument("--worker-id", required=True, help="this worker's name in the fleet (its Redis keys and logs)")
    p.add_argument("--port", type=int, help="the HTTP port to serve on (default: rollout.port; 0, any free port)")
    p.add_argument("--precision", help="this worker's precision (overrides rollout.precision)")
    p.add_argument("--address-file", help="write host:port here once bound")


def _calibrate_args(p):
    _config_args(p)
    p.add_argument("--out", help="profile directory (default: the cache, keyed by fingerprints)")


def _build_model_args(p):
    _config_args(p)
    _seed_arg(p)


def _bench_args(p):
    p.add_argument("--quick", action="store_true", help="toy sizes, minutes (CI); writes under runs/bench-quick/")
    p.add_argument("--only", default="", help="comma-separated parts to re-run (the others keep their numbers)")
    p.add_argument("--out", help="report directory: results.md and results/ (default docs/)")
    p.add_argument("--render-only", action="store_true", help="re-render results.md from the sections on disk")


def _plot_args(p):
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (its metrics.jsonl)")


def _export_args(p):
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="a run directory (its newest checkpoint) or one checkpoint directory")
    p.add_argument("out", metavar="OUT", help="the model directory to write (new or empty)")
    p.add_argument("--step", type=int, help="export this step's checkpoint (default: the newest complete one)")


def _eval_args(p):
    _config_args(p)
    p.add_argument("models", nargs="+", metavar="MODEL",
                   help="a model directory, a run directory (its newest checkpoint, exported) or a checkpoint "
                   "directory; the first is judged, each other one is paired against it (e.g. the base model)")
    p.add_argument("--precision", help="the engine's precision (default: the config's rollout precision where it "
                   "is fp32, bf16 or fp16, else this machine's fastest of those: the model unquantized)")
    p.add_argument("--out", help="also write the report here as JSON")


def _up_args(p):
    _config_args(p)
    _run_shape_args(p)
    p.add_argument("--learner-ranks", type=int, help=LEARNER_RANKS_HELP)
    p.add_argument("--autoscale", metavar="MIN:MAX", help="size the rollout fleet to the learner's "
                   "fleet_desired_workers within MIN..MAX workers (rlpipe/autoscale.py); starts MIN unless --workers")
    _run_place_args(p)


def _status_args(p):
    p.add_argument("--run-dir", help="the run's directory (default: the newest running `up` under --runs-dir)")
    _runs_dir_arg(p)


def _restart_args(p):
    p.add_argument("role", choices=["learner", "rollout"], help="which role's processes")
    _status_args(p)


def _scale_args(p):
    _restart_args(p)
    p.add_argument("replicas", type=int, help="how many processes of the role to run")


def _overrides(args) -> dict:
    out = {}
    for item in args.set:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        key, value = item.split("=", 1)  # KEY= is the empty string (YAML reads it as null): "no tool", "no dataset"
        out[key.strip()] = parse_yaml(value, f"--set {key.strip()}") if value.strip() else ""
    if "," in (getattr(args, "precision", None) or ""):
        fleet = [p.strip() for p in args.precision.split(",")]
        out["rollout.fleet"], args.precision = fleet, fleet[0]
    if getattr(args, "autoscale", None):
        lo, sep, hi = args.autoscale.partition(":")
        if not (sep and lo.strip().isdigit() and hi.strip().isdigit()):
            raise ConfigError(f"--autoscale {args.autoscale!r}: expected MIN:MAX, two worker counts (e.g. 1:4)")
        out.update({"autoscale.enabled": True, "autoscale.min_workers": int(lo), "autoscale.max_workers": int(hi),
                    "workers": args.workers if args.workers is not None else int(lo)})
    for flag, key in (("steps", "steps"), ("seed", "seed"), ("workers", "workers"), ("precision", "rollout.precision"),
                      ("is_mode", "learner.is_mode"), ("run_id", "run_id"), ("port", "rollout.port"),
                      ("learner_ranks", "learner.ranks")):
        value = getattr(args, flag, None)
        if value is not None:
            out[key] = value
    return out


def _usage_error(e: Exception) -> int:
    """A bad config, file, port or argument: one line naming it, exit 2 (no traceback)."""
    print("rlpipe: error: " + " ".join(str(e).split("\n")), file=sys.stderr)
    return 2


def check_launch(cfg, command: str) -> None:
    """What can be known wrong before anything starts: an exposed API or sync store, the
    model, and the ports this command will listen on (a rank under torchrun leaves the
    learner's port to rank 0, checked before torchrun started)."""
    from launch.role_setup import check_listen
    from rlpipe.auth import check_exposure, check_sync_exposure

    if command == "rollout":
        check_exposure(cfg.rollout.host, "rollout.host", cfg.allow_unauthenticated)
    if command == "learner":
        check_exposure(cfg.learner.host, "learner.host", cfg.allow_unauthenticated)
        check_sync_exposure(cfg.sync.host)
    if command in ("demo", "check", "up", "calibrate", "build-model", "rollout", "learner", "eval"):
        check_model_path(cfg.model.path, builds_toy=command not in ("rollout", "learner"))
    if command == "learner" and "WORLD_SIZE" not in os.environ:
        # demo and up check these at launch; a learner started on its own (Kubernetes, Slurm) too
        validate_run(cfg)
    if command == "rollout" or (command in ("demo", "up") and cfg.rollout.port):
        check_listen("rollout", cfg.rollout.host, cfg.rollout.port)
    if (command == "learner" and "WORLD_SIZE" not in os.environ) or (command in ("demo", "up") and cfg.learner.port):
        check_listen("learner", cfg.learner.host, cfg.learner.port)


def _error(e: Exception, code: int) -> int:
    """A failure the command can name: one line, exit ``code`` (2: bad input, 3: Redis unreachable)."""
    print(f"rlpipe: error: {e}", file=sys.stderr)
    return code


def _stop_on_sigterm() -> None:
    """SIGTERM stops like Ctrl-C: every child is stopped, none orphaned."""
    import signal

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)


def _run_demo(args, cfg) -> int:
    _stop_on_sigterm()
    from launch.demo import format_summary, run_demo

    try:
        summary = run_demo(cfg, runs_dir=args.runs_dir, timeout_s=args.timeout)
    except KeyboardInterrupt:
        return 130
    except (ConfigError, FileNotFoundError) as e:
        return _error(e, 2)
    print(format_summary(summary))
    if summary.get("stopped"):
        print(f"rlpipe: {summary['stopped']}", file=sys.stderr)
    return 0 if summary.get("completed") else 130 if summary.get("interrupted") else 1


def _run_up(args, cfg) -> int:
    _stop_on_sigterm()
    from launch.up import run_up

    try:
        return run_up(cfg, runs_dir=args.runs_dir)
    except (ConfigError, FileNotFoundError) as e:
        return _error(e, 2)


def _role(label: str, start) -> int:
    """Run a role process's ``start()``: its log label, stopped with its parent, and the exit
    codes a supervisor acts on (2: a missing or mismatched profile, 3: Redis unreachable)."""
    from launch.role_setup import exit_with_parent, setup_logging

    setup_logging(label)
    exit_with_parent()
    from quant.quant_profile import ProfileError
    from rlpipe.redis_link import RedisUnavailable

    try:
        return start()
    except ProfileError as e:  # a missing profile, or one made for another model or scheme
        return _error(e, 2)
    except RedisUnavailable as e:  # at start, or an outage longer than redis_wait_s: a supervisor restarts us
        return _error(e, 3)


def _run_rollout(args, cfg) -> int:
    from launch.role_setup import apply_cpu_affinity

    apply_cpu_affinity()  # first: the cores the launcher gave this role, before vLLM's engine process starts

    def start():
        from rollout_service.server import serve

        serve(cfg, args.worker_id, args.address_file)
        return 0

    return _role(f"rollout[{args.worker_id}]", start)


def _run_learner(args, cfg) -> int:
    # First: the cores the launcher gave this role (RLPIPE_CPU_AFFINITY), before any thread
    # or torchrun's ranks start; they all inherit the mask.
    from launch.role_setup import apply_cpu_affinity

    apply_cpu_affinity()
    if (cfg.learner.ranks > 1 or cfg.learner.nodes > 1) and "WORLD_SIZE" not in os.environ:
        # Several ranks: become `torchrun ... -m launch.cli <these arguments>` (same pid, so the
        # launcher, `rlpipe up` or the kubelet keeps signalling the process it started).
        import shlex

        from launch.launcher import torchrun_command

        cmd, env = torchrun_command(cfg, args.argv)
        print(f"rlpipe learner: learner.ranks={cfg.learner.ranks} x nodes={cfg.learner.nodes}, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}: "
              f"{shlex.join(cmd)}", file=sys.stderr, flush=True)
        os.execve(sys.executable, cmd, env)

    def start():
        from learner.main import main as learner_main

        return learner_main(cfg)

    rank = f"[rank {os.environ.get('RANK', '0')}]" if "WORLD_SIZE" in os.environ else ""
    return _role(f"learner{rank}", start)


def _stderr_log(message: str) -> None:
    print(message, file=sys.stderr)


def _run_calibrate(args, cfg) -> int:
    from launch.demo import resolve_model, resolve_quant_profile

    model_path = resolve_model(cfg, log=_stderr_log)
    try:
        out = resolve_quant_profile(cfg, model_path, args.out or cfg.quant.int8.profile or None, log=_stderr_log)
    except (FileNotFoundError, ValueError) as e:
        return _error(e, 2)
    print(out)
    return 0


def _run_build_model(args, cfg) -> int:
    from launch.demo import resolve_model

    print(resolve_model(cfg, log=_stderr_log))
    return 0


def _run_bench(args, cfg) -> int:
    from launch import bench

    return bench.main(args.quick, args.only, args.out, args.render_only)


def _run_plot(args, cfg) -> int:
    from pathlib import Path

    from launch.plots import fleet_changed, plot_fleet, plot_run
    from learner.metrics import read_jsonl

    rows = read_jsonl(Path(args.run_dir) / "metrics.jsonl")
    if not rows:
        print(f"rlpipe: error: no metrics in {args.run_dir}", file=sys.stderr)
        return 2
    print(plot_run(rows, Path(args.run_dir) / "metrics.png",
                   evals=read_jsonl(Path(args.run_dir) / "metrics.jsonl", kind="eval")))
    if fleet_changed(rows):  # scaled, by hand or by the autoscaler
        print(plot_fleet(rows, Path(args.run_dir) / "fleet.png"))
    return 0


def _run_export(args, cfg) -> int:
    from launch.export import ExportError, export

    try:
        out = export(args.run_dir, args.out, args.step)
    except ExportError as e:
        return _error(e, 2)
    print(out)
    return 0


def _run_eval(args, cfg) -> int:
    """Held-out accuracy of each MODEL as the run's summary scores it, the first paired against the others."""
    import json

    from launch.demo import format_summary
    from launch.evaluate import compare

    try:
        report = compare(cfg, args.models, cfg.rollout.precision if args.precision else None,
                         say=lambda m: print(m, file=sys.stderr))
    except ConfigError as e:
        return _error(e, 2)
    for i, m in enumerate(report["models"]):
        lines = {"model": m["model"], "precision": report["precision"], "dataset": report["dataset"],
                 **{k: v for k, v in m.items() if k not in ("model", "result", "paired")},
                 **{f"paired_{k}": v for k, v in m.get("paired", {}).items()}}
        print(format_summary(lines, "rlpipe eval" + (" (judged)" if i == 0 and len(report["models"]) > 1 else "")))
    if args.out:
        from pathlib import Path

        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _run_control(args, cfg) -> int:
    """status, restart, scale: act on a running `rlpipe up` through its run directory."""
    from launch import up
    from rlpipe.redis_link import RedisUnavailable

    try:
        run_dir = up.find_run(args.run_dir, args.runs_dir)
        if args.command == "status":
            print(up.status_table(run_dir))
        else:
            print(up.request(run_dir, args.role, args.replicas if args.command == "scale" else None))
    except (FileNotFoundError, ValueError) as e:
        return _error(e, 2)
    except RedisUnavailable as e:  # down, or a password the run keeps out of its config.yaml
        return _error(f"{e} (a password: RLPIPE_REDIS_PASSWORD or RLPIPE_REDIS_PASSWORD_FILE)", 3)
    return 0


# name -> (help, add its arguments, run it as run(args, cfg) -> exit code). A command whose
# arguments include --config (_config_args) gets its config loaded and checked (check_launch)
# before it runs; the others get cfg None. The run functions import what they need, so
# parsing, --help and config errors stay instant.
def _run_check(args, cfg) -> int:
    """A dry run: every launch check ``rlpipe demo`` makes (the config, the model, the data, the reward,
    the cores and GPUs), then the resolved config and the plan, with nothing started."""
    import yaml

    from launch.checks import validate_run
    from launch.gpus import launch_plan
    from launch.demo import check_cpus
    from rlpipe.config import without_secrets
    from rlpipe.machine import auto_precision, cpu_name

    try:
        validate_run(cfg)
        check_cpus(cfg)
        plan = launch_plan(cfg)
    except ConfigError as e:
        return _error(e, 2)
    print(yaml.safe_dump(without_secrets(cfg).model_dump(mode="json"), sort_keys=False), end="")
    print(f"# machine: {cpu_name()}; auto picks rollout {auto_precision()[0]}, learner {auto_precision()[1]}")
    print(f"# plan: {cfg.workers} rollout workers ({', '.join(cfg.rollout.worker_precision(i) for i in range(cfg.workers))}), "
          f"a learner of {cfg.learner.ranks} rank(s); "
          + (f"GPUs: learner {plan.learner}, workers {plan.workers}" if plan.learner or plan.workers else "CPU only"))
    print("rlpipe check: every check passed; nothing was started", file=sys.stderr)
    return 0


COMMANDS = {
    "demo": ("run a whole RL job on this machine: the toy task by default, or --config's", _demo_args, _run_demo),
    "check": ("check a run as `rlpipe demo` would, print its resolved config and plan, and start nothing", _demo_args,
              _run_check),
    "rollout": ("run one rollout worker", _rollout_args, _run_rollout),
    "learner": ("run the learner", _config_args, _run_learner),
    "calibrate": ("int8 rollout: one SmoothQuant calibration of the base model (nvidia-modelopt); writes the "
                  "profile and a compressed-tensors checkpoint", _calibrate_args, _run_calibrate),
    "build-model": ("prepare (or find) the cached model, toy or built-in, and print its path", _build_model_args, _run_build_model),
    "bench": ("regenerate the evidence report (docs/results.md): every benchmark in bench/", _bench_args, _run_bench),
    "plot": ("draw metrics.png for a run directory", _plot_args, _run_plot),
    "export": ("write a run's checkpoint (LoRA merged into its base) as a Hugging Face model directory that "
               "transformers and vLLM load without rlpipe", _export_args, _run_export),
    "eval": ("held-out accuracy of model directories, runs or checkpoints as a run's summary scores it, the "
             "first paired row by row against the others", _eval_args, _run_eval),
    "up": ("run the learner and workers on this machine, restarted when they crash, as the Kubernetes "
           "manifests run them", _up_args, _run_up),
    "status": ("print the roles, versions, lag, queue and sync of a running `rlpipe up`", _status_args, _run_control),
    "restart": ("restart a role of a running `rlpipe up` (SIGTERM, then start it again)", _restart_args,
                _run_control),
    "scale": ("set how many of a role a running `rlpipe up` runs", _scale_args, _run_control),
}


def _parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    p = argparse.ArgumentParser(prog="rlpipe", description="asynchronous RL for LLMs with quantized vLLM rollout")
    p.add_argument("--version", action="version", version=f"rlpipe {version('rlpipe')}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (text, add_arguments, _) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=text))
    return p


# rlpipe's top-level packages: bound first, so that a folder of the same name in the working
# directory never stands in for one (launcher.ROLE_ENV's PYTHONSAFEPATH, and _working_dir_last).
PACKAGES = ("launch", "learner", "quant", "rlpipe", "rollout_service", "weight_sync")


def _working_dir_last() -> None:
    """Import rlpipe's packages, then let the working directory's modules (a user's reward, an
    environment) import from the end of the path: a role starts with PYTHONSAFEPATH, which keeps
    the working directory off the front of it, and the ``rlpipe`` command's path starts with its
    own directory instead."""
    import importlib

    for name in PACKAGES:
        importlib.import_module(name)
    if os.getcwd() not in sys.path:  # also the launcher's: the checks import a user's reward as the roles will
        sys.path.append(os.getcwd())


def main(argv: list[str] | None = None) -> int:
    _working_dir_last()
    args = _parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # what a learner of several ranks hands torchrun
    try:
        cfg = load_config(args.config, **_overrides(args)) if "config" in vars(args) else None
        if cfg is not None:
            check_launch(cfg, args.command)
    except ConfigError as e:
        return _usage_error(e)
    return COMMANDS[args.command][2](args, cfg)


if __name__ == "__main__":
    sys.exit(main())
