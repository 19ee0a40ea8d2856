"""How much a recipe's held-out score can move by sharpening alone: the base model's greedy,
sampled, pass@k and majority-of-k accuracy per row, before any training.

GRPO mostly makes the policy's likeliest answer more likely. Greedy pass@1 then rises only
on rows where the right answer is already the mode of the sampled answers but not greedy's
pick, or becomes the mode. So ``maj@k`` (the most frequent extracted answer of k samples) is
roughly what sharpening alone can reach, and ``pass@k`` what a policy that learns more than
its sampled mode could. When ``maj@k`` is no higher than greedy, a gain on held-out rows needs
the model to get more answers right, not to be surer of them (docs/baselines.md).

Offline vLLM on one recipe's model, prompts and reward (the task's own code), nothing else:

    python -P bench/headroom.py --config configs/smollm2-math.yaml --rows 120
    python -P bench/headroom.py --config configs/smollm2-math.yaml --dataset mawps:singleop --rows 64

The dataset defaults to the config's ``eval.dataset`` (its held-out set after
``eval.drop_shared``); samples use the config's ``sampling.temperature`` and ``max_tokens``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def prompts_of(cfg, dataset: str | None, rows: int) -> list[tuple[str, str]]:
    """(prompt text, reference answer) of the first ``rows`` rows: the held-out set the run
    evaluates (rollout_service/evals.py, training questions dropped) unless ``dataset`` names another set."""
    from rollout_service.evals import make_eval_task
    from rollout_service.tasks import eval_task_config, make_task

    task = make_task(eval_task_config(cfg.task, dataset)) if dataset else make_eval_task(cfg)
    return [(p.text, p.answer) for p in map(task.prompt, range(min(rows, task.size)))]


def score(answers: list[str], outputs: list[str]) -> dict:
    """Per row: greedy right, lenient right, share of samples right, majority answer right."""
    from rollout_service.tasks import any_number_matches, number_reward

    greedy, lenient, sampled, majority = [], [], [], []
    for answer, (g, samples) in zip(answers, outputs):
        greedy.append(number_reward(answer, g)[0])
        lenient.append(float(any_number_matches(answer, g)))
        found = [number_reward(answer, s) for s in samples]
        sampled.append(sum(r for r, _ in found) / len(found))
        picks = collections.Counter(info.get("extracted", "") for _, info in found)
        top = picks.most_common(1)[0][0]
        majority.append(number_reward(answer, top)[0] if top else 0.0)
    n = len(greedy)
    return {"rows": n, "greedy": sum(greedy) / n, "lenient": sum(lenient) / n, "sampled": sum(sampled) / n,
            "pass_at_k": sum(p > 0 for p in sampled) / n, "maj_at_k": sum(majority) / n,
            "spread": sum(0 < p < 1 for p in sampled) / n,
            "mode_right_greedy_wrong": sum(m > 0 and not g for m, g in zip(majority, greedy)) / n}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="the recipe: its model, task, prompts and sampling")
    ap.add_argument("--dataset", help="another set than the config's held-out one (e.g. its training set)")
    ap.add_argument("--rows", type=int, default=120)
    ap.add_argument("--k", type=int, default=8, help="samples per row")
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from launch.demo import resolve_model
    from rlpipe.config import load_config

    cfg = load_config(args.config, environ={})
    model = resolve_model(cfg, log=lambda m: print(m, file=sys.stderr))
    rows = prompts_of(cfg, args.dataset, args.rows)
    tok = AutoTokenizer.from_pretrained(model)
    texts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
             if cfg.task.chat_template else t for t, _ in rows]
    dtype = {"fp32": "float32", "fp16": "float16"}.get(cfg.rollout.precision, "bfloat16")
    llm = LLM(model, dtype=dtype, enforce_eager=True, max_model_len=cfg.rollout.max_model_len)
    t0 = time.time()
    # No per-request seed: with chunked prefill it crashes vLLM CPU (rollout_service/vllm_compat.py)
    greedy = llm.generate(texts, SamplingParams(temperature=0, max_tokens=cfg.sampling.max_tokens))
    sampled = llm.generate(texts, SamplingParams(temperature=cfg.sampling.temperature, n=args.k,
                                                 max_tokens=cfg.sampling.max_tokens))
    outputs = [(g.outputs[0].text, [o.text for o in s.outputs]) for g, s in zip(greedy, sampled)]
    result = {"config": args.config, "dataset": args.dataset or cfg.eval.dataset, "k": args.k,
              "temperature": cfg.sampling.temperature, **score([a for _, a in rows], outputs),
              "seconds": round(time.time() - t0)}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
