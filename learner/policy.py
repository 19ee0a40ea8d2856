"""The training policy: a Hugging Face causal LM, its per-token log-probs, and its precision.

Weights and optimizer state are always fp32 (the master copy); ``bf16`` and ``fp16``
training run the forward and backward passes under ``torch.autocast``, as mixed-precision
training does on GPUs, so the same code serves both (run here on CPU only; the CUDA
autocast path is the same calls and has not been run). fp16 needs dynamic loss scaling
(seed 000): :class:`LossScaler`. With ``fp32_lm_head`` the LM head and the softmax run in
fp32 even under autocast: the logits are where low precision costs the most.

The learner divides the logits by the rollout temperature before the softmax and applies
each row's top-k and top-p as vLLM's sampler does (:func:`learner.truncation.truncation_mask`), so its
log-probs are of the same distribution vLLM reports as ``processed_logprobs``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from learner.batch import Batch
from learner.head import chunkable_head, head_logprobs
from learner.loss import token_entropy
from learner.routing import recompute_contexts, routes_for
from learner.truncation import truncated_log_softmax

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_policy(path: str):
    """The model in fp32 (the master weights whatever the training precision)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    return model


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's stack of decoder layers, found by the block class Hugging Face says must not
    be split (``_no_split_modules``: ``LlamaDecoderLayer``, ``GPTNeoXLayer``, ...), not by a
    path: Llama-style models keep it at ``model.layers``, GPT-NeoX at ``gpt_neox.layers``,
    others elsewhere. A model that names no block class: its longest ModuleList."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    longest = None
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module):
            if type(module[0]).__name__ in blocks:
                return module
            if longest is None or len(module) > len(longest):
                longest = module
    if longest is None:
        raise ValueError(f"{type(model).__name__}: no stack of decoder layers found")
    return longest


def enable_activation_checkpointing(model) -> int:
    """Recompute each decoder layer's activations in the backward pass instead of keeping
    them (``torch.utils.checkpoint``, non-reentrant): activation memory of one layer
    instead of all, for one more forward pass. Wraps each layer's ``forward`` in place, so
    parameter names (checkpoints, weight sync) stay as they are; transformers' own
    ``gradient_checkpointing_enable`` only acts in training mode, and the learner runs in
    eval mode (no dropout). Returns how many layers were wrapped."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    def checkpointed(forward, *args, **kwargs):
        if not torch.is_grad_enabled():  # pi_old and other no-grad passes: nothing to save
            return forward(*args, **kwargs)
        # an MoE's routers recompute with the forward's routes (learner/routing.py recompute_contexts)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=partial(recompute_contexts, model),
                          **kwargs)

    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = partial(checkpointed, layer.forward)
    return len(layers)


def compile_layers(model) -> int:
    """``torch.compile`` each decoder layer (``learner.compile``), as FSDP2 expects: one graph
    per layer type, reused by every layer, with dynamic sequence lengths after the second
    shape it sees. Each new shape early in a run costs a compile (tens of seconds for the
    toy model on a CPU), so it pays only over long runs; bench/learner_speed.py measures it.
    Returns how many layers were compiled."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    return len(layers)


def autocast(dtype: str, device_type: str = "cpu"):
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[dtype])


def response_start(batch: Batch) -> int:
    """The first position of ``batch``'s (N, T-1) tensors that any row's loss reads: the
    earliest response token's predecessor. Every position before it is prompt in every row."""
    cols = torch.nonzero(batch.mask.any(0))
    return int(cols[0]) if len(cols) else 0


def token_logprobs(model, batch: Batch, dtype: str = "fp32", fp32_lm_head: bool = False,
                   entropy_grad: bool = False, response_only: bool = True,
                   share_prompt: bool = False, head_chunk: int = 0, with_topk: bool = False) -> tuple:
    """Log-prob of each target token and the entropy of its distribution, both (N, T-1), fp32.

    ``model`` may be wrapped (DistributedDataParallel): its forward is what runs, so
    gradients are synchronised. Each row's logits are divided by the temperature it was
    sampled with and truncated to its top-k/top-p (:func:`learner.truncation.truncation_mask`); the softmax
    runs in fp32 whatever the compute precision. With truncation, the log-probs are
    renormalised over the kept tokens and a token outside them (probability 0; e.g. a
    token sampled by an older policy) gets ``OUTSIDE_LOGPROB``, finite so that masked
    sums stay nan-free, and far below any log-ratio clamp.

    ``response_only``: the LM head, the softmax and the entropy run only from the first
    response position on (:func:`response_start`; the model's ``logits_to_keep``, so a
    DDP or FSDP wrapper still sees the whole forward). The prompt is most of a real
    model's tokens and its 49k-way head rows were computed only to be masked out; the
    positions left out come back as 0, as every masked position reads.

    ``share_prompt``: each group's prompt goes forward once for its rows (:func:`shared_prompt_logprobs`),
    on an unwrapped model without ``fp32_lm_head``; elsewhere the plain path runs. A batch with
    ``routes`` (routing replay, learner/routing.py) takes the plain path, its routes laid out
    as its rows.

    The entropy is of the full (truncated) distribution, in fp32; it carries a gradient only
    with ``entropy_grad`` (``learner.entropy_coef`` > 0), else nothing of it outlives the
    call (learner/loss.py token_entropy keeps no (N, T, V) copy of its own either way).

    ``head_chunk`` > 0: the head, softmax and entropy run ``head_chunk`` positions at a time
    on the positions a loss can read (learner/head.py), never holding the (N, T, V) logits; a
    head it cannot take (an adapted or sharded one) keeps the plain path. Padding reads 0 then.

    ``use_cache=False``: a model whose config enables the KV cache (SmolLM2's, most real
    ones) would otherwise build one on every learner forward, for nothing, and under
    activation checkpointing the recomputed layers appended their keys to it a second time
    (a shape error: tests/test_activation_checkpointing.py, every family).

    ``with_topk`` (score centering): a third tensor (N, T-1, K), the log-probs at the batch's
    ``sampler_topk_ids``, from the same distributions (and the same gradients) as the targets'.
    """
    if with_topk:  # the targets become (N, T-1, 1 + K): the sampled token, then the sampler's top-k
        ids = torch.cat([batch.targets[..., None], batch.sampler_topk_ids], dim=-1)
        logp, entropy = token_logprobs(model, dataclasses.replace(batch, targets=ids), dtype, fp32_lm_head,
                                       entropy_grad, response_only, share_prompt, head_chunk)
        return logp[..., 0], entropy, logp[..., 1:]
    inner = getattr(model, "module", model)
    plain_only = batch.routes is not None or hasattr(model, "module") or (fp32_lm_head and dtype != "fp32")
    if share_prompt and not plain_only:
        return shared_prompt_logprobs(model, batch, dtype, entropy_grad, head_chunk)
    # routing replay: every forward of these rows through the rollout's experts; an MoE's routers
    # count their load over the rows' tokens either way (learner/routing.py)
    with routes_for(inner, batch.routes, batch.attention_mask):
        if head_chunk and chunkable_head(inner) is not None:
            return _chunked_logprobs(model, inner, batch, dtype, fp32_lm_head, entropy_grad, response_only, head_chunk)
        return _token_logprobs(model, inner, batch, dtype, fp32_lm_head, entropy_grad, response_only)


def _head_at(inner, hidden: torch.Tensor, valid: torch.Tensor, batch: Batch, rows: torch.Tensor,
             targets: torch.Tensor, dtype: str, fp32_lm_head: bool, entropy_grad: bool,
             head_chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies (R, L) of ``targets`` from the final hidden states ``hidden`` (R, L, H)
    of ``batch``'s ``rows``, computed by the chunked head (learner/head.py) at the ``valid`` (R, L)
    positions only; the others read 0."""
    r, c = valid.nonzero(as_tuple=True)
    at = rows[r]
    head_dtype = torch.float32 if fp32_lm_head or dtype == "fp32" else DTYPES[dtype]
    lp, ent = head_logprobs(hidden[r, c], chunkable_head(inner), targets[r, c], batch.temperature[at],
                            batch.top_k[at], batch.top_p[at], head_dtype, head_chunk, entropy_grad)
    zeros = hidden.new_zeros(valid.shape, dtype=torch.float32)
    return zeros.new_zeros(targets.shape).index_put((r, c), lp), zeros.index_put((r, c), ent)


def _chunked_logprobs(model, inner, batch: Batch, dtype: str, fp32_lm_head: bool, entropy_grad: bool,
                      response_only: bool, head_chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs`' plain path with the chunked head: the whole forward through ``model``
    (a DDP wrapper sees it; its head runs for one position, thrown away), the head from its final
    hidden states on the positions from the first response position whose target is a real token."""
    start = response_start(batch) if response_only else 0
    with autocast(dtype, batch.input_ids.device.type):
        hidden = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                       output_hidden_states=True, logits_to_keep=1).hidden_states[-1][:, start:-1]
    valid = batch.attention_mask[:, start + 1:].bool()
    rows = torch.arange(len(batch.input_ids), device=batch.input_ids.device)
    logp, entropy = _head_at(inner, hidden, valid, batch, rows, batch.targets[:, start:], dtype, fp32_lm_head,
                             entropy_grad, head_chunk)
    return _from_start(logp, start), _from_start(entropy, start)


def _token_logprobs(model, inner, batch: Batch, dtype: str, fp32_lm_head: bool, entropy_grad: bool,
                    response_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs`' plain path: the whole rows in one forward."""
    device_type = batch.input_ids.device.type
    start = response_start(batch) if response_only else 0
    width = batch.input_ids.shape[1]
    with autocast(dtype, device_type):
        if fp32_lm_head and dtype != "fp32":
            # The whole forward still goes through ``model`` (DDP must see it); only the
            # last position's logits are computed there, and thrown away.
            hidden = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                           output_hidden_states=True, logits_to_keep=1).hidden_states[-1]
            with torch.autocast(device_type=device_type, enabled=False):
                logits = inner.get_output_embeddings()(hidden[:, start:-1].float())
        else:
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           use_cache=False, logits_to_keep=width - start).logits[:, :-1]
    rows = torch.arange(len(batch.input_ids), device=batch.input_ids.device)
    logp, entropy = _logp_entropy(logits, batch, rows, batch.targets[:, start:], entropy_grad)
    return _from_start(logp, start), _from_start(entropy, start)


def _from_start(t: torch.Tensor, start: int) -> torch.Tensor:
    """``t`` (N, L, ...) from position ``start`` on, as (N, start + L, ...): the prompt positions
    before it, which no loss or metric reads, as 0."""
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (start, 0)) if start else t


def _logp_entropy(logits: torch.Tensor, batch: Batch, rows: torch.Tensor, targets: torch.Tensor,
                  entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` (R, L), or (R, L, J) for J tokens a position, and entropies (R, L)
    from ``logits`` (R, L, V) of ``batch``'s ``rows``: each row's temperature, top-k and top-p applied
    as vLLM's sampler does, in fp32."""
    scaled = logits.float() / batch.temperature[rows, None, None]  # (R, L, V)
    logp_all, _ = truncated_log_softmax(scaled, batch.top_k[rows], batch.top_p[rows])
    logp = logp_all.gather(-1, targets if targets.dim() == 3 else targets[..., None])
    logp = logp if targets.dim() == 3 else logp.squeeze(-1)
    return logp, token_entropy(logp_all if entropy_grad else logp_all.detach())


def shared_prompt_logprobs(model, batch: Batch, dtype: str = "fp32", entropy_grad: bool = False,
                           head_chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs` with each group's prompt computed once for its n rows.

    A group's rows share the prompt (collate: prompt + sample), and on a real chat task the
    prompt is most of a row: recomputing it n times was most of the learner's work. Here the
    prompt goes forward once, its KV cache is repeated for the rows, and the responses go
    forward on it; gradients flow back through the cache into the prompt's forward, so the
    loss and its gradient are those of the plain path (tests/test_learner.py checks both).
    The prompt's last position predicts the first response token. Needs a model whose
    forward takes ``past_key_values`` (every transformers decoder); not under a DDP or FSDP
    wrapper, which sees one forward per backward.
    """
    n_rows, width = batch.input_ids.shape
    device = batch.input_ids.device
    logp = torch.zeros(batch.targets.shape, device=device)  # (N, T-1), or (N, T-1, J) with J tokens a position
    entropy = torch.zeros(n_rows, width - 1, device=device)
    for g in torch.unique(batch.group_index).tolist():
        rows = torch.nonzero(batch.group_index == g).squeeze(1)
        plen = int(batch.prompt_len[rows[0]])
        end = int(batch.attention_mask[rows].sum(1).max())  # the group's longest row
        prompt = batch.input_ids[rows[:1], :plen]
        chunked = head_chunk > 0 and chunkable_head(model) is not None
        with autocast(dtype, device.type):
            with routes_for(model, None, torch.ones_like(prompt)):  # an MoE's load: the prompt's tokens once
                head = model(input_ids=prompt, use_cache=True, logits_to_keep=1, output_hidden_states=chunked)
            cache = head.past_key_values
            cache.batch_repeat_interleave(len(rows))
            with routes_for(model, None, batch.attention_mask[rows, plen:end]):
                body = model(input_ids=batch.input_ids[rows, plen:end], attention_mask=batch.attention_mask[rows, :end],
                             past_key_values=cache, use_cache=True, output_hidden_states=chunked,
                             logits_to_keep=1 if chunked else 0)
        targets = batch.targets[rows, plen - 1:end - 1]
        if chunked:  # (n, end-plen, H): the prompt's last position, then the body's
            hidden = torch.cat([head.hidden_states[-1][:, -1:].expand(len(rows), -1, -1),
                                body.hidden_states[-1][:, :-1]], dim=1)
            lp, ent = _head_at(model, hidden, batch.attention_mask[rows, plen:end].bool(), batch, rows, targets,
                               dtype, False, entropy_grad, head_chunk)
        else:
            logits = torch.cat([head.logits.expand(len(rows), -1, -1), body.logits[:, :-1]], dim=1)  # (n, end-plen, V)
            lp, ent = _logp_entropy(logits, batch, rows, targets, entropy_grad)
        logp[rows, plen - 1:end - 1] = lp
        entropy[rows, plen - 1:end - 1] = ent
    return logp, entropy


class LossScaler:
    """Dynamic loss scaling for fp16 (seed 000): scale the loss so small gradients survive
    fp16, skip any step whose gradients overflowed, halve the scale then, and double it
    after ``growth_interval`` clean steps. Disabled (scale 1, never skips on its own)
    for fp32 and bf16, whose exponent range needs none.

    Wraps ``torch.amp.GradScaler`` and adds what the learner reports: the scale and how
    many steps were skipped. In every precision a step whose gradient norm is not finite
    is skipped rather than allowed to write nan into the weights.
    """

    def __init__(self, dtype: str, init_scale: float = 2.0**16, device_type: str = "cpu", growth_interval: int = 200):
        self.enabled = dtype == "fp16"
        self.scaler = torch.amp.GradScaler(device_type, init_scale=init_scale, growth_interval=growth_interval,
                                           enabled=self.enabled)
        self.skipped_steps = 0

    @property
    def scale(self) -> float:
        return float(self.scaler.get_scale()) if self.enabled else 1.0

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, optimizer, params, grad_clip: float) -> tuple[float, bool]:
        """Unscale, clip and step; returns (gradient norm before clipping, whether the step was skipped)."""
        self.scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)  # FSDP: a DTensor
        if self.enabled:
            before = self.scale
            self.scaler.step(optimizer)  # skips the step if unscale_ found inf/nan
            self.scaler.update()
            skipped = self.scale < before
        else:
            skipped = not math.isfinite(grad_norm)
            if not skipped:
                optimizer.step()
        self.skipped_steps += skipped
        return grad_norm, skipped

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)
