"""Tiny random models of the decoder families users train, as transformers builds them: the
architecture matrix (tests/test_architectures.py, tests/test_activation_checkpointing.py).
They use the toy's character tokenizer, so a rollout worker can serve them."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = {  # transformers' config class, and what a tiny config of the family needs
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "mistral": ("MistralConfig", {}),
    "gemma": ("GemmaConfig", {"head_dim": 32}),  # tied embeddings
    "phi3": ("Phi3Config", {}),  # fused qkv_proj and gate_up_proj
    # no grouped-query attention; layers at gpt_neox.layers, and its head is lm_head in memory
    # but embed_out in the checkpoint vLLM loads
    "gpt_neox": ("GPTNeoXConfig", {"num_key_value_heads": None}),
    # a mixture of experts: each layer's experts fused in memory ([experts, ...] tensors),
    # one tensor per expert and projection in the checkpoint vLLM loads
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 64, "norm_topk_prob": True}),
    # three more mixture-of-experts layouts: Mixtral's (w1/w2/w3 per expert under block_sparse_moe in
    # the checkpoint), OLMoE's (q/k norms, no renormalised top-k) and Qwen2-MoE's
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
    # Qwen2-MoE's: a shared expert beside the routed ones, weighted by a sigmoid gate of its own,
    # and no renormalised top-k (its default)
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                     "shared_expert_intermediate_size": 64}),
}
LAYERS = 2


def tiny_config(family: str):
    import transformers

    from launch.toy import BOS_ID, CHARS, EOS_ID, PAD_ID, SPECIAL_TOKENS

    name, extra = FAMILIES[family]
    fields = {"vocab_size": len(SPECIAL_TOKENS) + len(CHARS), "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": LAYERS, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 64, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
              **extra}
    return getattr(transformers, name)(**{k: v for k, v in fields.items() if v is not None})


def tiny_model(family: str, seed: int = 0):
    """The family's model in fp32, in eval mode, the same for the same seed."""
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(family)).float().eval()


def save_tiny_model(family: str, out_dir: Path) -> str:
    """A model directory of the family (safetensors, config, the toy's tokenizer), as vLLM loads one."""
    from launch.toy import build_tokenizer

    tiny_model(family).save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(out_dir)
    return str(out_dir)
