"""The mismatch corrections by name (``learner.is_mode``), in the core: the config checks the
name and learner/loss.py computes each one, without the loss importing the config."""

from __future__ import annotations

from typing import Literal, get_args

# docs/design.md 'Loss'; learner/loss.py importance_weights says what each one does.
IsMode = Literal["none", "token_tis", "seq_tis", "token_mis", "seq_mis", "geo_mask", "icepop", "ppo_is", "vanilla_is",
                 "bypass"]
IS_MODES: tuple[str, ...] = get_args(IsMode)
RATIO_AGAINST_MU = ("ppo_is", "bypass")  # the modes whose PPO ratio is taken against mu, not pi_old
