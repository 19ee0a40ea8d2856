"""Rollout tokens/s with vLLM's prefix cache on (salted by the weights a request or session
started on, rollout_service/prefix_cache.py) and off, side by side, on rlpipe's own group
code (``GroupGenerator``: the task's prompts, its episodes or tool pauses, its rewards):

- ``toy-calculator``: configs/toy-calculator.yaml, multi-turn episodes (each turn a request on
  the whole episode so far);
- ``smollm2-n8``: configs/smollm2-math.yaml without its tool, plain groups of n = 8 answers
  (the eight children of one request share the prompt);
- ``smollm2-calc``: configs/smollm2-calc.yaml, n = 8 answers with the in-turn calculator (each
  pause at "=" a new request on the answer so far).

Each phase is its own process with its own engine (a warm-up group first, then ``--groups``
groups timed, ``rollout.max_inflight_groups`` at a time); cache on and off alternate, round
by round, so that drift on a shared machine hits both. Every phase runs with 32-token blocks
(the smallest the CPU build takes; its default of 128 is longer than these prompts) and
pinned to the recipe's cores. Reported: model tokens/s (the tokens the learner trains;
tool and environment tokens excluded), the median of the rounds, and on/off.

    python -P bench/prefix_cache.py --json docs/results/prefix-cache.json
    python -P bench/prefix_cache.py --recipes toy-calculator --groups 16 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# recipe: (config, overrides, what its groups are)
RECIPES = {
    "toy-calculator": ("configs/toy-calculator.yaml", {}, "toy, multi-turn calculator episodes, n 8"),
    "smollm2-n8": ("configs/smollm2-math.yaml", {"task.tool": "", "learner.tool_imitation": 0.0}, "SmolLM2-135M, MAWPS groups of n 8, no tool"),
    "smollm2-calc": ("configs/smollm2-calc.yaml", {}, "SmolLM2-135M, n 8 answers with the in-turn calculator"),
}
BLOCK = 32


def model_tokens(rec) -> int:
    """Tokens the model sampled in a group (a tool's or an environment's are mask 0)."""
    return sum(int(s.mask.sum()) if s.mask is not None else len(s.tokens) for s in rec.samples)


async def produce(recipe: str, cache: bool, groups: int) -> dict:
    """One phase: an engine with the cache ``cache``, a warm-up group, then ``groups`` timed."""
    from transformers import AutoTokenizer

    from launch.demo import resolve_model
    from quant.precision_profile import profile_for
    from rlpipe.config import load_config
    from rollout_service.engine import RolloutEngine
    from rollout_service.groups import Group, GroupGenerator
    from rollout_service.metrics import RolloutMetrics
    from rollout_service.tasks import make_task

    path, overrides, _ = RECIPES[recipe]
    cfg = load_config(ROOT / path, environ={}, **overrides)
    model = resolve_model(cfg, log=lambda m: print(m, file=sys.stderr))
    engine_args = {**cfg.rollout.engine, "block_size": BLOCK, "enable_prefix_caching": cache}
    cfg = load_config(ROOT / path, environ={}, **overrides, **{"model.path": model, "rollout.engine": engine_args})
    profile = profile_for(cfg.rollout.precision, quant=cfg.quant, model_path=model)
    engine = RolloutEngine(model, profile, cfg.rollout, seed=cfg.seed)
    await engine.start()
    try:
        metrics = RolloutMetrics("bench", profile.precision, "bench", model, False)
        make = GroupGenerator(cfg, "bench", engine, make_task(cfg.task), AutoTokenizer.from_pretrained(model),
                              metrics)
        await engine.generate([1, 2, 3], n=2, temperature=1.0, max_tokens=4)  # warm-up, not timed
        room = asyncio.Semaphore(cfg.rollout.max_inflight_groups)

        async def one(index: int):
            async with room:
                return await make(Group(index=index))

        t0 = time.perf_counter()
        records = [r for r in await asyncio.gather(*(one(i) for i in range(groups))) if r is not None]
        seconds = time.perf_counter() - t0
    finally:
        engine.shutdown()
    tokens = sum(model_tokens(r) for r in records)
    return {"recipe": recipe, "cache": cache, "groups": len(records), "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "precision": profile.precision}


def run_phase(recipe: str, cache: bool, groups: int) -> dict:
    """A phase in its own process (its own engine, pinned to the recipe's cores)."""
    from rlpipe.config import load_config

    cpus = load_config(ROOT / RECIPES[recipe][0], environ={}).rollout.cpus
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    pin = ["taskset", "-c", cpus] if cpus else []
    out = subprocess.run([*pin, sys.executable, "-P", __file__, "--phase", json.dumps([recipe, cache, groups])],
                         env=env, capture_output=True, text=True, cwd=ROOT)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{recipe} cache={cache}: {out.stderr[-3000:]}")


def without_note(command: str) -> str:
    """A phase's command less its ``--note`` (a remark, not a setting)."""
    words = shlex.split(command)
    if "--note" in words:
        i = words.index("--note")
        words = words[:i] + words[i + 2:]
    return shlex.join(words)


def section(rows: list[dict], command: str | None = None, remark: str = ""):
    from launch.results import Section

    sec = Section("prefix-cache", "The prefix cache kept across weight versions: rollout tokens/s on and off",
                  command)
    table = []
    for recipe in dict.fromkeys(r["recipe"] for r in rows):
        mine = [r for r in rows if r["recipe"] == recipe]
        on = [r["tokens_per_s"] for r in mine if r["cache"]]
        off = [r["tokens_per_s"] for r in mine if not r["cache"]]
        ratios = [b / a for a, b in zip(off, on)]  # a round's two phases ran one after the other
        table.append([f"{recipe}: {RECIPES[recipe][2]} ({mine[0]['precision']})", mine[0]["groups"], len(off),
                      statistics.median(off), statistics.median(on), statistics.median(ratios),
                      ", ".join(f"{a:.1f}/{b:.1f} ({b / a:.2f})" for a, b in zip(off, on))])
    sec.table("Model tokens/s, the median of each arm's phases; cache off and on alternating",
              ["recipe", "groups a phase", "rounds", "cache off", "cache on", "on / off (median of rounds)",
               "each round, off/on (on/off)"], table,
              note=f"{BLOCK}-token blocks in both arms; each recipe pinned to its `rollout.cpus`.")
    sec.data = rows
    if remark:
        sec.note(remark)
    if missing := [r for r in RECIPES if r not in {row["recipe"] for row in rows}]:
        sec.note("Not in this run: " + ", ".join(f"{r} (`python -P bench/prefix_cache.py --recipes {r}`)"
                                                 for r in missing) + ".")
    sec.note("Cache on is rlpipe's default: each request salted by the weights it started on, a session's and a "
             "tool-paused answer's later requests by their first one's, so no request reads another version's KV "
             "(docs/rollout.md, \"The prefix cache\"). Off is `rollout.engine.enable_prefix_caching: false`, which "
             "routing replay forces (docs/moe.md). No weight update lands during a phase: what is measured is what "
             "the cache saves between updates, which salting keeps across them.")
    return sec


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, of {list(RECIPES)}")
    ap.add_argument("--groups", type=int, default=16, help="groups timed per phase")
    ap.add_argument("--rounds", type=int, default=2, help="cache off then on, this many times (0 with --rows: "
                    "only make the section of the phases already in it)")
    ap.add_argument("--json", help="write the report's section here")
    ap.add_argument("--rows", help="a JSON-lines file of phases: this run's are added to it and the section is "
                    "made of all of them (recipes run at different times, one command each)")
    ap.add_argument("--note", default="", help="a remark for the report (e.g. what else ran on the machine)")
    ap.add_argument("--phase", help=argparse.SUPPRESS)  # [recipe, cache, groups]: run one phase here
    args = ap.parse_args(argv)
    from launch.results import this_command

    if args.phase:
        print("RESULT " + json.dumps(asyncio.run(produce(*json.loads(args.phase)))), flush=True)
        return []
    rows = []
    for recipe in args.recipes.split(","):
        for _ in range(args.rounds):
            for cache in (False, True):
                rows.append({**run_phase(recipe, cache, args.groups), "command": this_command()})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                if args.rows:
                    with open(args.rows, "a") as f:
                        f.write(json.dumps(rows[-1]) + "\n")
    if args.rows:
        rows = [json.loads(line) for line in Path(args.rows).read_text().splitlines() if line.strip()]
    sec = section(rows, " && ".join(dict.fromkeys(without_note(r["command"]) for r in rows)), args.note)
    print(json.dumps(sec.to_dict()["tables"], indent=1))
    if args.json:
        sec.write(args.json)
    return rows


if __name__ == "__main__":
    main()
