"""The mismatch corrections by name (``learner.is_mode``), in the core: the config checks the
name and learner/loss.py computes each one, without the loss importing the config."""

from __future__ import annotations

from typing import Literal, get_args

# docs/design.md 'Loss'; learner/loss.py importance_weights says what each one does.
IsMode = Literal["none", "token_tis", "seq_tis", "token_mis", "seq_mis", "geo_mask", "icepop", "ppo_is", "vanilla_is",
                 "bypass"]
IS_MODES: tuple[str, ...] = get_args(IsMode)
RATIO_AGAINST_MU = ("ppo_is", "bypass")  # the modes whose PPO ratio is taken against mu, not pi_old

# How score centering (``learner.score_centering_k``, learner/score_centering.py) weights the tokens the
# sampler could have drawn at a position, under each mode: ``one`` (no weight), ``token`` (the mode's
# f(p/q) per token, as it weighs the sampled one) or ``sequence`` (the sequence's own weight, the same for
# every token of a position). The modes not listed correct through the PPO ratio against mu, whose clip
# has no per-token weight to centre: score centering is refused with them.
CENTERING_WEIGHT: dict[str, str] = {
    "none": "one", "vanilla_is": "token", "token_tis": "token", "token_mis": "token", "icepop": "token",
    "seq_tis": "sequence", "seq_mis": "sequence", "geo_mask": "sequence",
}
