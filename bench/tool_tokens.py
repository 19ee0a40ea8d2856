"""Token-exact against re-tokenized tool episodes, on SmolLM2 with the in-turn calculator.

Two claims of the reading list say a tool episode is where RL training breaks. One: a trainer that
keeps an episode as text and tokenizes it again trains tokens the policy never sampled, with very low
log-probs. Two: tool use widens the rollout-training mismatch at the tool's boundary. This measures
both on real answers of the calculator recipe (configs/smollm2-calc.yaml): its training prompts, its
sampling, its rollout engine (vLLM at the recipe's precision), and the learner's log-probs (fp32,
logits over the sampling temperature, the learner's own function) on

- the **token-exact** rows rlpipe trains: the ids the engine saw, the tool's value as context;
- the **re-tokenized** rows a text-based trainer would train: the same answer's text tokenized again
  (learner/retokenize.py aligns them and says which tokens changed).

It reports how many answers and tokens change, where (at the tool's boundary or elsewhere), how likely
the changed tokens are under the policy, and the mismatch between the engine's and the learner's
log-probs on the tokens right after the tool's text against all other sampled tokens.

    python -P bench/tool_tokens.py                       # 32 prompts x 8 answers, the recipe's settings
    python -P bench/tool_tokens.py --prompts 4 --n 2     # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "configs" / "smollm2-calc.yaml"


async def sample_answers(cfg, prompts: int, n: int) -> tuple[list[list[int]], list]:
    """``n`` answers with the tool to each of the first ``prompts`` training prompts, as a worker writes them."""
    from transformers import AutoTokenizer

    from quant.precision_profile import profile_for
    from rollout_service.engine import RolloutEngine
    from rollout_service.inline_tools import answer_with_tool, load_tool
    from rollout_service.tasks import PromptEncoder, make_task

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    encode, task, tool = PromptEncoder(cfg.task, tokenizer, cfg.model.path), make_task(cfg.task), load_tool(cfg.task.tool)
    engine = RolloutEngine(cfg.model.path, profile_for(cfg.rollout.precision, quant=cfg.quant,
                                                        model_path=cfg.model.path), cfg.rollout, seed=cfg.seed)
    await engine.start()
    s = cfg.sampling
    try:
        rows = [encode(task.prompt(i).text) for i in range(prompts)]
        answers = await asyncio.gather(*(
            answer_with_tool(engine, tokenizer, ids, tool(), s.max_tokens, 1000 * i + j, temperature=s.temperature,
                             top_p=s.top_p, top_k=s.top_k) for i, ids in enumerate(rows) for j in range(n)))
    finally:
        engine.shutdown()
    return [rows[k // n] for k in range(len(answers))], answers


def learner_logprobs(model, prompt: list[int], answer: np.ndarray, temperature: float) -> np.ndarray:
    """The learner's log-prob of each answer token after ``prompt``: the row the learner builds
    (learner/batch.py ``collate``) through its own function (learner/policy.py ``token_logprobs``)."""
    import torch

    from learner.batch import collate
    from learner.policy import token_logprobs
    from rlpipe.schema import GroupRecord, Sample

    tokens = np.asarray(answer, dtype=np.int32)
    sample = Sample(tokens, np.zeros(len(tokens), dtype=np.float32), "stop", 0.0)
    record = GroupRecord("bench", "g", "p", "bench", 0, 0, "fp32", "", {"temperature": temperature},
                         np.asarray(prompt, dtype=np.int32), [sample])
    with torch.no_grad():
        lp, _ = token_logprobs(model, collate([record], torch.zeros(1, 1), 0))
    return lp[0, len(prompt) - 1:].numpy()


def compare(cfg, prompts: list[list[int]], answers) -> dict:
    """The module docstring's numbers, over every answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.retokenize import retokenize, tool_boundaries

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype="float32").eval()
    t = cfg.sampling.temperature
    acc = {k: [] for k in ("boundary", "other", "changed_lp", "changed_mu", "sampled_lp", "seq_exact", "seq_retok")}
    counts = dict(answers=len(answers), with_tool=0, changed_answers=0, tokens=0, sampled=0, changed=0,
                  changed_trained=0, changed_at_tool=0)
    examples: list[dict] = []
    for prompt, a in zip(prompts, answers):
        m = a.mask.astype(bool)
        lp = learner_logprobs(model, prompt, a.tokens, t)
        diff = (a.logprobs - lp)[m]  # log mu - log pi over the sampled tokens
        at = tool_boundaries(a.mask)[m]
        acc["boundary"] += diff[at].tolist()
        acc["other"] += diff[~at].tolist()
        acc["sampled_lp"] += lp[m].tolist()
        acc["seq_exact"].append(float((lp - a.logprobs)[m].sum()))
        counts["with_tool"] += int((~m).any())
        counts["tokens"] += len(m)
        counts["sampled"] += int(m.sum())
        r = retokenize(tokenizer, a.tokens, a.mask, a.logprobs)
        same = r.tokens.tolist() == a.tokens.tolist()  # most answers: then so are the log-probs
        lp_r = lp if same else learner_logprobs(model, prompt, r.tokens, t)
        trained = r.mask.astype(bool)
        acc["seq_retok"].append(float((lp_r - r.logprobs)[trained].sum()))
        counts["changed_answers"] += int(r.changed.any())
        counts["changed"] += int(r.changed.sum())
        counts["changed_trained"] += int((r.changed & trained).sum())
        tool = r.mask == 0
        near_tool = tool | np.r_[tool[1:], False] | np.r_[False, tool[:-1]]  # the tool's tokens and their neighbours
        counts["changed_at_tool"] += int((r.changed & near_tool).sum())
        if r.changed.any() and len(examples) < 5:  # what changed, as the two tokenizations of the text
            where = np.flatnonzero(r.changed)
            examples.append({"sampled": [tokenizer.decode([int(x)]) for x in a.tokens[max(where[0] - 2, 0):]][:12],
                             "again": [tokenizer.decode([int(x)]) for x in r.tokens[max(where[0] - 2, 0):]][:12]})
        acc["changed_lp"] += lp_r[r.changed & trained].tolist()
        acc["changed_mu"] += r.logprobs[r.changed & trained].tolist()
    return {**counts, **{k: summary(v) for k, v in acc.items()}, "examples": examples}


def summary(values: list[float]) -> dict:
    """Count, mean, mean absolute value and k3 (the mismatch KL estimate, for log-ratios)."""
    x = np.asarray(values, dtype=np.float64)
    if not len(x):
        return {"count": 0}
    return {"count": len(x), "mean": float(x.mean()), "mean_abs": float(np.abs(x).mean()),
            "k3": float((np.exp(-x) - 1 + x).mean()), "min": float(x.min())}


def section(r: dict, command: str):
    """The results section: what changes, the mismatch at the tool's boundary, the changed tokens' log-probs."""
    from launch.results import Section

    sec = Section("tool-tokens", "Token-exact against re-tokenized tool episodes (SmolLM2, in-turn calculator)",
                  command)
    per_k = lambda x: round(1000 * x / max(r["sampled"], 1), 2)  # noqa: E731
    sec.table("What a text-based trainer trains on: the answers' text tokenized again", ["", "count", "per 1,000 "
              "sampled tokens"], [
        ["answers", r["answers"], None], ["answers that used the tool", r["with_tool"], None],
        ["answers with a changed token", r["changed_answers"], None],
        ["sampled tokens", r["sampled"], 1000.0], ["changed tokens", r["changed"], per_k(r["changed"])],
        ["changed and trained (a sampled character in them)", r["changed_trained"], per_k(r["changed_trained"])],
        ["changed, within one token of the tool's text", r["changed_at_tool"], per_k(r["changed_at_tool"])]])
    rows = [[name, d.get("count", 0), d.get("mean"), d.get("mean_abs"), d.get("k3")]
            for name, d in (("first sampled token after the tool's text", r["boundary"]),
                            ("every other sampled token", r["other"]))]
    sec.table(f"Engine ({r['precision']}) against learner (fp32): log mu - log pi on the token-exact rows",
              ["tokens", "count", "mean", "mean |.|", "k3 (KL estimate)"], rows)
    lp = [[name, d.get("count", 0), d.get("mean"), d.get("min")]
          for name, d in (("every sampled token: learner log-prob", r["sampled_lp"]),
                          ("changed, trained tokens: learner log-prob", r["changed_lp"]),
                          ("changed, trained tokens: behaviour log-prob kept for them", r["changed_mu"]),
                          ("token-exact answer: sum of log pi - log mu", r["seq_exact"]),
                          ("re-tokenized answer: sum of log pi - log mu", r["seq_retok"]))]
    sec.table("Log-probs of what each trainer trains", ["", "count", "mean", "min"], lp)
    sec.note(f"On {r['machine']}, the engine at {r['precision']}. {r['answers']} answers at temperature {r['temperature']} to the calculator recipe's first training "
             f"prompts, {r['seconds']:.0f} s. A changed token is one the re-tokenized text holds where the sampled "
             "ids differ (learner/retokenize.py); its behaviour log-prob is the sum over the sampled tokens inside "
             "it, the most a text-based trainer could know.")
    for e in r.get("examples", []):
        sec.note("Changed: sampled `" + "|".join(e["sampled"]).replace("\n", "\\n") + "`, tokenized again `"
                 + "|".join(e["again"]).replace("\n", "\\n") + "`")
    sec.data = r
    return sec


def main(argv: list[str] | None = None) -> dict:
    from launch.demo import resolve_model
    from rlpipe.config import load_config
    from rlpipe.machine import cpu_name

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32, help="training prompts, from the first")
    p.add_argument("--n", type=int, default=8, help="answers a prompt (the recipe's sampling.n)")
    p.add_argument("--json", type=Path, help="write the results section here")
    args = p.parse_args(argv)
    cfg = load_config(RECIPE)
    cfg.model.path = resolve_model(cfg, log=lambda m: print(m, file=sys.stderr))
    t0 = time.monotonic()
    prompts, answers = asyncio.run(sample_answers(cfg, args.prompts, args.n))
    out = {"machine": cpu_name(), "precision": cfg.rollout.precision,
           "temperature": cfg.sampling.temperature, **compare(cfg, prompts, answers),
           "seconds": round(time.monotonic() - t0, 1)}
    print(json.dumps(out, indent=1))
    if args.json:
        section(out, f"python -P bench/tool_tokens.py --prompts {args.prompts} --n {args.n}").write(args.json)
    return out


if __name__ == "__main__":
    main()
