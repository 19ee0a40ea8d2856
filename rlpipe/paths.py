"""Where rlpipe keeps what it builds, and the built-in model names.

The core (config checks, quant's cached checkpoints) and the roof (demo, the toy model
builder) both need these; they live here, standard library only, so that neither reaches
into launch/toy.py for a path.
"""

from __future__ import annotations

import os
from pathlib import Path

TOY_PREFIX = "toy-"  # model.path "toy-<arch>" names a toy model of one of TOY_ARCHS, built like the default
# The toy architectures, and what a toy of each differs in from the spec's defaults.
TOY_ARCHS = {
    "qwen2": {},
    # What the Qwen2 toy lacks: its own LM head (not tied to the embeddings) and GQA.
    "llama": {"arch": "llama", "num_heads": 4, "num_kv_heads": 2, "tie_word_embeddings": False},
    # A mixture of experts in Qwen3-MoE's layout: 4 experts a layer, 2 per token, each half the
    # dense toys' FFN width (the same active FFN), untied head and GQA as the Llama toy.
    "moe": {"arch": "moe", "num_heads": 4, "num_kv_heads": 2, "tie_word_embeddings": False,
            "intermediate_size": 256, "num_experts": 4, "experts_per_token": 2},
    # The same mixture of experts in Mixtral's layout (block_sparse_moe, a router that always
    # renormalises): the second MoE family the learner replays.
    "mixtral": {"arch": "mixtral", "num_heads": 4, "num_kv_heads": 2, "tie_word_embeddings": False,
                "intermediate_size": 256, "num_experts": 4, "experts_per_token": 2},
}

# Real models rlpipe prepares once from an installed package (launch/builtin_models.py).
SMOLLM2 = "smollm2-135m-instruct"
BUILTIN_NAMES = (SMOLLM2,)


def cache_root() -> Path:
    """The cache of built artifacts (toy models under ``models/``, quantized checkpoints and
    int8 profiles under ``quant/``): ``$RLPIPE_CACHE``, else ``~/.cache/rlpipe``."""
    return Path(os.environ.get("RLPIPE_CACHE", Path.home() / ".cache" / "rlpipe"))
