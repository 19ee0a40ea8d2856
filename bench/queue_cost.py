"""Queue cost per group: serialization plus Redis time, as a fraction of a learner step.

For groups of about 1k and 8k tokens (``--n`` samples, prompt + response tokens summed
over the samples), each repetition sends one group through the real code paths against
a private ``redis-server`` (``EmbeddedRedis``, AOF on, as a run has it):

- ``lease``: ``TrajectoryQueue.lease_prompts`` of one prompt (the worker's hand-out script);
- ``encode``: ``encode_group``, which also validates the record by decoding it again;
- ``push``: the Redis part of ``TrajectoryQueue.push(rec, worker_id)``, the leased-push
  Lua script (XADD); ``push`` encodes inside, so that encode is timed there and taken off;
- ``read+decode+ack``: ``TrajectoryQueue.read`` (XREADGROUP + ``decode_group``, as the
  learner's ``collect`` reads) and ``TrajectoryQueue.ack`` (XACK + XDEL, counted).

One group at a time: the learner reads up to ``groups_per_step`` at once and acknowledges
a checkpoint's groups in one script, so its round trips per group are fewer than here.
Medians and p90 over ``--repeats`` repetitions, the two sizes interleaved.

The learner step is ``PPOStep.train_step`` (recompute pi_old, ``ppo_epochs`` updates,
metrics; no collect, sync or checkpoint) of the toy model over ``--groups-per-step``
groups of each size, built by learner/synthetic_groups.py's ``synthetic_groups`` (mu is the model's
own log-prob plus noise). The toy is trained on 64 positions; longer rows cost the same
compute, their values mean nothing.

    python bench/queue_cost.py                    # 200 repetitions, 8 groups per step
    python bench/queue_cost.py --quick --json /tmp/queue.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import rlpipe.queue as rq  # noqa: E402
from launch.redis_server import EmbeddedRedis  # noqa: E402
from launch.results import Section, figure  # noqa: E402
from rlpipe.queue import TrajectoryQueue  # noqa: E402
from rlpipe.redis_link import connect  # noqa: E402

PROMPT_TOKENS = 8  # what synthetic_groups' prompts have: <bos> a a + b b =
SIZES = {"1k": 1024, "8k": 8192}  # tokens per group, prompt + response over the samples
PHASES = ("lease", "encode", "push", "read", "decode", "ack")


class Timed:
    """Wraps a function that a queue method calls inside, adding up the seconds it took,
    so one real call of ``push`` (or ``read``) gives both its total and this part."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.seconds += time.perf_counter() - t0

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


def make_records(model_path: str, total: int, n: int, count: int, seed: int) -> list:
    """``count`` groups of ``n`` samples, ``total`` tokens in all, shaped as a worker sends
    them: every sample spans one weight update (a ``versions`` array, the heaviest record)."""
    from learner.synthetic_groups import load_quietly, synthetic_groups

    length = total // n - PROMPT_TOKENS
    records = synthetic_groups(load_quietly(model_path), count, n, length, length, seed)
    for rec in records:
        rec.policy_version, rec.policy_version_end = 0, 1
        rec.sampling["max_tokens"] = length
        for s in rec.samples:
            s.versions = (np.arange(length) >= length // 2).astype(np.int32)
            s.reward_info = {"answer": "82", "parsed": "82" if s.reward else "81", "correct": bool(s.reward)}
    return records


def one_group(q: TrajectoryQueue, rec, enc: Timed, dec: Timed, worker: str = "w0") -> dict:
    """Seconds of each phase for one group, leased, pushed, read and acknowledged."""
    t0 = time.perf_counter()
    (index, attempt), = q.lease_prompts(worker, 1).prompts
    t1 = time.perf_counter()
    rec.prompt_index, rec.attempt = index, attempt
    entry_id = q.push(rec, worker)
    t2 = time.perf_counter()
    (entry,) = q.read("learner-0", 1, block_ms=None)
    t3 = time.perf_counter()
    q.ack([entry.entry_id])
    t4 = time.perf_counter()
    assert entry_id == entry.entry_id and entry.record.prompt_index == index
    encode, decode = enc.take(), dec.take()
    return {"lease": t1 - t0, "encode": encode, "push": t2 - t1 - encode, "read": t3 - t2 - decode,
            "decode": decode, "ack": t4 - t3}


def learner_steps(learner, records: list, steps: int, warmup: int) -> list[float]:
    """Seconds of ``learner.ppo.train_step(records)``, ``steps`` times after ``warmup`` untimed ones."""
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        learner.ppo.train_step(records)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def make_learner(model_path: str, redis_url: str, work: Path, groups: int):
    """A real learner on the toy model, 1 torch thread (as bench/learner_speed.py runs it: on a shared
    box, threads that wait on each other spin and one step took 10x longer with 2 than with 1)."""
    from learner.train import Learner
    from rlpipe.config import build_config

    return Learner(build_config({}, environ={}, run_id=f"bench-queue-learner-{time.monotonic_ns()}",
                                run_dir=str(work), redis_url=redis_url,
                                **{"model.path": model_path, "learner.groups_per_step": groups,
                                   "learner.threads": 1}))


def p90(xs: list[float]) -> float:
    return float(np.percentile(xs, 90))


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=str(ROOT / "docs" / "results" / "queue.json"))
    ap.add_argument("--quick", action="store_true", help="few repetitions, 1 group per step, 1 learner step "
                    "without a warm-up step (under 30 s)")
    ap.add_argument("--repeats", type=int, help="groups timed per size (default 200; quick 20)")
    ap.add_argument("--groups-per-step", type=int, help="groups in the timed learner step (default 8; quick 1)")
    ap.add_argument("--learner-steps", type=int, help="timed learner steps per size, after a warm-up (default 3; "
                    "quick 1)")
    ap.add_argument("--n", type=int, default=8, help="samples per group")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for key, normal, small in (("repeats", 200, 20), ("groups_per_step", 8, 1), ("learner_steps", 3, 1)):
        if getattr(args, key) is None:
            setattr(args, key, small if args.quick else normal)
    return args


def time_queue(q: TrajectoryQueue, records: dict, repeats: int, warmup: int, enc: Timed, dec: Timed,
               t_start: float) -> dict[str, dict[str, list[float]]]:
    """Seconds of each phase, per size, of ``repeats`` groups after ``warmup`` untimed ones."""
    times: dict[str, dict[str, list[float]]] = {name: {p: [] for p in PHASES} for name in SIZES}
    for rep in range(warmup + repeats):
        for name in SIZES:  # interleaved: drift on a shared machine hits both sizes
            rec = records[name][rep % len(records[name])]
            t = one_group(q, rec, enc, dec)
            if rep >= warmup:
                for p in PHASES:
                    times[name][p].append(t[p])
        if (rep + 1) % 50 == 0:
            print(f"[{time.perf_counter() - t_start:.0f}s] queue: {rep + 1}/{warmup + repeats} "
                  "repetitions", file=sys.stderr, flush=True)
    c = q.counters()
    assert c["produced"] == c["trained"] == 2 * (warmup + repeats) and q.length() == 0, c
    return times


def measure(args, model_path: str, records: dict, warmup: int, t_start: float):
    """Against a private redis-server: the queue's phases per group (:func:`time_queue`), then
    the learner's steps over each size's groups; ``(times, step_s)``."""
    # Time encode and decode inside the real push and read: the queue module's own references.
    enc, dec = Timed(rq.encode_group), Timed(rq.decode_group)
    rq.encode_group, rq.decode_group = enc, dec
    step_s: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="rlpipe-bench-queue-") as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis").start()
        try:
            q = TrajectoryQueue(connect(server.url), f"bench-queue-{time.monotonic_ns()}")
            q.ensure_consumer_group()
            times = time_queue(q, records, args.repeats, warmup, enc, dec, t_start)
            learner = make_learner(model_path, server.url, Path(tmp) / "learner", args.groups_per_step)
            for name in SIZES:
                step_s[name] = learner_steps(learner, records[name], args.learner_steps, 0 if args.quick else 1)
                print(f"[{time.perf_counter() - t_start:.0f}s] learner step, {args.groups_per_step} x {name}: "
                      f"{statistics.median(step_s[name]):.3f}s", file=sys.stderr, flush=True)
        finally:
            server.stop()
    rq.encode_group, rq.decode_group = enc.fn, dec.fn
    return times, step_s


def per_size(args, records: dict, times: dict, step_s: dict):
    """The rows of the three measured tables (median, p90, per learner step) and each size's numbers."""
    g = args.groups_per_step
    rows_med, rows_p90, rows_step, data = [], [], [], {}
    for name, total in SIZES.items():
        rec = records[name][0]
        response = sum(len(s.tokens) for s in rec.samples)
        nbytes = len(rq.encode_group(rec))
        med = {p: statistics.median(v) * 1e3 for p, v in times[name].items()}
        hi = {p: p90(v) * 1e3 for p, v in times[name].items()}
        rd = med["read"] + med["decode"] + med["ack"]
        per_group = med["lease"] + med["encode"] + med["push"] + rd
        shape = f"{args.n} x ({PROMPT_TOKENS}+{response // args.n})"
        rows_med.append([name, shape, total, nbytes, med["lease"], med["encode"], med["push"], rd, med["decode"],
                         per_group, per_group * 1e3 / total])
        rd_hi = p90([a + b + c for a, b, c in zip(*(times[name][p] for p in ("read", "decode", "ack")))]) * 1e3
        tot_hi = p90([sum(t) for t in zip(*times[name].values())]) * 1e3
        rows_p90.append([name, hi["lease"], hi["encode"], hi["push"], rd_hi, hi["decode"], tot_hi])
        step = statistics.median(step_s[name])
        rows_step.append([name, g, per_group * g, rd * g, step, per_group * g / 1e3 / step, rd * g / 1e3 / step,
                          step * 1e6 / (g * total)])
        data[name] = {"tokens": total, "response_tokens": response, "bytes": nbytes, "median_ms": med,
                      "p90_ms": hi, "queue_ms": per_group, "learner_side_ms": rd, "learner_step_s": step_s[name],
                      "samples_s": {p: v for p, v in times[name].items()}}
    return rows_med, rows_p90, rows_step, data


def measured_tables(sec: Section, args, warmup: int, rows_med: list, rows_p90: list, rows_step: list) -> None:
    import torch

    sec.table("Per group (median)", ["group", "samples x (prompt+response)", "tokens", "bytes", "lease ms",
                                     "encode ms", "push ms", "read+decode+ack ms", "(decode ms)", "queue ms",
                                     "queue µs/token"], rows_med,
              note=f"median of {args.repeats} groups per size after {warmup} warm-up; push is the Redis part "
                   "(the encode inside push is the encode column); queue ms = lease + encode + push + "
                   "read+decode+ack")
    sec.table("Per group (p90)", ["group", "lease ms", "encode ms", "push ms", "read+decode+ack ms", "(decode ms)",
                                  "queue ms"], rows_p90)
    sec.table("Per learner step", ["group", "groups/step", "queue ms/step", "learner-side ms/step", "learner step s",
                                   "queue / step", "learner-side / step", "learner µs/token"], rows_step,
              note=f"learner step: median of {args.learner_steps} PPOStep.train_step calls "
                   f"{'(no warm-up: --quick)' if args.quick else 'after a warm-up'}, toy "
                   f"model, torch {torch.__version__} on CPU, learner.threads 1; learner-side "
                   "= read+decode+ack, the part on the learner's critical path (workers encode and push in "
                   "parallel with the step)")


def scaled_table(sec: Section, data: dict) -> None:
    """What the measured µs/token would cost a learner of a given throughput (arithmetic)."""
    ref = [1e4, 1e5, 1e6]
    scaled = []
    for name, total in SIZES.items():
        for part, ms in (("all", data[name]["queue_ms"]), ("learner side", data[name]["learner_side_ms"])):
            scaled.append([name, part, ms * 1e3 / total, *[ms * 1e3 / total * t / 1e6 for t in ref]])
    sec.table("Queue time / learner step time at a learner throughput of T tokens/s (arithmetic, not measured)",
              ["group", "part", "µs/token", *[f"T = {t:.0e}" for t in ref]], scaled,
              note="fraction = µs/token x T / 1e6: what the queue costs against a real learner's step, whatever "
                   "its model and hardware; above 1, one queue client (single-threaded) cannot keep up")


def phases_plot(sec: Section, args, data: dict) -> None:
    fig, axes = figure()
    ax, bottom = axes[0][0], np.zeros(len(SIZES))
    for label, keys in (("lease", ["lease"]), ("encode", ["encode"]), ("push (Redis)", ["push"]),
                        ("read (XREADGROUP)", ["read"]), ("decode", ["decode"]), ("ack", ["ack"])):
        vals = np.array([sum(data[n]["median_ms"][k] for k in keys) for n in SIZES])
        ax.bar(list(SIZES), vals, bottom=bottom, label=label)
        bottom += vals
    ax.set_ylabel("ms per group (median)")
    ax.set_title(f"Queue time per group, {args.n} samples")
    ax.legend(fontsize=8)
    sec.plot(fig, "per_group", "Median ms per group by phase: worker side (lease, encode, push) and learner "
             "side (read, decode, ack), against a local redis-server")


def section(args, warmup: int, rows_med: list, rows_p90: list, rows_step: list, data: dict) -> Section:
    """The queue's part of the evidence report (rlpipe/results.py)."""
    sec = Section("queue", "Queue: serialization and Redis per group")
    measured_tables(sec, args, warmup, rows_med, rows_p90, rows_step)
    scaled_table(sec, data)
    phases_plot(sec, args, data)
    sec.note("Measured on CPU with a loopback redis-server (AOF everysec, as the embedded one runs), one group at "
             "a time; each sample carries a versions array and a small reward_info (a record of "
             "a group that spans a weight update: 12 bytes per response token). encode_group also decodes what it "
             "wrote, to validate it, so encode includes one decode.")
    sec.note("The learner step is the toy model's (0.5 M parameters) on CPU: on a GPU the toy's step would be far "
             "shorter, but real models are far larger, so the fraction above says little by itself. What carries "
             "over is the absolute cost: queue µs per token (CPU-bound serialization and a local Redis, not the "
             "model). Multiply it by a real learner's tokens/s for its fraction (last table); over a network, "
             "add the transfer of the bytes per group.")
    sec.data = {"args": vars(args), "per_group": data}
    return sec


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    warmup = max(2, args.repeats // 20)

    from launch.toy import TOY_SPEC, ensure_toy_model

    t_start = time.perf_counter()
    model_path = str(ensure_toy_model(TOY_SPEC, log=lambda m: print(m, file=sys.stderr)))
    records = {name: make_records(model_path, total, args.n, args.groups_per_step, args.seed)
               for name, total in SIZES.items()}
    print(f"[{time.perf_counter() - t_start:.0f}s] built {args.groups_per_step} groups of each size",
          file=sys.stderr, flush=True)
    times, step_s = measure(args, model_path, records, warmup, t_start)
    sec = section(args, warmup, *per_size(args, records, times, step_s))
    path = sec.write(args.json)

    print(f"Queue cost per group ({args.n} samples), median of {args.repeats}; learner step over "
          f"{args.groups_per_step} groups, median of {args.learner_steps}; {time.perf_counter() - t_start:.0f}s")
    for t in sec.tables:
        print(f"\n{t['title']}\n| " + " | ".join(t["columns"]) + " |")
        for row in t["rows"]:
            print("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row) + " |")
    print(f"\nwrote {path}")
    return sec.to_dict()


if __name__ == "__main__":
    main()
