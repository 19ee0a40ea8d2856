"""learner.fp32_attention: under bf16 autocast on a CPU, attention runs in fp32 (learner/policy.py),
with the same log-probs and gradients as the whole step in fp32 to bf16's rounding."""

from __future__ import annotations

import torch

from learner.policy import fp32_attention, load_policy
from tests.test_head import batch_of, close, run


def test_attention_in_fp32_under_bf16_keeps_the_step_and_computes_in_fp32(toy_model_path, monkeypatch):
    model = load_policy(toy_model_path)
    batch = batch_of(model)
    reference = run(model, batch)  # fp32 throughout
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):  # what the kernel computes in: autocast's dtype if on, else the inputs'
        seen.append(torch.bfloat16 if torch.is_autocast_enabled("cpu") else torch.promote_types(q.dtype, v.dtype))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    bf16 = run(model, batch, dtype="bf16")
    assert set(seen) == {torch.bfloat16}
    seen.clear()
    assert fp32_attention(model)
    mixed = run(model, batch, dtype="bf16")
    assert set(seen) == {torch.float32}  # the attention itself, in fp32
    for got, bf16_alone, want in zip(mixed, bf16, reference):
        # bf16's rounding (2^-8 a product) bounds both; attention in fp32 is no further from fp32
        assert close(got, want, 5e-2) and close(bf16_alone, want, 5e-2)


def test_a_model_not_on_sdpa_keeps_its_attention(toy_model_path):
    model = load_policy(toy_model_path)
    model.set_attn_implementation("eager")
    assert not fp32_attention(model) and model.config._attn_implementation == "eager"
