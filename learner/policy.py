"""The training policy: a Hugging Face causal LM and its per-token log-probs.

The learner divides the logits by the rollout temperature before the softmax, so its
log-probs are of the same distribution vLLM reports as ``processed_logprobs`` (with
``top_p = 1`` and ``top_k`` off, which the config warns about otherwise).
"""

from __future__ import annotations

import torch

from learner.batch import Batch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_policy(path: str, dtype: str = "fp32"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    model.config.use_cache = False
    return model


def token_logprobs(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the entropy of its distribution, both (N, T-1).

    Each row's logits are divided by the temperature it was sampled with. The softmax
    runs in fp32 whatever the model's dtype (it is where precision matters most).
    """
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logp_all = torch.log_softmax(logits.float() / batch.temperature[:, None, None], dim=-1)  # (N, T-1, V)
    logp = logp_all.gather(-1, batch.targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
