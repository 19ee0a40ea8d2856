"""Learner training throughput, configurations side by side: response tokens per second
of training (``learner_tokens_per_second``: the step's tokens over the time of
``train_step``, the recompute pass and every PPO epoch; collecting, weight sync and
checkpoints excluded) for each of

- ``dtype``: ``learner.dtype`` fp32 (baseline), bf16, fp16 (autocast over fp32 master weights);
- ``is_mode``: every ``learner.is_mode`` of ``rlpipe.config.IsMode`` against ``none``;
- ``microbatch``: one padded forward (baseline) against token-budget micro-batches
  (``learner.max_tokens_per_microbatch``), on the ragged response lengths every run gets;
- ``parallel``: 2 gloo ranks under torchrun with ``learner.parallel: ddp`` (baseline)
  and ``fsdp``, and the single process for reference (each rank has 1 thread, so
  2 ranks use 2 cores);
- ``checkpoint``: the time checkpoints hold up the step (``checkpoint_blocking_seconds``,
  the mean over checkpoint steps, one checkpoint every step) with
  ``learner.async_checkpoint`` false (baseline) and true. Lower is better here.
- ``lora``: the full fine-tune (baseline) against a rank-8 adapter on the frozen base
  (``learner.lora.rank``: the optimizer holds the adapter alone, the base gets no gradient),
  and the recipe's learner (the adapter in bf16 autocast, one PPO epoch);
- ``compile``: eager (baseline) and ``learner.compile`` (each decoder layer
  ``torch.compile``d). Its first steps (each new batch shape until shapes turn dynamic)
  compile for tens of seconds; like every run's first step, the median leaves them out
  only partly, so use ``--steps 8`` or more for this group.

Each configuration is a real learner process (``python -m launch.cli learner``, under
``python -m torch.distributed.run --standalone --nproc-per-node 2`` for 2 ranks), as a
deployment runs it, reading its own Redis stream (an embedded ``redis-server``),
pre-filled with the same synthetic groups: random prompts and answers to the toy
model's task, response lengths drawn uniformly from ``--min-len..--max-len`` (ragged on
purpose), behavior log-probs the model's own plus noise, rewards 0/1 in every group. A
run trains ``--steps`` steps from the same base weights; the first step (warm-up) is
left out and a run's value is the median of the rest. Every configuration runs once per
round, in a fresh shuffled order each round, so drift on a shared machine hits them
all; the table shows the median over rounds and its ratio to the group's baseline
(ratio = value / baseline value: above 1 is faster for tokens/s, below 1 is less
blocking for checkpoints); beside it, each configuration's peak memory (the learner
process's peak resident set, the kernel's ``ru_maxrss``, median over rounds), and its model
FLOP/s (:func:`flops_per_token` x tokens/s: the passes the trained tokens needed, not the prompt,
padding or recompute) against one core's peak from its flags and clock (rlpipe/machine.py
``core_peak``) and against a 1-thread GEMM of a SmolLM2 MLP's shape measured in the same run. Every
process gets ``learner.threads: 1`` and ``OMP_NUM_THREADS=1``, so 1-rank and 2-rank rows
compare. A configuration that fails
(an unknown config key on this checkout, an error in the learner) is printed as failed
with the error's last line; the others still run.

Where CUDA is available, a second part times one training step (the learner's own
``token_logprobs`` in bf16 autocast, a policy-gradient loss, backward, AdamW) of a
Qwen2 shaped like Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocab 151936) with random weights, with and without
``learner.activation_checkpointing``, and reports step time, MFU (model FLOPs 6N per
token plus attention, against the GPU's dense bf16 peak; the recompute is not counted)
and peak memory. On CPU it prints that it was skipped.

    python bench/learner_speed.py                         # every group, 3 rounds (about 13 min on 2 cores)
    python bench/learner_speed.py --only dtype,microbatch --rounds 5
    python bench/learner_speed.py --quick --only dtype/fp32,dtype/bf16 --out /tmp/l.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlpipe.config import ConfigError, IsMode, build_config, dump_config  # noqa: E402

TOKENS = "learner_tokens_per_second"
BLOCKING = "checkpoint_blocking_seconds"


@dataclass
class Row:
    name: str  # as --only names it: group/name
    label: str  # in the table
    settings: dict  # config keys on top of the common ones
    ranks: int = 1
    note: str = ""
    runs: list[dict] = field(default_factory=list)


@dataclass
class Group:
    name: str
    title: str
    rows: list[Row]  # the first is the baseline
    metric: str = TOKENS


def lever_rows() -> list[Row]:
    """The real model's learner levers (issue: a learner fast enough for a real model), each
    alone and together, against today's defaults before them: one PPO epoch as the recipe."""
    old = {"learner.ppo_epochs": 1, "learner.response_logits": False, "learner.single_pass": False,
           "learner.share_prompt": False}
    new = {"learner.ppo_epochs": 1}
    return [Row("before", "before: full logits, recompute pass, every row's prompt, fp32, 1 thread", old),
            Row("response_logits", "+ logits at response positions only", {**old, "learner.response_logits": True}),
            Row("single_pass", "+ no recompute pass (pi_old from the update)", {**old, "learner.single_pass": True}),
            Row("share_prompt", "+ each group's prompt once", {**old, "learner.share_prompt": True}),
            Row("all", "all three", new),
            Row("all_2threads", "all three, 2 threads (2 cores)", {**new, "learner.threads": 2}),
            Row("all_bf16", "all three, bf16 autocast", {**new, "learner.dtype": "bf16"},
                note="this CPU has no native bf16 (AVX2 only): measured 1.1 GFLOP/s bf16 against 34.5 fp32 in a "
                     "640x576x1536 matmul, 1 thread")]


def groups(args) -> list[Group]:
    ckpt = {"learner.checkpoint_every": 1}
    return [
        Group("levers", "the learner's levers on this model (one PPO epoch)", lever_rows()),
        Group("dtype", "training dtype (learner.dtype)",
              [Row(d, d, {"learner.dtype": d}) for d in ("fp32", "bf16", "fp16")]),
        Group("is_mode", "IS correction (learner.is_mode)",
              [Row(m, m, {"learner.is_mode": m}) for m in typing.get_args(IsMode)]),
        Group("microbatch", f"micro-batches on ragged lengths {args.min_len}..{args.max_len}",
              [Row("padded", "padded (one forward)", {"learner.max_tokens_per_microbatch": 0}),
               Row("token_budget", f"token budget {args.microbatch_tokens}",
                   {"learner.max_tokens_per_microbatch": args.microbatch_tokens})]),
        Group("parallel", "2 gloo ranks, 1 thread each (learner.parallel)",
              [Row("ddp", "ddp, 2 ranks", {"learner.parallel": "ddp"}, ranks=2),
               Row("fsdp", "fsdp, 2 ranks", {"learner.parallel": "fsdp"}, ranks=2),
               Row("single", "1 process (reference)", {})]),
        Group("checkpoint", "checkpoint time on the step's critical path (learner.async_checkpoint)",
              [Row("sync", "synchronous", {**ckpt, "learner.async_checkpoint": False}),
               Row("async", "async", {**ckpt, "learner.async_checkpoint": True})], metric=BLOCKING),
        Group("lora", "a rank-8 LoRA adapter on the frozen base (learner.lora) against the full fine-tune",
              [Row("full", "full fine-tune", {}),
               Row("lora", "LoRA rank 8, every decoder linear", {"learner.lora.rank": 8}),
               Row("recipe", "LoRA rank 8, bf16 autocast, one PPO epoch (configs/smollm2-math.yaml's learner)",
                   {"learner.lora.rank": 8, "learner.dtype": "bf16", "learner.ppo_epochs": 1})]),
        Group("head", "the LM head and softmax in chunks of positions (learner.head_chunk) against the whole "
                      "batch's logits, and the memory levers with it",
              [Row("whole", "whole batch's logits (head_chunk 0)", {"learner.head_chunk": 0}),
               Row("chunked", "chunks of 512 positions", {"learner.head_chunk": 512}),
               Row("chunked_bf16", "chunks of 512, bf16 autocast", {"learner.head_chunk": 512, "learner.dtype": "bf16"}),
               Row("lean", "chunks of 512, activation checkpointing, 1 GiB of activations",
                   {"learner.head_chunk": 512, "learner.activation_checkpointing": True,
                    "learner.share_prompt": False, "learner.activation_memory_gib": 1.0}),
               Row("lean_bf16", "the same, bf16 autocast",
                   {"learner.head_chunk": 512, "learner.activation_checkpointing": True, "learner.dtype": "bf16",
                    "learner.share_prompt": False, "learner.activation_memory_gib": 1.0})]),
        Group("memory", "a full fine-tune's peak memory: the levers one at a time, then together",
              [Row("default", "fp32 AdamW, 4 GiB of activations (the defaults)", {}),
               Row("adamw_8bit", "AdamW's moments in 8 bits (learner.optimizer adamw_8bit)",
                   {"learner.optimizer": "adamw_8bit"}),
               Row("checkpointing", "activation checkpointing, 0.25 GiB of activations",
                   {"learner.activation_checkpointing": True, "learner.activation_memory_gib": 0.25}),
               Row("lean", "both, and the head in chunks of 128 positions",
                   {"learner.optimizer": "adamw_8bit", "learner.activation_checkpointing": True,
                    "learner.activation_memory_gib": 0.25, "learner.head_chunk": 128}),
               Row("lean_mmap", "the same, tensors of 1 MiB and more mapped alone (learner.mmap_threshold_mib 1)",
                   {"learner.optimizer": "adamw_8bit", "learner.activation_checkpointing": True,
                    "learner.activation_memory_gib": 0.25, "learner.head_chunk": 128,
                    "learner.mmap_threshold_mib": 1}),
               Row("lean_sync", "the same, the checkpoint written from the live tensors (no host-memory snapshot)",
                   {"learner.optimizer": "adamw_8bit", "learner.activation_checkpointing": True,
                    "learner.activation_memory_gib": 0.25, "learner.head_chunk": 128,
                    "learner.async_checkpoint": False})]),
        Group("compile", "torch.compile of each decoder layer (learner.compile), steps after the first",
              [Row("eager", "eager", {"learner.compile": False}),
               Row("compiled", "compiled", {"learner.compile": True},
                   note="its first steps compile (tens of seconds each), not counted")]),
    ]


def select(all_groups: list[Group], only: str) -> list[Group]:
    if not only:
        return all_groups
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    known = {g.name for g in all_groups} | {f"{g.name}/{r.name}" for g in all_groups for r in g.rows}
    bad = [w for w in wanted if w not in known]
    if bad:
        raise SystemExit(f"--only: unknown {bad}; choose from {sorted(known)}")
    out = []
    for g in all_groups:
        rows = [r for r in g.rows if g.name in wanted or f"{g.name}/{r.name}" in wanted]
        if rows and rows[0] is not g.rows[0]:
            rows.insert(0, g.rows[0])  # the ratios need the group's baseline
        if rows:
            out.append(Group(g.name, g.title, rows, g.metric))
    return out


def last_error_line(text: str) -> str:
    """The line that names the error in a learner's (or torchrun's) output."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^([\w.]+(Error|Exception|Interrupt)|error|.*\bError:)", ln)]
    line = (errors or lines or ["(no output)"])[-1]
    return line[:300]


def log_tail(path: Path, lines: int = 40) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-lines:]


def run_one(args, group: Group, row: Row, records, model_path: str, redis_url: str, work: Path, rnd: int) -> dict:
    """One learner process (or torchrun of ``row.ranks``) over its own pre-filled stream."""
    from learner.metrics import read_jsonl
    from rlpipe.queue import TrajectoryQueue
    from rlpipe.redis_link import connect

    run_dir = work / f"{group.name}-{row.name}-r{rnd}"
    run_dir.mkdir(parents=True)
    common = {
        "model.path": model_path, "learner.groups_per_step": args.groups, "learner.minibatches": 1,
        "learner.lr": 1e-5, "learner.threads": 1, "learner.checkpoint_every": args.steps,
        "queue.max_staleness": args.steps + 1, "sampling.max_tokens": args.max_len, "sync.join_timeout_s": 0.1,
        "sampling.n": args.n, "rollout.max_model_len": args.max_len + args.prompt_len + 16,  # records fit it
    }
    try:
        cfg = build_config({}, environ={}, run_id=f"bench-{group.name}-{row.name}-{rnd}-{time.monotonic_ns()}",
                           run_dir=str(run_dir), redis_url=redis_url, steps=args.steps, workers=1, seed=0,
                           **{**common, **row.settings})
    except ConfigError as e:
        return {"error": last_error_line(str(e))}
    dump_config(cfg, run_dir / "config.yaml")
    queue = TrajectoryQueue(connect(redis_url), cfg.run_id)
    for rec in records[: args.steps * args.groups]:
        queue.push(dataclasses.replace(rec, run_id=cfg.run_id))  # the reader admits only this run's groups
    learner = ["-m", "launch.cli", "learner", "--config", str(run_dir / "config.yaml")]
    cmd = [sys.executable, *(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(row.ranks)]
                             if row.ranks > 1 else []), *learner]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    log_path = run_dir / "learner.log"
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc, peak_kib = wait_with_peak(proc, args.run_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # this run's own process group (torchrun and its ranks)
            proc.wait()
            return {"error": f"timed out after {args.run_timeout:g}s", "seconds": time.perf_counter() - t0,
                    "log_tail": log_tail(log_path)}
    seconds = time.perf_counter() - t0
    if rc != 0:
        return {"error": f"exit {rc}: {last_error_line(log_path.read_text(errors='replace'))}", "seconds": seconds,
                "log_tail": log_tail(log_path)}
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["step"] > 1]  # the first step warms up
    if group.metric == BLOCKING:  # the steps that took a checkpoint
        every = cfg.learner.checkpoint_every
        steps = [m for m in steps if m["step"] % every == 0 or m["step"] == cfg.steps]
    values = [m[group.metric] for m in steps if m.get(group.metric) is not None]
    if not values:
        return {"error": f"no {group.metric} in metrics.jsonl after step 1", "seconds": seconds}
    value = statistics.mean(values) if group.metric == BLOCKING else statistics.median(values)
    tokens_per_second = statistics.median(m[TOKENS] for m in steps)
    return {"value": value, "values": values, "tokens_per_second": tokens_per_second,
            "gflops": tokens_per_second * flops_per_token(cfg, args.matmul_params) / 1e9,
            "seconds": seconds, "peak_mib": peak_kib / 1024}


def wait_with_peak(proc: subprocess.Popen, timeout: float) -> tuple[int, int]:
    """Wait for ``proc`` as ``Popen.wait`` does, and return its exit code with its peak resident
    set in KiB: the kernel's own high-water mark (``ru_maxrss`` from ``wait4``), the largest of
    the process and the children it waited for (a torchrun's ranks), so no short peak between
    two samples is missed."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_maxrss
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout)
        time.sleep(0.2)


def summarize(group: Group) -> dict:
    rows = []
    for row in group.rows:
        done = [r for r in row.runs if "value" in r]
        ok = [r["value"] for r in done]
        errors = [r["error"] for r in row.runs if "error" in r]
        median = {k: statistics.median(r[k] for r in done) if done and all(k in r for r in done) else None
                  for k in ("tokens_per_second", "peak_mib", "gflops")}
        rows.append({"name": row.name, "label": row.label, "settings": row.settings, "ranks": row.ranks,
                     "note": row.note, "runs": row.runs, "median": statistics.median(ok) if ok else None,
                     "range": [min(ok), max(ok)] if ok else None, **median,
                     "error": errors[-1] if errors and not ok else None})
        if errors and ok:
            rows[-1]["note"] = f"{len(errors)} of {len(row.runs)} runs failed: {errors[-1]}"
    base = rows[0]["median"]
    for r in rows:
        r["ratio"] = r["median"] / base if base and r["median"] is not None else None
    return {"name": group.name, "title": group.title, "metric": group.metric, "baseline": group.rows[0].name,
            "rows": rows}


def print_tables(results: list[dict], header: str, peak: dict, gemm: dict) -> None:
    print(header)
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    speed = [g for g in results if g["metric"] == TOKENS]
    if speed:
        print("\n| group | configuration | tokens/s (median) | rounds' range | ratio vs baseline | peak memory MiB "
              "| GFLOP/s | of core peak | of GEMM | note |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for g in speed:
            for i, r in enumerate(g["rows"]):
                note = f"FAILED: {r['error']}" if r["error"] else r["note"]
                spread = f"{r['range'][0]:,.0f}..{r['range'][1]:,.0f}" if r["range"] else "-"
                gflops, of_peak, of_gemm = peak_columns(r, peak, gemm)
                print(f"| {g['name'] if i == 0 else ''} | {r['label']}{' (baseline)' if i == 0 else ''} | "
                      f"{fmt(r['median'], ',.0f')} | {spread} | {fmt(r['ratio'], '.3f')} | "
                      f"{fmt(r['peak_mib'], ',.0f')} | {fmt(gflops, '.1f')} | {fmt(of_peak, '.0%')} | "
                      f"{fmt(of_gemm, '.0%')} | {note} |")
    for g in (g for g in results if g["metric"] == BLOCKING):
        print(f"\n{g['title']}: seconds a checkpoint step spent blocked on it (mean over checkpoint steps, "
              "median over rounds)")
        print("\n| configuration | blocking s per checkpoint step | rounds' range | ratio vs baseline | "
              "tokens/s (median) | note |")
        print("|---|---:|---:|---:|---:|---|")
        for i, r in enumerate(g["rows"]):
            note = f"FAILED: {r['error']}" if r["error"] else r["note"]
            spread = f"{r['range'][0]:.4f}..{r['range'][1]:.4f}" if r["range"] else "-"
            print(f"| {r['label']}{' (baseline)' if i == 0 else ''} | {fmt(r['median'], '.4f')} | {spread} | "
                  f"{fmt(r['ratio'], '.3f')} | {fmt(r['tokens_per_second'], ',.0f')} | {note} |")


def matmul_params(model) -> int:
    """Weights a token's forward multiplies by: every matrix but the embedding table, and the
    head's (the embedding again where tied). 2 FLOPs each in the forward."""
    n = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name)
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is model.get_input_embeddings().weight
    return n + (out.weight.numel() if tied else 0)


def flops_per_token(cfg, n: int) -> float:
    """Model FLOPs of training one response token under ``cfg``: each PPO epoch a forward (2N)
    and a backward (4N; 2N under LoRA, whose frozen base takes no weight gradient), plus the
    recompute pass's forward where the step takes one (not under learner.single_pass). The
    activation-checkpointing recompute, the prompt and the padding are work the step does
    beyond these, not counted: the FLOP/s is what the trained tokens needed."""
    from learner.step import takes_single_pass

    lc = cfg.learner
    recompute = not takes_single_pass(lc, has_reference=lc.kl_coef > 0)  # learner/reference.py: kl_coef > 0
    backward = 2 * n if lc.lora.rank else 4 * n
    return lc.ppo_epochs * (2 * n + backward) + (2 * n if recompute else 0)


def gemm_gflops(dtype: str, shape: tuple[int, int, int] = (1024, 576, 1536), repeats: int = 8) -> float:
    """The best of ``repeats`` 1-thread matmuls of ``shape`` (a SmolLM2 MLP's), in GFLOP/s: what
    this core's GEMM does in ``dtype``, measured in the same run as the learner's rows."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m, k, n = shape
        a, b = (torch.randn(m, k, dtype=getattr(torch, dtype)), torch.randn(k, n, dtype=getattr(torch, dtype)))
        a @ b
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        return 2 * m * k * n / best / 1e9
    finally:
        torch.set_num_threads(threads)


def peak_columns(row: dict, peak, gemm: dict) -> tuple:
    """A row's GFLOP/s and its share of the core's peak and of the measured GEMM, in its dtype."""
    gflops = row.get("gflops")
    bf16 = row["settings"].get("learner.dtype") == "bf16"
    top = (peak["bf16_gflops"] or peak["fp32_gflops"]) if bf16 else peak["fp32_gflops"]
    best = gemm["bfloat16" if bf16 else "float32"]
    return gflops, gflops / top if gflops else None, gflops / best if gflops else None


# -- the GPU part: one step of a 0.5B-shaped Qwen2 ---------------------------------------------
QWEN_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, vocab_size=151936)
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
                    "A10G": 70.0, "L4": 121.0}  # dense bf16 tensor-core peaks


def step_flops(shape: dict, rows: int, seq: int) -> float:
    """Model FLOPs of one forward+backward over ``rows x seq`` tokens: 6 x (matmul weights,
    the LM head included) per token, plus causal attention's 6 x 2 x layers x seq x hidden."""
    h, layers, inter, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"], \
        shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter  # q, o; k, v; gate, up, down
    tokens = rows * seq
    return 6 * (layers * per_layer + vocab * h) * tokens + 6 * 2 * layers * seq * h * tokens


def gpu_part(args, device: str = "cuda", shape: dict | None = None) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.batch import Batch
    from learner.policy import enable_activation_checkpointing, token_logprobs

    shape = shape or QWEN_05B
    rows, seq, steps = args.gpu_rows, args.gpu_seq, args.gpu_steps
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (rows, seq), generator=gen)
    n = torch.ones(rows)
    batch = Batch(ids, torch.ones_like(ids), ids[:, 1:], torch.ones(rows, seq - 1), torch.zeros(rows, seq - 1),
                  n, n, torch.arange(rows), torch.zeros(rows, dtype=torch.long), n, n, -n.long()).to(device)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    out = {"device": name, "shape": shape, "rows": rows, "seq": seq, "peak_bf16_tflops": peak, "runs": {}}
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**shape, max_position_embeddings=max(seq, 32768),
                                             tie_word_embeddings=True, use_cache=False)).float().to(device)
        model.eval()  # as the learner runs it
        if ckpt:
            enable_activation_checkpointing(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        times = []
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for i in range(steps + 1):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            logp, _ = token_logprobs(model, batch, "bf16")
            (-(logp * batch.advantages[:, None]).mean()).backward()
            opt.step()
            if device == "cuda":
                torch.cuda.synchronize()
            if i:  # the first step warms up
                times.append(time.perf_counter() - t0)
        step_s = statistics.median(times)
        flops = step_flops(shape, rows, seq)
        out["runs"]["checkpointed" if ckpt else "plain"] = {
            "step_s": step_s, "tokens_per_second": rows * seq / step_s, "tflops": flops / step_s / 1e12,
            "mfu": flops / step_s / 1e12 / peak if peak else None,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}
        del model, opt
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def print_gpu(res: dict) -> None:
    print(f"\nOne learner step on {res['device']}: Qwen2 0.5B shape, random weights, bf16 autocast over fp32 "
          f"master weights, {res['rows']} rows x {res['seq']} tokens, median of the steps after the first; "
          f"MFU against {res['peak_bf16_tflops'] or '(unknown; --peak-tflops)'} TFLOP/s dense bf16, "
          "recompute not counted")
    print("\n| activation checkpointing | step s | tokens/s | model TFLOP/s | MFU | peak memory GiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for key, r in res["runs"].items():
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        mem = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        print(f"| {'on' if key == 'checkpointed' else 'off'} | {r['step_s']:.3f} | {r['tokens_per_second']:,.0f} | "
              f"{r['tflops']:.1f} | {mfu} | {mem} |")


def parse_args(argv: list[str] | None):
    """The arguments, with the defaults of ``--real`` and ``--quick`` filled in."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, help="times every configuration runs, interleaved (default 3; quick 1)")
    ap.add_argument("--steps", type=int, help="learner steps per run, the first not counted (default 4; quick 2)")
    ap.add_argument("--groups", type=int, help="groups per step (default 8; quick 4)")
    ap.add_argument("--n", type=int, default=4, help="responses per group")
    ap.add_argument("--min-len", type=int, default=4, help="shortest response (tokens, EOS included)")
    ap.add_argument("--max-len", type=int, help="longest response (default 48; quick 12)")
    ap.add_argument("--microbatch-tokens", type=int, help="the token budget row's "
                    "learner.max_tokens_per_microbatch (default 512; quick 64)")
    ap.add_argument("--only", default="", help="comma-separated groups or group/row, e.g. dtype,parallel/fsdp "
                    "(a group's baseline row always runs)")
    ap.add_argument("--model", default="", help="a local HF model directory (default: the toy model)")
    ap.add_argument("--prompt-len", type=int, default=0, help="prompt length in tokens (default: the toy's 7)")
    ap.add_argument("--real", action="store_true", help="the real model's levers: SmolLM2-135M (built in), prompts "
                    "of 96 tokens, responses of 16..160, 2 groups x 4 per step (--only levers unless given)")
    ap.add_argument("--quick", action="store_true", help="small sizes, 1 round (the test's)")
    ap.add_argument("--run-timeout", type=float, default=300, help="seconds before a run is killed as failed")
    ap.add_argument("--seed", type=int, default=0, help="the synthetic groups and the order of each round")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "learner.json"), help="JSON of every number")
    ap.add_argument("--json", help="also write the report section (launch/results.py) here")
    ap.add_argument("--workdir", help="keep every run's directory (config, log, metrics) here")
    ap.add_argument("--no-gpu", action="store_true", help="skip the GPU part even where CUDA is available")
    ap.add_argument("--gpu-rows", type=int, default=8)
    ap.add_argument("--gpu-seq", type=int, default=1024)
    ap.add_argument("--gpu-steps", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, for MFU (default: by its name)")
    args = ap.parse_args(argv)
    if args.real:
        from launch.builtin_models import ensure_builtin_model
        from rlpipe.paths import SMOLLM2

        args.model = args.model or str(ensure_builtin_model(SMOLLM2, log=lambda m: print(m, file=sys.stderr)))
        args.prompt_len, args.min_len = args.prompt_len or 96, max(args.min_len, 16)
        args.max_len, args.groups, args.only = args.max_len or 160, args.groups or 2, args.only or "levers"
        args.rounds, args.steps = args.rounds or 1, args.steps or 3
    for key, normal, small in (("rounds", 3, 1), ("steps", 4, 2), ("groups", 8, 4), ("max_len", 48, 12),
                               ("microbatch_tokens", 512, 64)):
        if getattr(args, key) is None:
            setattr(args, key, small if args.quick else normal)
    if args.quick:
        args.gpu_rows, args.gpu_seq, args.gpu_steps = 2, 256, 2
    if not 1 <= args.min_len <= args.max_len:
        ap.error("--min-len must be between 1 and --max-len")
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is not counted)")
    return args


def configurations(chosen: list[Group]) -> dict[tuple, list[tuple[Group, Row]]]:
    """The learner configurations to run, each with the (group, row) pairs that report it."""
    # A configuration shared by several groups (fp32 = token_tis = padded = single) runs once a round.
    specs: dict[tuple, list[tuple[Group, Row]]] = {}
    for g in chosen:
        for row in g.rows:
            try:
                resolved = build_config({}, environ={}, **row.settings).learner.model_dump_json()
            except ConfigError:
                resolved = f"{g.name}/{row.name}"  # fails on its own
            specs.setdefault((row.ranks, g.metric, resolved), []).append((g, row))
    return specs


def run_rounds(args, specs: dict, records: list, model_path: str) -> None:
    """Every configuration once a round, in a fresh shuffled order each round (drift on a
    shared machine hits them all), each run's result appended to the runs of its rows."""
    from launch.redis_server import EmbeddedRedis

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="rlpipe-bench-learner-") as tmp:
        if args.workdir:
            Path(args.workdir).mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="bench-learner-", dir=args.workdir) if args.workdir else tmp)
        redis = EmbeddedRedis(work / "redis").start()
        try:
            for rnd in range(args.rounds):
                order = list(specs.values())
                rng.shuffle(order)
                for i, users in enumerate(order):
                    g, row = users[0]
                    res = run_one(args, g, row, records, model_path, redis.url, work, rnd)
                    for _, r in users:
                        r.runs.append(res)
                    what = "FAILED " + res["error"] if "error" in res else \
                        (f"{res['value']:.4f} s blocking" if g.metric == BLOCKING else f"{res['value']:,.0f} tokens/s")
                    print(f"[round {rnd + 1}/{args.rounds}, {i + 1}/{len(order)}] "
                          f"{' = '.join(f'{gg.name}/{rr.name}' for gg, rr in users)}: {what} "
                          f"({res.get('seconds', 0):.0f}s)", file=sys.stderr, flush=True)
        finally:
            redis.stop()


def gpu_or_skipped(args) -> dict:
    """The GPU part's results (printed), or why it was skipped."""
    import torch

    if args.no_gpu:
        gpu = {"skipped": "--no-gpu"}
    elif not torch.cuda.is_available():
        gpu = {"skipped": "no CUDA GPU (torch.cuda.is_available() is False)"}
        print("\nGPU part (Qwen2 0.5B step time and MFU, with and without activation checkpointing): skipped, "
              "no CUDA GPU here.")
    else:
        gpu = gpu_part(args)
        print_gpu(gpu)
    return gpu


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    chosen = select(groups(args), args.only)
    specs = configurations(chosen)

    from launch.toy import TOY_SPEC, ensure_toy_model
    from learner.synthetic_groups import load_quietly, synthetic_groups

    model_path = args.model or str(ensure_toy_model(TOY_SPEC, log=lambda m: print(m, file=sys.stderr)))
    policy = load_quietly(model_path)
    records = synthetic_groups(policy, args.steps * args.groups, args.n, args.min_len, args.max_len, args.seed,
                               prompt_len=args.prompt_len)
    args.matmul_params = matmul_params(policy)
    lengths = [len(s.tokens) for r in records for s in r.samples]
    cores = len(os.sched_getaffinity(0))
    t_start = time.time()
    run_rounds(args, specs, records, model_path)
    results = [summarize(g) for g in chosen]
    import torch

    header = (f"Learner throughput: {args.groups} groups x {args.n} responses of {args.min_len}..{args.max_len} "
              f"tokens (mean {statistics.mean(lengths):.1f}) per step, {args.steps} steps per run (first not "
              f"counted), median of {args.rounds} interleaved rounds; model {Path(model_path).name}; "
              f"every process learner.threads 1 and OMP_NUM_THREADS=1 (a 2-rank row uses 2 cores); "
              f"{cores} cores, torch {torch.__version__}, {time.time() - t_start:.0f}s")
    from rlpipe.machine import core_peak, cpu_name

    peak, gemm = dataclasses.asdict(core_peak()), {d: gemm_gflops(d) for d in ("float32", "bfloat16")}
    header += (f"; {cpu_name()}; FLOP/s: model FLOPs of the trained tokens (bench/learner_speed.py flops_per_token, "
               f"{args.matmul_params / 1e6:.0f}M matmul weights) against one core's peak, {peak['why']} "
               f"(fp32 {peak['fp32_gflops']:.0f}, bf16 {peak['bf16_gflops'] or 0:.0f} GFLOP/s), and against "
               f"a 1-thread 1024x576x1536 GEMM measured in this run (fp32 {gemm['float32']:.0f}, bf16 "
               f"{gemm['bfloat16']:.0f} GFLOP/s)")
    print_tables(results, header, peak, gemm)
    gpu = gpu_or_skipped(args)
    report = {"args": vars(args), "cores": cores, "torch": torch.__version__, "model": model_path,
              "response_length_mean": statistics.mean(lengths), "groups": results, "gpu": gpu,
              "core_peak": peak, "gemm_gflops": gemm}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}")
    if args.json:
        section(report, header).write(args.json)
    return report


def section(report: dict, header: str):
    """The learner's part of the evidence report (launch/results.py)."""
    from launch.results import Section, figure

    sec = Section("learner", "Learner: training tokens/s by precision, IS mode, batching and parallelism")
    speed = [g for g in report["groups"] if g["metric"] == TOKENS]
    if speed:
        sec.table("Training tokens/s (median over interleaved rounds)",
                  ["group", "configuration", "tokens/s", "rounds' range", "vs group baseline", "peak memory MiB",
                   "GFLOP/s", "of core peak", "of GEMM", "note"],
                  [[g["name"] if i == 0 else "", r["label"] + (" (baseline)" if i == 0 else ""), r["median"],
                    f"{r['range'][0]:,.0f}..{r['range'][1]:,.0f}" if r["range"] else None, r["ratio"],
                    r["peak_mib"], *(peak_columns(r, report["core_peak"], report["gemm_gflops"])
                                     if "core_peak" in report else (None, None, None)),
                    f"FAILED: {r['error']}" if r["error"] else r["note"]]
                   for g in speed for i, r in enumerate(g["rows"])], note=header)
        fig, ((ax,),) = figure(width=max(5.5, 0.45 * sum(len(g["rows"]) for g in speed)))
        x, labels = 0, []
        for k, g in enumerate(speed):
            for r in g["rows"]:
                if r["median"] is not None:
                    lo, hi = r["range"]
                    ax.bar(x, r["median"], color=f"C{k}", yerr=[[r["median"] - lo], [hi - r["median"]]], capsize=3)
                labels.append(f"{g['name']}: {r['name']}")
                x += 1
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("training tokens/s (bars: rounds' range)")
        sec.plot(fig, "tokens_per_s", "Learner training tokens/s by configuration, each group its colour")
    for g in (g for g in report["groups"] if g["metric"] == BLOCKING):
        sec.table(f"{g['title']}: seconds a checkpoint step spent blocked on it",
                  ["configuration", "blocking s per checkpoint step", "vs baseline", "tokens/s", "note"],
                  [[r["label"] + (" (baseline)" if i == 0 else ""), r["median"], r["ratio"], r["tokens_per_second"],
                    f"FAILED: {r['error']}" if r["error"] else r["note"]] for i, r in enumerate(g["rows"])])
    gpu = report["gpu"]
    if "skipped" in gpu:
        sec.note(f"GPU part (a 0.5B Qwen2's step time and MFU, with and without activation checkpointing): "
                 f"skipped, {gpu['skipped']}.")
    else:
        sec.note("GPU part: " + json.dumps(gpu))
    if not (report.get("core_peak") or {}).get("bf16_gflops"):
        sec.note("On a CPU without native bf16 or fp16 arithmetic, bf16 and fp16 autocast run about 10x slower than "
                 "fp32; with avx512_bf16 or AMX, and on GPUs, bf16 is the fast path.")
    sec.note("The toy model is tiny, so per-step overheads (Python, Redis, sync) weigh far more there than with a "
             "real model.")
    sec.data = report
    return sec


if __name__ == "__main__":
    main()
