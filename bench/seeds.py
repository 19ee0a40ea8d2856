"""The seeds' findings reproduced on the toy task, and the recipe on the real model, each
with at least 2 seeds, learning curves and mismatch plots.

Every finding is an entry of ``FINDINGS``: its arms (config keys that differ), its defaults
(``steps`` and config keys every arm shares), the ``metrics.jsonl`` keys to plot over
steps, the per-run numbers of its table, and notes. Each arm x seed is a whole
``rlpipe demo`` run (Redis, workers and learner as separate processes), kept in
``<out>/<finding>/runs/<arm>-s<seed>/``; ``--from-runs`` redoes the tables and plots from
the kept runs without training. Each finding writes one ``launch.results`` section,
``<json-dir>/<finding>.json`` plus its PNGs: a table per arm and seed with each arm's
mean over seeds, one plot panel per curve (each seed faint, the mean over seeds bold) and
the notes.

    precision   seed 000: bf16 vs fp16 for rollout and training, and rollout-only with an fp32 learner
    int8        seed 002: does int8 W8A8 rollout need TIS?  (was bench/int8_tis.py)
    surge       seed 001: constant LR vs the length-surge decay, on the worked-answer arith variant
    real        GRPO on the real model (configs/smollm2-math.yaml), held-out accuracy at start and end

    python bench/seeds.py --finding precision,int8               # 2 seeds each, the lead's full runs
    python bench/seeds.py --finding int8 --seeds 0,1 --steps 60  # seed 002 as bench/int8_tis.py ran it
    python bench/seeds.py --finding precision,int8 --from-runs   # redo tables and plots
    python bench/seeds.py --finding precision,int8 --quick --json-dir /tmp/seeds --out /tmp/seeds/runs  # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from launch.results import Section, figure, render_section, this_command  # noqa: E402

Stat = Callable[[list[dict]], float | int | None]


# --- per-run numbers, each computed from one run's metrics.jsonl rows ---------------------------

def mean_of(key: str) -> Stat:
    """The mean over steps of ``key``, steps without it left out (nan if none has it)."""
    def stat(rows):
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.fmean(values) if values else float("nan")
    return stat


def first(key: str, k: int = 3) -> Stat:
    return lambda rows: mean_of(key)(rows[:k])


def final(key: str, k: int = 5) -> Stat:
    return lambda rows: mean_of(key)(rows[-k:])


def last(key: str) -> Stat:
    return lambda rows: rows[-1].get(key) if rows else None


def lowest(key: str) -> Stat:
    return lambda rows: min((r[key] for r in rows if r.get(key) is not None), default=None)


def highest(key: str) -> Stat:
    return lambda rows: max((r[key] for r in rows if r.get(key) is not None), default=None)


def surge_step(rows: list[dict]) -> int | None:
    """The step ``length_surge`` saw the surge at (None: never, or another schedule)."""
    return (rows[-1].get("lr_schedule") or {}).get("surge_step") if rows else None


def replayed_surge(factor: float) -> Stat:
    """The step seed 001's length trigger (``length_surge``, its other settings the defaults) would
    have fired at on this run's response lengths, replayed offline (None: never)."""
    def stat(rows):
        from learner.schedule import LRSchedule
        from rlpipe.config import ScheduleConfig

        schedule = LRSchedule(ScheduleConfig(kind="length_surge", surge_factor=factor), 1.0, max(len(rows), 1))
        for r in rows:
            schedule.update(r["step"], r["response_length_mean"])
        return schedule.surge_step
    return stat


def stale_groups(rows: list[dict]) -> int:
    """Trained groups with staleness above 0, from each step's ``staleness_hist``."""
    return sum(n for r in rows for s, n in (r.get("staleness_hist") or {}).items() if int(s) > 0)


def total_groups(rows: list[dict]) -> int:
    return sum(r.get("groups", 0) for r in rows)


def steps_without_fresh(rows: list[dict]) -> int:
    return sum(1 for r in rows if r.get("mismatch_kl_fresh") is None)


class Rows(list):
    """A run's step rows, with its held-out evaluations (metrics.jsonl's ``kind: eval`` rows) as ``evals``."""

    evals: list[dict] = []


def held_out(which: str, field: str = "pass_at_1") -> Stat:
    """The first or last held-out evaluation's ``field`` (by the version it evaluated)."""
    def stat(rows):
        evals = sorted(getattr(rows, "evals", []), key=lambda e: e["version"])
        return (evals[0] if which == "first" else evals[-1]).get(field) if evals else None
    return stat


def evaluated_start_and_end(rows, settings: dict) -> list[str]:
    """The recipe's whole pipeline on the real model ran: answers were sampled, and the held-out
    evaluation ran at step 0 and on the final weights, on the recipe's held-out set, each
    pass@1 inside its own interval."""
    problems = []
    if len(rows) != settings["steps"] or not all(r["response_length_mean"] > 1 for r in rows):
        problems.append(f"{len(rows)} of {settings['steps']} steps, or an empty answer")
    evals = getattr(rows, "evals", [])
    versions = {e["requested_version"] for e in evals}
    if not {0, settings["steps"]} <= versions:
        problems.append(f"held-out evaluations at versions {sorted(versions)}, not at 0 and the end")
    final = [e for e in evals if e["requested_version"] == settings["steps"]]
    if any(e["version"] != settings["steps"] for e in final):
        problems.append("the final evaluation did not run on the final weights")
    for e in evals:
        if e["dataset"] != settings["eval.dataset"] or e["rows"] > settings["eval.size"] or \
                not e["pass_at_1_low"] <= e["pass_at_1"] <= e["pass_at_1_high"]:
            problems.append(f"evaluation {e}")
    return problems


def held_out_sign_test(key: str = "rows_right") -> Stat:
    """The first and last held-out evaluations compared row by row (launch/demo.py ``sign_test``):
    ``gained/lost, p``, the rows the last got right that the first did not and the reverse."""
    def stat(rows):
        from launch.demo import sign_test

        evals = sorted(getattr(rows, "evals", []), key=lambda e: e["version"])
        if len(evals) < 2 or key not in evals[0]:
            return None
        _, _, gained, lost, p = sign_test(evals[0], evals[-1], key)
        return f"{gained}/{lost}, p = {p:.2g}"
    return stat


def held_out_interval(which: str) -> Stat:
    def stat(rows):
        low, high = held_out(which, "pass_at_1_low")(rows), held_out(which, "pass_at_1_high")(rows)
        return None if low is None else f"[{low:.3f}, {high:.3f}]"
    return stat


def held_out_gain(rows) -> float | None:
    """Last minus first held-out pass@1, in points (percentage points)."""
    a, b = held_out("first")(rows), held_out("last")(rows)
    return None if a is None or b is None else 100 * (b - a)


def recipe(path: str) -> dict:
    """A config file's settings as the dotted keys a finding's defaults use."""
    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out
    return flat(yaml.safe_load((ROOT / path).read_text()))


def lora_arms(lr: float) -> dict[str, dict]:
    """The LoRA findings' arms: a full fine-tune with int8 rollout at the run's learning rate, and a
    rank-8 adapter at ``lr`` on the frozen int8 base, the learner on that base as served or on the
    checkpoint's own (``learner.served_weights`` false)."""
    lora = {"rollout.precision": "int8", "learner.lora.rank": 8, "learner.lr": lr}
    full = {"rollout.precision": "int8", "learner.lora.rank": 0, "learner.lr": 5e-5}  # a full fine-tune's own lr
    return {"int8/full": full, "int8/lora": lora,
            "int8/lora/fp32-base": {**lora, "learner.served_weights": False}}


def lora_columns(after_mismatch: dict[str, Stat] | None = None) -> dict[str, Stat]:
    """The LoRA findings' mismatch and sync columns, ``after_mismatch``'s between the two."""
    return {"steps": len,
            "KL (k3) step 1": first("mismatch_k3_kl", 1),
            "KL (k3, all)": mean_of("mismatch_k3_kl"),
            "KL (k3) last 5": final("mismatch_k3_kl"),
            "|log ppl diff|": mean_of("mismatch_log_ppl_abs_diff"),
            **(after_mismatch or {}),
            "bytes per sync": mean_of("weight_sync_sent_bytes"),
            "a whole version's bytes": mean_of("weight_sync_full_bytes"),
            "sync seconds": mean_of("weight_sync_seconds"),
            "learner tokens/s": mean_of("learner_tokens_per_second")}


@dataclass
class Finding:
    title: str
    arms: dict[str, dict]       # arm -> config keys that make it
    defaults: dict              # steps and config keys every arm shares (under --set and --steps)
    curves: list[str]           # metrics.jsonl keys plotted over steps
    columns: dict[str, Stat]    # table column -> number per run
    notes: list[str] = field(default_factory=list)
    quick_arms: list[str] = field(default_factory=list)  # the arms --quick runs (default: the first)
    quick: dict = field(default_factory=dict)  # --quick's settings for this finding, beside QUICK
    # --quick trains nothing and reads this finding's quick run instead (its first quick arm, seed 0): the quick
    # bench checks that the section renders, and each demo run it trains costs CI 1-3 of its 10 minutes (the
    # suite's demo tests train every precision and schedule)
    quick_from: str | None = None
    # what every run of the finding must show, whatever its numbers (problems, [] if none): a run
    # that breaks it fails the part, and so CI's quick report
    check: Callable[[list[dict], dict], list[str]] | None = None


FINDINGS: dict[str, Finding] = {
    "precision": Finding(
        title="Seed 000 on the toy task: BF16 vs FP16, rollout and training",
        arms={"bf16": {"rollout.precision": "bf16", "learner.dtype": "bf16"},
              "fp16": {"rollout.precision": "fp16", "learner.dtype": "fp16"},
              "bf16/fp32": {"rollout.precision": "bf16", "learner.dtype": "fp32"},
              "fp16/fp32": {"rollout.precision": "fp16", "learner.dtype": "fp32"}},
        defaults={"steps": 30, "queue.max_lag": 0, "learner.groups_per_step": 16},
        curves=["reward_mean", "mismatch_k3_kl", "mismatch_kl_fresh", "mismatch_log_ppl_abs_diff",
                "learner_loss_scale"],
        columns={"steps": len,
                 "groups": total_groups,
                 "stale groups": stale_groups,
                 "steps w/o fresh": steps_without_fresh,
                 "KL (k1, all)": mean_of("mismatch_kl"),
                 "KL (k1, staleness 0)": mean_of("mismatch_kl_fresh"),
                 "KL (k3, all)": mean_of("mismatch_k3_kl"),
                 "|log ppl diff|": mean_of("mismatch_log_ppl_abs_diff"),
                 "reward start": first("reward_mean"),
                 "reward end": final("reward_mean"),
                 "skipped steps": last("learner_skipped_steps_total"),
                 "min loss scale": lowest("learner_loss_scale"),
                 "RL seconds": last("time")},
        notes=["Arms are `rollout precision/learner dtype`; `bf16` and `fp16` use the same precision for both "
               "(the seed's setting), `bf16/fp32` and `fp16/fp32` keep the learner in fp32 so the rollout "
               "precision's own share of the mismatch shows. The learner's bf16/fp16 are autocast over fp32 master "
               "weights; fp16 has dynamic loss scaling, and its overflowing steps are skipped (`skipped steps`).",
               "Reduced for this CPU: the learner in bf16/fp16 trains about 10x slower than in fp32 here (no native "
               "bf16, see docs/bench/learner.md), so by default a run is 30 steps of 16 groups x 8 samples (the "
               "demo's default is 100 steps of 64 groups), about 3-4 minutes per bf16/fp16 run on 2 cores; the "
               "settings actually used are under the table.",
               "`queue.max_lag` is 0, yet earlier runs trained a few groups above staleness 0, and at this size "
               "those stale groups dominate fp16's all-groups KL. So `KL (k1, staleness 0)` is the learner's "
               "`mismatch_kl_fresh` (staleness-0 groups only, the mean over the steps that had any; "
               "`steps w/o fresh` had none), and `stale groups` counts the trained groups above staleness 0 from "
               "each step's `staleness_hist`.",
               "The k1 KL is an unbiased but noisy estimate that goes negative on single steps when the true KL is "
               "tiny; k3 is never negative and is what the KL panel plots. `|log ppl diff|` is "
               "|log ppl(rollout) - log ppl(train)| per step, seed 001's indicator."],
        quick_arms=["fp16"], quick_from="int8"),
    "int8": Finding(
        title="Seed 002 on the toy task: int8 rollout with and without token TIS",
        arms={"bf16": {"rollout.precision": "bf16", "learner.is_mode": "none"},
              "int8": {"rollout.precision": "int8", "learner.is_mode": "none"},
              "int8+tis": {"rollout.precision": "int8", "learner.is_mode": "token_tis"}},
        defaults={"steps": 60, "queue.max_lag": 0},
        curves=["reward_mean", "mismatch_k3_kl", "is_truncated_fraction", "quant_kl_vs_bf16"],
        columns={"steps": len,
                 "stale groups": stale_groups,
                 "reward start": first("reward_mean"),
                 "reward end": final("reward_mean"),
                 "KL (k1, all)": mean_of("mismatch_kl"),
                 "KL (k3, all)": mean_of("mismatch_k3_kl"),
                 "KL (k1, staleness 0)": mean_of("mismatch_kl_fresh"),
                 "IS truncated": mean_of("is_truncated_fraction"),
                 "int8 vs bf16 KL (probe)": mean_of("quant_kl_vs_bf16"),
                 "RL seconds": last("time")},
        notes=["Arms: `bf16` rollout without correction (the baseline), `int8` W8A8 rollout without correction, "
               "`int8+tis` int8 rollout with token-level TIS (`is_cap` C = 2); all else is the demo's defaults.",
               "`queue.max_lag` is 0, so the mismatch measured is the precision's, not the policy lag's. "
               "`int8 vs bf16 KL (probe)` is the learner's own next-token KL of the quantized policy against the "
               "bf16 one on its probe set (nan for the bf16 arm, which quantizes nothing).",
               "Earlier results of this comparison (bench/int8_tis.py, now this finding): docs/int8_tis_w8/ "
               "(full-range int8 weights, which saturate on this AVX2 CPU) and docs/int8_tis_w7/ (7-bit weights)."],
        # every version's checkpoint: bench/delta_sync.py --quick measures its syncs instead of training a run
        quick_arms=["int8+tis"], quick={"learner.checkpoint_every": 1, "learner.checkpoint_keep": 10}),
    "surge": Finding(
        title="Seed 001 on the toy task: constant LR vs the length-surge decay, at a higher LR",
        arms={"constant": {"learner.schedule.kind": "constant"},
              "length_surge": {"learner.schedule.kind": "length_surge"}},
        defaults={"steps": 30, "task.arith_style": "worked", "sampling.max_tokens": 48,
                  "learner.groups_per_step": 32, "learner.lr": 1e-3},
        curves=["response_length_mean", "learner_grad_norm", "mismatch_log_ppl_abs_diff", "learner_lr",
                "reward_mean"],
        columns={"steps": len,
                 "surge step": surge_step,
                 "final LR": last("learner_lr"),
                 "length start": first("response_length_mean"),
                 "length max": highest("response_length_mean"),
                 "length end": final("response_length_mean"),
                 "grad norm max": highest("learner_grad_norm"),
                 "|log ppl diff|": mean_of("mismatch_log_ppl_abs_diff"),
                 "|log ppl diff| max": highest("mismatch_log_ppl_abs_diff"),
                 "reward start": first("reward_mean"),
                 "reward end": final("reward_mean")},
        notes=["Made harder in a stated way: the demo's task never surges (a response is the bare answer, at "
               "most 8 tokens), so this finding uses `task.arith_style: worked`: the response may show its work "
               "(`47+38=` -> `7+8=15 4+3+1=8 85`, about 17 tokens) and the reward reads only its last number, so "
               "length is free to grow and a degenerate policy can babble; its own toy is warm-started on worked "
               "answers (seed 0: sampled accuracy 0.38 after 175 steps).",
               "The instability is provoked with a higher LR and nothing else: `learner.lr` 1e-3, the LR "
               "../shared/TOY_TASK_NOTES.md measured to collapse the toy within seconds, against the default 3e-4; "
               "both arms use it with the schedule's defaults (5 warmup steps; surge at smoothed length >= 2.0 x its "
               "recent minimum). `sampling.max_tokens` is 48, not the 32 the longest worked answer needs (19 "
               "characters + `<eos>`): at 32 a 2x surge from about 17 tokens cannot happen at all, and one run at 32 "
               "sat at the cap (31.2). 32 groups x 8 samples per step keep a run to about 7 minutes on the shared "
               "2 cores.",
               "Until a surge is seen the two arms train identically, so without one they differ only by run-to-run "
               "noise (async rollouts make runs of the same seed differ). `learner_grad_norm` is 0 on steps where "
               "every group had equal rewards (nothing to train), which after a collapse is most steps.",
               "Seen when this entry was added (seed 0, one run per arm and cap, plain demo runs): at 3e-4 reward "
               "held (0.41 -> 0.45) at length 17; at 1e-3 every run collapsed (reward 0.41 -> 0 by steps 9-12) "
               "after grad norm (0.6 -> 1.4-6.2) and |log ppl diff| (0.001 -> 0.3-0.8) rose, and the length moved "
               "only after the collapse and either way: up to 45 (constant, cap 48), up to 31 (length_surge, cap "
               "32), down to 1.5 (length_surge, cap 48). The length surge never fired the trigger before the "
               "collapse: on this toy, length is not an early warning, the grad norm and the mismatch are."],
        quick_arms=["length_surge"], quick_from="int8"),
    "moe": Finding(
        title="Mixture of experts on the toy task: routing replay on and off",
        arms={"bf16/replay": {"learner.replay_routes": True},
              "bf16/no-replay": {"learner.replay_routes": False},
              "int8/replay": {"rollout.precision": "int8", "learner.replay_routes": True},
              "int8/no-replay": {"rollout.precision": "int8", "learner.replay_routes": False}},
        defaults={"steps": 30, "model.path": "toy-moe", "rollout.routing_replay": True, "queue.max_lag": 0,
                  "rollout.precision": "bf16", "learner.groups_per_step": 16},
        curves=["reward_mean", "routing_agreement", "mismatch_k3_kl", "mismatch_prob_diff_max",
                "is_truncated_fraction"],
        columns={"steps": len,
                 "stale groups": stale_groups,
                 "routing agreement": mean_of("routing_agreement"),
                 "KL (k3, all)": mean_of("mismatch_k3_kl"),
                 "KL (k1, staleness 0)": mean_of("mismatch_kl_fresh"),
                 "largest token prob gap": mean_of("mismatch_prob_diff_max"),
                 "|log ppl diff|": mean_of("mismatch_log_ppl_abs_diff"),
                 "IS truncated": mean_of("is_truncated_fraction"),
                 "reward start": first("reward_mean"),
                 "reward end": final("reward_mean"),
                 "RL seconds": last("time")},
        notes=["The built-in `toy-moe` (a Qwen3-MoE: 2 layers, 4 experts, 2 per token) on the toy task, a bf16 "
               "or int8 engine and an fp32 learner, `queue.max_lag` 0. Every arm records the engine's experts "
               "(`rollout.routing_replay`); `replay` arms forward every learner pass through them "
               "(`learner.replay_routes`), `no-replay` arms only measure how often the learner's own router "
               "agrees (docs/moe.md). `routing agreement` is that share of (token, MoE layer) pairs, in the "
               "learner's forwards of each step; `largest token prob gap` is each step's largest "
               "|p_rollout - p_train| over the trained tokens, where a routing flip shows first.",
               "`int8` is W8A8 (dynamic per-token activations, 7-bit weights on this AVX2 CPU) on the attention "
               "linears, with the experts and routers bf16: vLLM's CPU build has no int8 MoE kernel, and the rule "
               "keeps the router exact (docs/moe.md, 'Quantized rollout of an MoE').",
               "Seen when the int8 arms were added (2 seeds each, 30 steps of 16 groups, 2-core AVX2 CPU, the "
               "machine shared with other work, so `RL seconds` says nothing): the learner's own router agreed "
               "with the engine's on 99% of (token, layer) pairs in every arm, so at most 1% of the pairs could "
               "differ. On groups sampled by the weights being trained (`KL (k1, staleness 0)`), replay cut int8's "
               "mismatch about 3x in both seeds (1.9e-4 and 1.8e-4, against 6.0e-4 and 5.9e-4 without), and did "
               "not separate bf16's (4.8e-4 and 3.8e-4, against 4.6e-4 and 5.0e-4): consistent with int8 "
               "attention moving the routers' inputs further from the learner's, so that more near-ties flip "
               "(one toy, two seeds). Over all groups the k3 "
               "mismatch is the policy lag's (about 110 of the trained groups span an update even at "
               "`queue.max_lag` 0) and the arms do not separate (bf16 0.0040 with replay, 0.0048 without; int8 "
               "0.0056 and 0.0049). int8 adds about a quarter to bf16's k3. A real MoE (tens of layers, 64-128 "
               "experts, near-ties far more common) is where the feasibility probe saw 1.6-4.5% of tokens routed "
               "differently and gaps up to 0.66 that replay removed (docs/moe.md)."],
        quick_arms=["bf16/replay"], quick={"steps": 2, "learner.groups_per_step": 8}),
    "lora": Finding(
        title="LoRA on a frozen int8 base: the mismatch, the sync and the learner, against a full "
              "fine-tune with int8 rollout, on the toy task",
        arms=lora_arms(3e-3),
        defaults={"steps": 40, "queue.max_lag": 0, "learner.is_mode": "none"},
        curves=["mismatch_k3_kl", "reward_mean", "weight_sync_sent_bytes", "learner_tokens_per_second"],
        columns={**lora_columns(),
                 "reward start": first("reward_mean"),
                 "reward end": final("reward_mean"),
                 "RL seconds": last("time")},
        notes=["The demo's defaults with int8 rollout (W8A8, dynamic per-token activations, calibrated once), "
               "`queue.max_lag` 0 (the mismatch measured is the rollout's against the learner, not the policy "
               "lag's) and no correction (`learner.is_mode: none`), so nothing hides it. `int8/full` fine-tunes "
               "every weight at the demo's lr 3e-4, and each update is quantized on the learner with the frozen "
               "profile; `int8/lora` trains a rank-8 adapter on every linear of the decoder (alpha 16) at lr 3e-3 "
               "(10x: the LoRA rule of thumb) on the int8 base, which never moves, and the learner computes on that "
               "base as the engine serves it (dequantized, its smoothing undone: learner/lora.py); "
               "`int8/lora/fp32-base` is the same adapter with the learner on the fp32 base "
               "(`learner.served_weights: false`): what serving the base removes from the mismatch.",
               "A full fine-tune's int8 versions travel as deltas after the first (`sync.delta_full_every`); an "
               "adapter travels whole each version, rewritten for the profile's smoothing.",
               "Why the toy and not SmolLM2 (the issue asks for SmolLM2): tried here first with the recipe "
               "(configs/smollm2-math.yaml, one worker on its own core), the int8 engine with a rank-8 adapter "
               "made 11 groups in 7 minutes, all without a reward spread (the base answers about 10% right), about "
               "6 minutes a step at the recipe's 2 groups a step: 40 steps of three arms would take hours on these "
               "2 cores. In that engine (py-spy, 20 s of decoding) the adapter's kernels took about as much of "
               "the engine thread as the int8 linears themselves (12.7% and 13.5% of all samples). The adapter's products "
               "now run in fp32 (rollout_service/vllm_compat.py `_per_adapter`), and the `real-lora` part runs these "
               "arms on SmolLM2."],
        quick_arms=["int8/lora"],
        quick_from="int8"),
    "real-lora": Finding(
        title="LoRA on a frozen int8 base on the real model: SmolLM2's mismatch, sync and learner, "
              "against a full fine-tune with int8 rollout",
        arms=lora_arms(5e-4),
        # the recipe with one worker on its own core (the learner on the other), no evaluation: these arms are
        # compared by their mismatch and sync, which 10 steps show (the int8 monitor's drift was 10 steps too)
        defaults={**recipe("configs/smollm2-math.yaml"), "steps": 10, "queue.max_lag": 0, "learner.is_mode": "none",
                  "eval.every": 0, "eval.base_at_rest": False, "workers": 1, "rollout.cpus": "0"},
        curves=["mismatch_k3_kl", "quant_kl_vs_bf16", "weight_sync_sent_bytes", "learner_tokens_per_second"],
        columns={**lora_columns({"int8 vs bf16 KL (probe) last": last("quant_kl_vs_bf16")}),
                 "groups sampled per trained": mean_of("groups_sampled_per_trained"),
                 "RL seconds": last("time")},
        notes=["The SmolLM2 recipe (configs/smollm2-math.yaml: 2 groups with a reward spread a step, 8 answers "
               "each) with int8 rollout (W8A8, dynamic per-token activations, calibrated once), one worker on "
               "core 0 and the learner on core 1, `queue.max_lag` 0 and no correction (`learner.is_mode: none`), "
               "so the mismatch is the rollout's against the learner and nothing hides it. `int8/full` fine-tunes "
               "every weight at the recipe's lr 5e-5, each update quantized on the learner with the frozen "
               "profile; `int8/lora` trains a rank-8 adapter on every linear of the decoder (alpha 16) at 5e-4 "
               "(10x) on the int8 base, which never moves, with the learner on that base as the engine serves it "
               "(dequantized, its smoothing undone: learner/lora.py); `int8/lora/fp32-base` is the same adapter "
               "with the learner on the bf16 checkpoint's base (`learner.served_weights: false`). The int8 "
               "monitor (`quant_kl_vs_bf16`, the quantized policy against bf16 on the probe set) runs for the "
               "full fine-tune only: a frozen base has nothing to drift.",
               "Seen when this part was added (one seed, 2026-11-28, the 2-core AVX2 machine, 16-22 minutes an arm). "
               "At step 1, where every group is sampled by version 0 and the adapter is still zero, the mismatch is "
               "the precision's alone: k3 0.028 with the learner on the bf16 base (the full fine-tune and "
               "`int8/lora/fp32-base` alike) and 0.0155 with the learner on the int8 base as served, so serving the "
               "base removes about half of int8's mismatch and what is left is activation quantization. Over the "
               "10 steps the adapter on the served base stays lowest (k3 0.021 against 0.036 on the bf16 base and "
               "0.054 for the full fine-tune; |log ppl diff| 0.038, 0.051, 0.085); those means also hold policy lag, "
               "as groups up to 3 versions old were trained even at `queue.max_lag` 0 (dynamic sampling's "
               "allowance), and the staleness-0 KL (k1) is too noisy at 2 groups a step to separate the arms "
               "(0.024-0.030). The full fine-tune's int8 monitor did not drift within 10 steps at lr 5e-5 (KL "
               "against bf16 0.035 at step 1, 0.056 at step 4, 0.038 at step 10). A version is 4.9 MB as an "
               "adapter against 2.1-2.5 MB as an int8 delta (163 MB whole, once): at this learning rate about 0.1% "
               "of the int8 values move a step, so a delta is smaller than the adapter. The full fine-tune's sync "
               "took 55 s a step, 53 of them the int8 monitors (since then their output error is estimated on 256 "
               "probe tokens, 43-46 s -> 32 s a monitored update, and the recipe monitors every 5th update), "
               "against 0.4 s for an adapter; the learner trained 48 tokens/s "
               "with the adapter against 31 (1.56x)."],
        quick_arms=["int8/full"],
        quick_from="real"),
    "real-lora-40": Finding(
        title="LoRA on the real model over the whole recipe: held-out accuracy and 40 steps of mismatch, "
              "LoRA on the int8 and fp32 bases against a full fine-tune with int8 rollout",
        arms={"int8/lora": lora_arms(5e-4)["int8/lora"], "int8/full": lora_arms(5e-4)["int8/full"],
              "fp32/lora": {"learner.lora.rank": 8, "learner.lr": 5e-4}},
        # the recipe as it is (2 workers, 40 steps, held-out evaluation at the start and the end): only the
        # precision and the adapter differ, and the learner waits longer for an evaluation (int8 decodes at
        # 0.73x fp32 here, and the recipe's fp32 evaluations took 6-7 minutes each)
        defaults={**recipe("configs/smollm2-math.yaml"), "eval.final_wait_s": 1800},
        curves=["reward_mean", "eval:pass_at_1", "mismatch_k3_kl", "quant_kl_vs_bf16", "entropy"],
        columns={"held-out pass@1 start": held_out("first"),
                 "held-out pass@1 end": held_out("last"),
                 "95% interval end": held_out_interval("last"),
                 "change (points)": held_out_gain,
                 "gained/lost, sign test": held_out_sign_test(),
                 "lenient start": held_out("first", "pass_at_1_lenient"),
                 "lenient end": held_out("last", "pass_at_1_lenient"),
                 "lenient gained/lost": held_out_sign_test("rows_right_lenient"),
                 **lora_columns({"int8 vs bf16 KL (probe) last": last("quant_kl_vs_bf16")}),
                 "entropy start": first("entropy"),
                 "entropy end": final("entropy"),
                 "reward start": first("reward_mean"),
                 "reward end": final("reward_mean"),
                 "RL seconds": last("time")},
        notes=["The SmolLM2 recipe (configs/smollm2-math.yaml) as it is, 40 steps on 2 workers with the held-out "
               "evaluation (455 SingleEq rows, greedy) at the start and the end, in three arms: `int8/lora`, a "
               "rank-8 adapter (alpha 16, every linear of the decoder) at lr 5e-4 on the frozen int8 base, the "
               "learner on that base as the engines serve it; `int8/full`, a full fine-tune at the recipe's 5e-5 "
               "with int8 rollout; `fp32/lora`, the adapter on the recipe's fp32 base (fp32 stands in for bf16, the issue's arm, which is faster on "
               "a CPU with native bf16; here bf16 has no fast path: docs/quantization.md). The recipe's own full "
               "fine-tune in fp32 is the `real` section. The recipe corrects the mismatch as it always does, so "
               "the KL columns are the rollout's against the learner before correction, policy lag included."],
        quick_arms=["int8/lora"],
        quick_from="real",
        check=evaluated_start_and_end),
    "real": Finding(
        title="GRPO on a real model: SmolLM2-135M-Instruct on MAWPS, held-out accuracy",
        arms={"grpo": {}},
        defaults=recipe("configs/smollm2-math.yaml"),
        curves=["reward_mean", "eval:pass_at_1", "response_length_mean", "mismatch_k3_kl", "entropy"],
        columns={"steps": len,
                 "held-out pass@1 start": held_out("first"),
                 "95% interval start": held_out_interval("first"),
                 "held-out pass@1 end": held_out("last"),
                 "95% interval end": held_out_interval("last"),
                 "change (points)": held_out_gain,
                 "reward start": first("reward_mean"),
                 "reward end": final("reward_mean"),
                 "length start": first("response_length_mean"),
                 "length end": final("response_length_mean"),
                 "length max": highest("response_length_mean"),
                 "surge trigger 2x at": replayed_surge(2.0),
                 "1.5x at": replayed_surge(1.5),
                 "KL (k3, all)": mean_of("mismatch_k3_kl"),
                 "RL seconds": last("time")},
        notes=["The recipe is configs/smollm2-math.yaml, run as it is (`rlpipe demo --config "
               "configs/smollm2-math.yaml`): the built-in SmolLM2-135M-Instruct (its Q4_1 GGUF dequantized to "
               "bf16, so weaker than the original) trained with GRPO on MAWPS SingleOp (562 one-operation word "
               "problems) and evaluated greedily on MAWPS SingleEq without the 53 questions the two share. The "
               "reward is 1 when the last number of the answer equals the reference.",
               "The held-out accuracy is evaluated by the rollout worker between its groups at step 0, every "
               "`eval.every` steps and at the end; its 95% interval is Wilson's over the rows evaluated. The "
               "`eval:pass_at_1` panel plots it over the version evaluated.",
               "Seen when this part was added (2 seeds, 40 steps of 8 groups x 4 answers, 26 minutes each on 2 "
               "cores): the goal, held-out pass@1 up by 5 points beyond both seeds' intervals, was NOT reached. "
               "Held-out pass@1 went 9.8% -> 10.5% and 9.8% -> 9.0% (both within the start's interval); the "
               "training reward rose from 2-4% over the first 3 steps to 10% over the last 5, and the answers "
               "grew from 35 to 63-86 tokens. The mismatch KL climbs to 0.1-0.3 per token within 6 steps. That was first read as "
               "policy lag (`queue.max_lag` 1); the `real-rollout` section's bf16/master arm shows the same climb "
               "with no lag at all. The cause is the learner's precision: these runs computed at the fp32 master "
               "weights, and at lr 2e-5 most of an update is below bf16's resolution (after 10 steps 82% of the "
               "weights had changed in fp32, 6% in the bf16 copy the engines serve; KL from the base model 0.29 "
               "per token in fp32, 0.005 in bf16). So the learner trained a policy the engines never served, "
               "and the held-out evaluation, which the engines run, saw little of it. The learner now computes "
               "at the served weights (`learner.served_weights`, default on since; these runs predate it). "
               "The signal is thin, too: 6.2 and 6.6 of each step's 8 groups had 4 equal rewards (all wrong, "
               "mostly) and so no advantage, and 8 and 5 of the 40 steps had no gradient at all. "
               "What to try next, not tuned here to flatter the evaluation: more answers per prompt, or "
               "resampling until a step has enough groups with a reward spread (DAPO's dynamic sampling); fp16 "
               "rollout (38% of the same update visible) or a higher LR; more steps. On a GPU this recipe is "
               "minutes, not hours.",
               "Seed 001's length trigger, replayed on these runs' response lengths (`schedule.kind: length_surge`'s "
               "own rule, offline; the runs used a constant LR): at its default 2x it never fires, since real "
               "answers grew steadily (45 -> 63 and 49 -> 86 tokens over 40 steps) rather than surging. At 1.5x it "
               "fires at step 16 in seed 1 only, the seed whose held-out accuracy fell and whose mismatch rose "
               "most (k3 0.23 against 0.13): a plausible early warning, but one run in two is no evidence that "
               "decaying there would have helped."],
        # a mechanical check: answers cut at 32 tokens rarely differ in reward, so dynamic sampling would wait long
        quick={"steps": 1, "eval.size": 4, "sampling.max_tokens": 32, "learner.groups_per_step": 2,
               "learner.dynamic_sampling": False, "workers": 1, "rollout.cpus": "0"},  # one engine to start
        check=evaluated_start_and_end),
    "real-rollout": Finding(
        title="Seeds 000 and 002 on the real model: bf16, fp16 and int8 rollout (int8 with and without token TIS)",
        arms={"bf16": {"rollout.precision": "bf16", "learner.is_mode": "none"},
              "fp16": {"rollout.precision": "fp16", "learner.is_mode": "none"},
              "int8": {"rollout.precision": "int8", "learner.is_mode": "none"},
              "int8+tis": {"rollout.precision": "int8", "learner.is_mode": "token_tis"},
              "bf16/master": {"rollout.precision": "bf16", "learner.is_mode": "none",
                              "learner.served_weights": False}},
        # one worker on its own core, as when these arms were first run (the recipe's second worker shares
        # the learner's core)
        defaults={**recipe("configs/smollm2-math.yaml"), "steps": 10, "queue.max_lag": 0, "eval.every": 10,
                  "eval.size": 128, "workers": 1, "rollout.cpus": "0"},
        curves=["mismatch_k3_kl", "mismatch_log_ppl_abs_diff", "reward_mean", "is_truncated_fraction",
                "quant_kl_vs_bf16"],
        columns={"steps": len,
                 "stale groups": stale_groups,
                 "KL (k1, staleness 0)": mean_of("mismatch_kl_fresh"),
                 "KL (k3, all)": mean_of("mismatch_k3_kl"),
                 "KL (k3) step 1": first("mismatch_k3_kl", 1),
                 "|log ppl diff|": mean_of("mismatch_log_ppl_abs_diff"),
                 "IS truncated": mean_of("is_truncated_fraction"),
                 "int8 vs bf16 KL (probe)": mean_of("quant_kl_vs_bf16"),
                 "update visible to the engines": mean_of("learner_served_visible_fraction"),
                 "groups without advantage": mean_of("groups_skipped_equal_reward"),
                 "reward start": first("reward_mean"),
                 "reward end": final("reward_mean"),
                 "held-out pass@1 start": held_out("first"),
                 "held-out pass@1 end": held_out("last"),
                 "RL seconds": last("time")},
        notes=["The recipe (configs/smollm2-math.yaml) with `queue.max_lag` 0, so the mismatch measured is the "
               "rollout precision's against the fp32 learner, not the policy lag's; every arm trains the same "
               "10 steps of 8 groups x 4 answers and is evaluated greedily on 128 held-out rows at its start and "
               "end. `int8` is W8A8 with dynamic per-token activations, calibrated once on the task's prompts "
               "(`rlpipe calibrate`) and then quantized on the learner every update; `int8+tis` adds token-level "
               "TIS (`is_cap` 2). `bf16`, `fp16` and `int8` train without any correction.",
               "`bf16` and `fp16` compute the learner's forwards at the weights as the engines hold them "
               "(`learner.served_weights`, the default); `bf16/master` is the same arm at the fp32 master "
               "weights, as rlpipe did before: after its 10 steps at lr 2e-5, 82% of the weights had changed in "
               "fp32 but 6% in bf16 (KL 0.29 per token from the base model in fp32, 0.005 in bf16), so the "
               "learner trained a policy the engines never served and read that gap as mismatch.",
               "Seed 000's training-precision arms (a bf16 or fp16 learner) are not run on the real model: this "
               "CPU has no native bf16/fp16 matmul and the learner trains about 10x slower in them "
               "(docs/bench/learner.md), which would put one run past an hour. The toy's `precision` section "
               "has them.",
               "10 steps move held-out accuracy by less than its interval (the `real` section needed 40 steps to "
               "move the training reward), so the held-out columns say whether an arm broke, not which is better; "
               "the arms are compared by their mismatch.",
               "Seen when this part was added: with served weights bf16's mismatch stays where it starts (k3 "
               "0.0021 over 10 steps in both seeds, 0.0019-0.0031 in every step), where bf16/master climbed to "
               "0.20 by step 9 (mean 0.076). int8 is 10x bf16 (k3 0.020-0.021 in all three int8 runs, flat over "
               "the steps; the probe's KL against the bf16 model 0.037-0.055), and token TIS (`is_cap` 2) "
               "truncates 0.6-0.7% of the tokens. The held-out accuracy does not separate the arms: bf16 went "
               "11.7% -> 12.5% and 11.7%, int8 12.5% -> 9.4%, int8+tis 12.5% -> 7.8% and 10.2%, each within its "
               "128-row interval (about +-6 points). All three int8 runs ended lower and neither bf16 run did; "
               "a hint worth a longer run, not evidence. The int8 monitor's KL against the bf16 model of the "
               "same weights (probe set) grows as the policy trains, 0.022 at step 1 to 0.06-0.10 at step 10, "
               "and warned from step 6-7 (`quant.int8.max_kl_vs_bf16` 0.05, `quant.int8.recalibrate: warn`, the "
               "default); "
               "`auto` would have recalibrated there, which was not tried.",
               "How these runs were made: two at a time on the 2 cores, each run's worker on core 0 and learner "
               "on core 1. Three runs were killed for memory (two real-model runs need about 18 GB) and are not "
               "in the table: fp16 in seed 001, int8 in seed 001, a first int8+tis in seed 000; the runs started "
               "after that (int8 and int8+tis in seed 000) used `learner.activation_memory_gib` 2 (smaller "
               "micro-batches, the same step). So fp16 has no run here: the `real-int8` section compares the bf16, "
               "fp16 and int8 engines against the learner on real answers, which is seed 000's rollout question. "
               "The bf16/master run (seed 001) was trained before `learner.served_weights` existed."],
        quick_arms=["bf16"],  # the quick real-int8 part calibrates and serves int8 on SmolLM2 already
        quick_from="real"),
}

QUICK = {"steps": 3, "learner.groups_per_step": 8, "workers": 1}  # --quick: 1 seed, the quick arms, these settings


def slug(arm: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", arm)


def run_id(arm: str, seed: int) -> str:
    return f"{slug(arm)}-s{seed}"


def parse_sets(items: list[str]) -> dict:
    sets = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        sets[key] = yaml.safe_load(value)
    return sets


def run_finding(name: str, f: Finding, arms: list[str], seeds: list[int], settings: dict, out: Path) -> dict:
    """Train every arm x seed as a whole demo run; returns {arm: {seed: metrics rows}} of those that finished."""
    from launch.demo import run_demo
    from learner.metrics import read_jsonl
    from rlpipe.config import build_config

    runs_dir = out / name / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    (out / name / "settings.json").write_text(json.dumps({"command": this_command(), "settings": settings,
                                                          "arms": arms, "seeds": seeds}, indent=1))
    todo = [(seed, arm) for seed in seeds for arm in arms]
    for i, (seed, arm) in enumerate(todo, 1):
        rid = run_id(arm, seed)
        print(f"[seeds] {name} {i}/{len(todo)}: {rid} ({settings['steps']} steps)", file=sys.stderr, flush=True)
        shutil.rmtree(runs_dir / rid, ignore_errors=True)  # a kept run dir would be resumed, not trained anew
        t0 = time.time()
        try:
            cfg = build_config({}, environ={}, seed=seed, run_id=rid, **{**settings, **f.arms[arm]})  # the arm wins
            run_demo(cfg, runs_dir=str(runs_dir), progress=False, timeout_s=7200)
        except Exception as e:  # one failed run should not lose the others
            print(f"[seeds] {rid} failed after {time.time() - t0:.0f}s: {type(e).__name__}: {e}", file=sys.stderr)
            (runs_dir / rid).mkdir(parents=True, exist_ok=True)
            (runs_dir / rid / "failed.txt").write_text(f"{type(e).__name__}: {e}\n")
            continue
        rows = read_jsonl(runs_dir / rid / "metrics.jsonl")
        print(f"[seeds] {rid}: {len(rows)} steps in {time.time() - t0:.0f}s, reward end "
              f"{final('reward_mean')(rows):.3f}, k3 KL {mean_of('mismatch_k3_kl')(rows):.2e}", file=sys.stderr,
              flush=True)
    return load_runs(name, f, out, arms, seeds)


def quick_runs_of(source: str, arm: str, out: Path) -> tuple[dict, dict]:
    """``source``'s quick run (its first quick arm, seed 0) shown under ``arm``, and its settings: what a finding
    with ``quick_from`` reports under --quick instead of training (the bench part runs after ``source``'s)."""
    f = FINDINGS[source]
    theirs = (f.quick_arms or list(f.arms))[0]
    runs = load_runs(source, f, out, [theirs], [0])[theirs]
    if not runs:
        raise SystemExit(f"[seeds] --quick reads {source}'s quick run, and {out / source / 'runs'} has none: "
                         f"run `bench/seeds.py --finding {source} --quick` first")
    kept = json.loads((out / source / "settings.json").read_text())["settings"]
    return {arm: runs}, {**kept, "--quick": f"{source}'s quick run, arm {theirs}: nothing trained"}


def load_runs(name: str, f: Finding, out: Path, arms: list[str] | None = None,
              seeds: list[int] | None = None) -> dict[str, dict[int, list[dict]]]:
    """The kept runs of a finding: {arm: {seed: metrics rows}}; all seeds found when ``seeds`` is None."""
    from learner.metrics import read_jsonl

    runs: dict[str, dict[int, list[dict]]] = {}
    for arm in arms or list(f.arms):
        runs[arm] = {}
        for path in sorted((out / name / "runs").glob(f"{slug(arm)}-s*/metrics.jsonl")):
            seed = path.parent.name[len(slug(arm)) + 2:]
            if not seed.isdigit() or (seeds is not None and int(seed) not in seeds) or \
                    (path.parent / "failed.txt").exists():
                continue
            rows = Rows(read_jsonl(path))
            rows.evals = read_jsonl(path, kind="eval")
            if rows:
                runs[arm][int(seed)] = rows
    return runs


def _mean(values: list) -> float | None:
    values = [v for v in values if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))]
    return statistics.fmean(values) if values else None


def write_section(name: str, f: Finding, runs: dict[str, dict[int, list[dict]]], settings: dict,
                  command: str | None = None, failed: list[str] | None = None) -> Section:
    """The finding's section: one table (each arm's seeds, then their mean), one plot of the curves, the notes."""
    sec = Section(name, f.title, command)
    columns = list(f.columns)
    table = []
    for arm, by_seed in runs.items():
        arm_rows = [[arm, seed, *[f.columns[c](rows) for c in columns]] for seed, rows in sorted(by_seed.items())]
        table += arm_rows
        if len(arm_rows) > 1:
            table.append([arm, "mean", *[_mean([r[2 + j] for r in arm_rows]) for j in range(len(columns))]])
    sec.table("Per arm and seed", ["arm", "seed", *columns], table,
              note="Means over each run's steps; reward start = first 3 steps, reward end = last 5 steps; "
                   "`mean` rows average the seeds above them. Settings: "
                   + ", ".join(f"{k}={v}" for k, v in settings.items()) + ".")
    curves = [c for c in f.curves if any(c in r or (c.startswith("eval:") and getattr(rows, "evals", None))
                                         for by_seed in runs.values() for rows in by_seed.values() for r in rows)]
    if curves:
        ncols = min(3, len(curves))
        fig, axes = figure(ncols=ncols, nrows=math.ceil(len(curves) / ncols), width=4.6, height=3.6)
        axes = list(axes.flat)
        for ax, key in zip(axes, curves):
            plot_curve(ax, key, runs)
        for ax in axes[len(curves):]:
            ax.set_visible(False)
        axes[0].legend(fontsize=8)
        fig.suptitle(f.title)
        fig.tight_layout()
        sec.plot(fig, "curves", "Per learner step, each arm a color: every seed faint, the mean over seeds bold. "
                                "KL-like panels use a log scale where every value is positive.")
    for n in f.notes:
        sec.note(n)
    missing = [c for c in f.curves if c not in curves]
    if missing:
        sec.note(f"Not in any run's metrics.jsonl, so not plotted: {', '.join(missing)}.")
    if failed:
        sec.note(f"Runs that failed (see their run dir's failed.txt and logs/): {', '.join(failed)}.")
    return sec


def plot_curve(ax, key: str, runs: dict[str, dict[int, list[dict]]]) -> None:
    """``eval:<field>`` plots a held-out evaluation's field over the version it evaluated."""
    positive = True
    evaluated = key.startswith("eval:")
    for i, (arm, by_seed) in enumerate(runs.items()):
        color = f"C{i}"
        per_step: dict[int, list[float]] = {}
        for rows in by_seed.values():
            if evaluated:
                rows = [{"step": e["version"], key: e[key[5:]]} for e in getattr(rows, "evals", [])]
            have = [r for r in rows if r.get(key) is not None]
            ax.plot([r["step"] for r in have], [r[key] for r in have], color=color, alpha=0.25, linewidth=1)
            for r in have:
                per_step.setdefault(r["step"], []).append(r[key])
                positive = positive and r[key] > 0
        steps = sorted(per_step)
        if steps:
            ax.plot(steps, [statistics.fmean(per_step[s]) for s in steps], color=color, linewidth=2.2,
                    label=f"{arm} ({len(by_seed)} seed{'s' if len(by_seed) != 1 else ''})")
    if positive and any(s in key for s in ("kl", "diff", "scale")):
        ax.set_yscale("log")
    ax.set(xlabel="learner step", title=key)
    ax.grid(alpha=0.3)


def main(argv: list[str] | None = None) -> dict[str, Section]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--finding", default=",".join(FINDINGS), help=f"comma-separated, of {', '.join(FINDINGS)}")
    ap.add_argument("--seeds", default=None, help="comma-separated (default 0,1; with --from-runs every seed kept)")
    ap.add_argument("--arms", default=None, help="comma-separated arms to run (default: every arm of the finding)")
    ap.add_argument("--steps", type=int, default=None, help="override the finding's steps")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 1 seed, the fewest arms, 3 steps of 8 groups, 1 worker")
    ap.add_argument("--json-dir", default=str(ROOT / "docs" / "results"), help="writes <json-dir>/<finding>.json")
    ap.add_argument("--out", default="runs/seeds", help="runs are kept in <out>/<finding>/runs")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config key for every arm, e.g. --set quant.int8.activations=dynamic")
    ap.add_argument("--from-runs", action="store_true", help="redo tables and plots from the runs kept in --out")
    args = ap.parse_args(argv)
    names = args.finding.split(",")
    for name in names:
        if name not in FINDINGS:
            ap.error(f"unknown finding {name!r} (have {', '.join(FINDINGS)})")
    out = Path(args.out).resolve()
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    sections, broken = {}, []
    for name in names:
        f = FINDINGS[name]
        if args.arms:  # with several findings, each takes the arms it has
            arms = [a for a in args.arms.split(",") if a in f.arms]
            if not arms:
                ap.error(f"{name}: none of --arms {args.arms} (have {', '.join(f.arms)})")
        else:
            arms = (f.quick_arms or list(f.arms)[:1]) if args.quick else list(f.arms)
        settings = {**f.defaults, **({**QUICK, **f.quick} if args.quick else {}), **parse_sets(args.set)}
        if args.steps:
            settings["steps"] = args.steps
        command, failed = None, []
        if args.from_runs:
            kept = out / name / "settings.json"
            if kept.exists():  # the command and settings that trained the runs
                info = json.loads(kept.read_text())
                command, settings = info["command"] + "  (tables redone with --from-runs)", info["settings"]
            runs = load_runs(name, f, out, arms, seeds)
        else:
            run_seeds = seeds or ([0] if args.quick else [0, 1])
            if args.quick and f.quick_from:
                runs, settings = quick_runs_of(f.quick_from, arms[0], out)
            else:
                runs = run_finding(name, f, arms, run_seeds, settings, out)
            failed = [run_id(a, s) for a in arms for s in run_seeds if s not in runs.get(a, {})]
        runs = {a: by_seed for a, by_seed in runs.items() if by_seed}
        if f.check and not args.from_runs and not (args.quick and f.quick_from):  # that part checked its own run
            broken += [f"{name} {run_id(a, seed)}: {p}" for a, by_seed in runs.items()
                       for seed, rows in by_seed.items() for p in f.check(rows, settings)]
        if not runs:
            print(f"[seeds] {name}: no runs in {out / name / 'runs'}", file=sys.stderr)
            continue
        sec = write_section(name, f, runs, settings, command, failed)
        path = sec.write(Path(args.json_dir) / f"{name}.json")
        print(render_section(sec.to_dict()))
        print(f"[seeds] wrote {path} and its plots", file=sys.stderr)
        sections[name] = sec
    if broken:
        raise SystemExit("[seeds] runs that broke their finding's check:\n  " + "\n  ".join(broken))
    return sections


if __name__ == "__main__":
    main()
