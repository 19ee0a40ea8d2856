"""Check a run's config, data and reward in seconds, before any engine, Redis or learner starts.

    python scripts/check_run.py my-run.yaml [MODEL_DIR]

Loads and validates the config as `rlpipe demo` does (every key, and the cross-role rules of
validate_run: the held-out set shares no question with the training set), builds the task
the rollout workers build (reads every row, applies task.template and task.instruction,
imports task.reward), prints the first prompt and scores its reference answer as a response
(a reward that gives the right answer 0 is a mistake worth finding now; a remote verifier is
called for it). With MODEL_DIR (`rlpipe build-model --config my-run.yaml` prints it), it also
counts every prompt's tokens as the engine will get them (task.chat_template included) and
says whether the longest fits rollout.max_model_len with sampling.max_tokens: the workers
skip a prompt that does not. Exit 2 with one line on a mistake.
"""

from __future__ import annotations

import asyncio
import os
import sys

from launch.checks import validate_run
from rlpipe.config import ConfigError, load_config


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    from rlpipe.task_config import DatasetTask
    from rollout_service.tasks import make_task

    sys.path.insert(0, os.getcwd())  # task.reward's module, found as the roles find it (python -m launch.cli, here)
    try:
        cfg = load_config(argv[0])
        validate_run(cfg)
        task = make_task(cfg.task)
    except (ConfigError, ValueError, OSError) as e:
        print(f"check_run: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    first = task.prompt(0)
    source = cfg.task.dataset if isinstance(cfg.task, DatasetTask) else f"task.type {cfg.task.type}"
    print(f"{source}: {task.size} rows; the first prompt (row {first.prompt_id}):\n{first.text}")
    reward, info = asyncio.run(task.score(first, [first.answer]))[0]
    print(f"its reference answer {first.answer!r} as a response scores {reward} {info or ''}")
    if len(argv) == 2:
        from transformers import AutoTokenizer

        from rollout_service.tasks import PromptEncoder

        try:
            encode = PromptEncoder(cfg.task, AutoTokenizer.from_pretrained(argv[1]), argv[1])
        except ConfigError as e:
            print(f"check_run: error: {e}", file=sys.stderr)
            return 2
        lengths = [len(encode(task.prompt(i).text)) for i in range(task.size)]
        need = max(lengths) + cfg.sampling.max_tokens
        print(f"prompt tokens: longest {max(lengths)}, mean {sum(lengths) / len(lengths):.0f}; with sampling.max_tokens "
              f"{cfg.sampling.max_tokens}: {need} of rollout.max_model_len {cfg.rollout.max_model_len}")
        if need > cfg.rollout.max_model_len:
            too_long = sum(n + cfg.sampling.max_tokens > cfg.rollout.max_model_len for n in lengths)
            print(f"check_run: warning: {too_long} prompts would be skipped: raise rollout.max_model_len to {need}",
                  file=sys.stderr)
    asyncio.run(task.aclose())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
