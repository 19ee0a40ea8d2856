"""The LM head, softmax, log-prob and entropy in chunks of positions, never the (N, T, V) logits.

A 135M-parameter model with a 49,152-way vocabulary spends most of a learner forward's memory on
its logits: every response position's fp32 row of 49k values, then its temperature-scaled copy, its
log-softmax and their gradients, four or more (N, T, V) tensors where the loss reads two numbers a
position (the target's log-prob and the entropy). This computes those two numbers for the positions
some loss can read (not the padding, not the prompt), ``chunk`` positions at a time, and its backward
recomputes each chunk's logits instead of keeping them: the memory of one chunk's logits, whatever the
batch. The arithmetic is :func:`learner.policy._logp_entropy`'s (temperature, vLLM's top-k/top-p,
the softmax in fp32, ``OUTSIDE_LOGPROB`` for a token outside the kept set), and the head's matmul
runs in the compute dtype as autocast would run it; tests/test_head.py checks values and gradients
against the plain path.
"""

from __future__ import annotations

import torch

from learner.truncation import truncated_log_softmax


def chunkable_head(module) -> torch.nn.Parameter | None:
    """The output head's weight when it is a plain bias-free ``nn.Linear`` on a local tensor (the
    chunked path's matmul); None for an adapted head, a bias, or an FSDP-sharded (DTensor) weight,
    which keep the plain path."""
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    weight = head.weight
    return None if type(weight.data) is not torch.Tensor else weight


def _chunk_logp(h, w, targets, scale, top_k, top_p):
    """One chunk's masked log-softmax (C, V), in fp32, and whether each target is kept (C, J)."""
    z = (h.to(w.dtype) @ w.T).float() * scale[:, None]
    logp, keep = truncated_log_softmax(z[:, None, :], top_k, top_p)  # each position its own "row"
    if keep is None:
        return logp[:, 0], None
    return logp[:, 0], keep[:, 0].gather(-1, targets)


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, scale, top_k, top_p, dtype, chunk, entropy_grad):
        w = weight.detach().to(dtype)
        logp = hidden.new_empty(targets.shape, dtype=torch.float32)  # (M, J)
        entropy = hidden.new_empty(len(hidden), dtype=torch.float32)
        for s in range(0, len(hidden), chunk):
            sl = slice(s, s + chunk)
            lp_all, _ = _chunk_logp(hidden[sl].detach(), w, targets[sl], scale[sl], top_k[sl], top_p[sl])
            logp[sl] = lp_all.gather(-1, targets[sl])
            entropy[sl] = -(lp_all.exp() * lp_all).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, scale, top_k, top_p, entropy)
        ctx.dtype, ctx.chunk, ctx.entropy_grad = dtype, chunk, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, targets, scale, top_k, top_p, entropy = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = weight.detach().to(ctx.dtype)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        for s in range(0, len(hidden), ctx.chunk):
            sl = slice(s, s + ctx.chunk)
            h = hidden[sl].detach()
            lp_all, kept = _chunk_logp(h, w, targets[sl], scale[sl], top_k[sl], top_p[sl])
            p = lp_all.exp()  # 0 outside the kept set
            g = g_logp[sl] if kept is None else g_logp[sl] * kept  # (C, J): a target outside the kept set is constant
            gz = -p * g.sum(-1, keepdim=True)
            gz.scatter_add_(-1, targets[sl], g)
            if ctx.entropy_grad and g_entropy is not None:
                gz -= g_entropy[sl, None] * p * (lp_all + entropy[sl, None])
            gz *= scale[sl, None]
            gz = gz.to(ctx.dtype)
            if want_h:
                grad_h[sl] = (gz @ w).to(hidden.dtype)
            if want_w and ctx.dtype == torch.float32:
                grad_w.addmm_(gz.T, h)  # in place: no (V, H) temporary beside the gradient
            elif want_w:
                grad_w += (gz.T @ h.to(ctx.dtype)).float()
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None, None


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor,
                  top_k: torch.Tensor, top_p: torch.Tensor, dtype: torch.dtype, chunk: int,
                  entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target and its distribution's entropy, both (M,) fp32, from ``hidden``
    (M, H) and the head ``weight`` (V, H), each position with its own temperature, top-k and top-p
    (M,). The entropy carries a gradient only with ``entropy_grad``. ``targets`` (M, J): J tokens'
    log-probs a position, (M, J) (the sampled token and the sampler's top-k, score centering)."""
    flat = targets.dim() == 1
    logp, entropy = _ChunkedHead.apply(hidden, weight, targets[:, None] if flat else targets,
                                       1.0 / temperature.float(), top_k, top_p, dtype, max(1, chunk), entropy_grad)
    return (logp[:, 0] if flat else logp), entropy
