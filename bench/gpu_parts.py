"""The pieces the GPU measurements (bench/gpu.py) and its device check (bench/gpu_check.py)
share: the Qwen2 shapes, a random Qwen2, a learner batch and one timed learner step, and
``attempt_part``, which runs one part of a measurement. They live here so that the import
arrow runs one way: bench/gpu.py imports this module and bench/gpu_check.py, and
bench/gpu_check.py imports only this module (tests/test_layers.py forbids a circle).

Imports torch alone at load time; the learner's code is imported where it is used.
"""

from __future__ import annotations

import statistics
import time

import torch

# Hugging Face Qwen2 configs of the shapes measured (random weights; only shapes matter).
SHAPES = {
    "toy": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "32B": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                intermediate_size=27648, vocab_size=152064, tie_word_embeddings=False),
}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# -- learner step ---------------------------------------------------------------------------------
def random_batch(vocab: int, rows: int, seq: int, prompt: int = 16, seed: int = 0):
    """A learner batch built as the learner builds one (``collate`` of group records): groups
    of 4 samples of random tokens, ``prompt`` prompt tokens and ``seq - prompt`` response
    tokens each, rewards 0/1 and their GRPO advantages."""
    import numpy as np

    from learner.batch import collate
    from learner.loss import compute_advantages
    from rlpipe.schema import GroupRecord, Sample

    n = 4
    rng = np.random.default_rng(seed)
    records = []
    for g in range(max(1, rows // n)):
        samples = [Sample(rng.integers(0, vocab, seq - prompt).astype(np.int32), np.zeros(seq - prompt, np.float32),
                          "length", float(i % 2)) for i in range(n)]
        records.append(GroupRecord("bench", f"gpu-{g}", str(g), "bench", 0, 0, "bf16", "",
                                   {"temperature": 1.0, "top_p": 1.0, "top_k": -1},
                                   rng.integers(0, vocab, prompt).astype(np.int32), samples))
    rewards = torch.tensor([[s.reward for s in rec.samples] for rec in records])
    advantages, _ = compute_advantages(rewards)
    return collate(records, advantages, 0)


def matmul_params(model) -> int:
    """N of 6 N per token: every parameter a token multiplies, so the input embedding is left
    out unless it is tied to the LM head (then it counts once, as the head)."""
    total = sum(p.numel() for p in model.parameters())  # a tied matrix is listed once
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    return total if tied else total - model.get_input_embeddings().weight.numel()


def learner_step(model, batch, steps: int, device: str, peak: float | None, served: bool = False) -> dict:
    """Median seconds of one training step over ``batch`` after a warm-up step, as the
    learner's PPO update computes it: bf16 autocast over the fp32 weights, PPO-clip loss,
    token-mean aggregation, gradient clipping, AdamW. ``served``: forward and backward at
    the weights a bf16 engine serves (learner.served.ServedWeights, ``learner.served_weights``),
    the optimizer step at the master's."""
    from learner.loss import loss_denominator, loss_sum, ppo_clip_terms
    from learner.policy import token_logprobs
    from learner.served import ServedWeights

    rounding = ServedWeights(model.parameters(), torch.bfloat16 if served else None)

    model.to(device).eval()  # eval: the learner runs without dropout
    batch = batch.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps + 1):
        sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with rounding.rounded():
            logp, _ = token_logprobs(model, batch, "bf16")
            per_token, _ = ppo_clip_terms(logp, logp.detach(), batch.advantages, batch.mask, torch.ones_like(logp),
                                          0.2, 0.28)
            loss = loss_sum(per_token, batch.mask, "token_mean") / loss_denominator(batch.mask, "token_mean", 0)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens = batch.input_ids.numel()
    n = matmul_params(model)
    tflops = 6 * n * tokens / step_s / 1e12
    del opt
    return {"params": sum(p.numel() for p in model.parameters()), "matmul_params": n, "rows": batch.input_ids.shape[0],
            "seq": batch.input_ids.shape[1], "step_s": step_s, "tokens_per_second": tokens / step_s,
            "tflops": tflops, "mfu": tflops / peak if peak else None,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}


def qwen2(shape: dict, seed: int = 0):
    """A random Qwen2 of ``shape``, fp32 (the learner's master weights)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**shape, use_cache=False)).float()


# -- one part of a measurement --------------------------------------------------------------------
def attempt_part(out: dict, what: str, fn, device: str):
    """Run one part of the check: on a GPU a failure is recorded in ``out["errors"]`` and the
    rest run; in the dry run (``out["smoke"]``) it is fatal, so rot shows on CPU."""
    try:
        return fn()
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if out["smoke"] or isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        import traceback

        traceback.print_exc()
        out["errors"][what] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return None
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()
