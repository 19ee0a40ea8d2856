"""The training policy: a Hugging Face causal LM, its per-token log-probs, and its precision.

Weights and optimizer state are always fp32 (the master copy); ``bf16`` and ``fp16``
training run the forward and backward passes under ``torch.autocast``, as mixed-precision
training does on GPUs, so the same code serves both (run here on CPU only; the CUDA
autocast path is the same calls and has not been run). fp16 needs dynamic loss scaling
(seed 000): :class:`LossScaler`. With ``fp32_lm_head`` the LM head and the softmax run in
fp32 even under autocast: the logits are where low precision costs the most.

The learner divides the logits by the rollout temperature before the softmax and applies
each row's top-k and top-p as vLLM's sampler does (:func:`truncation_mask`), so its
log-probs are of the same distribution vLLM reports as ``processed_logprobs``.
"""

from __future__ import annotations

import contextlib
import math

import torch

from learner.batch import Batch
from learner.loss import token_entropy
from learner.routing import recompute_contexts, routes_for

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
    toy model on a CPU), so it pays only over long runs; bench/learner.py measures it.
    Returns how many layers were compiled."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    return len(layers)


def autocast(dtype: str, device_type: str = "cpu"):
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[dtype])


# The log-prob of a token that top-k/top-p removed (probability 0). Finite, not -inf: the
# loss and the metrics multiply by the mask (-inf * 0 is nan), and any log-ratio clamp
# (``learner.log_ratio_clamp``) turns it into a weight/ratio of exp(-clamp) all the same.
OUTSIDE_LOGPROB = -1e4


@torch.no_grad()
def truncation_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """Which tokens each row's top-k and top-p keep: (N, T, V) bool, or None if no row truncates.

    ``scaled`` (N, T, V) are fp32 logits already divided by the temperature; ``top_k`` (N,)
    is off unless ``0 < k < V`` and ``top_p`` (N,) off unless ``p < 1``, as in vLLM. This is
    vLLM's sampler (``vllm/v1/sample/ops/topk_topp_sampler.py``, ``apply_top_k_top_p_pytorch``,
    the path its CPU engine takes), on the same values in the same order:

    1. temperature first (the caller's division), then top-k, then top-p;
    2. top-k keeps every token whose logit is >= the k-th largest, so **ties at the k-th
       value are all kept** (possibly more than k tokens). (vLLM's Triton kernel, which
       its GPU engines use, keeps exactly k there, the lowest ids first: the two differ
       only on bit-equal fp32 logits at the k-th place);
    3. top-p runs on the top-k survivors: their softmax sorted ascending, cumulative sum,
       a token is dropped where the cumsum is <= 1 - p (``1 - p`` in fp32), and the most
       likely token is always kept. **Ties at the top-p cut** may be split: equal
       probabilities are ordered by a stable sort (lower token id first, so dropped first,
       the higher ids kept). vLLM's CPU sort is not stable, so which of tokens with exactly
       equal probability straddling the cut it keeps is unspecified; that needs bit-equal
       fp32 logits, which real models do not produce.

    A row with top-p off is not top-p-filtered at all (vLLM, when another row of its batch
    uses top-p, also drops that row's tokens whose fp32 probability underflows to exactly 0:
    they can never be sampled, so no log-prob the learner is compared on differs).
    Computed without gradient, one row at a time (one sort of (T, V) at a time).
    """
    vocab = scaled.shape[-1]
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1
    rows = (k_on | p_on).nonzero().flatten().tolist()
    if not rows:
        return None
    keep = torch.ones(scaled.shape, dtype=torch.bool, device=scaled.device)
    for i in rows:
        x = scaled[i].detach()  # (T, V)
        k = int(top_k[i]) if k_on[i] else None
        if not p_on[i]:  # top-k only: no sort of the whole vocabulary
            keep[i] = x >= x.topk(k, dim=-1).values[:, -1:]
            continue
        x_sort, idx = x.sort(dim=-1, descending=False, stable=True)
        if k is not None:
            x_sort = x_sort.masked_fill(x_sort < x_sort[:, vocab - k:vocab - k + 1], -math.inf)
        cum = x_sort.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p[i].to(torch.float32)
        drop[:, -1] = False  # at least one
        drop |= x_sort == -math.inf
        keep[i] = torch.empty_like(drop).scatter_(-1, idx, ~drop)
    return keep


def response_start(batch: Batch) -> int:
    """The first position of ``batch``'s (N, T-1) tensors that any row's loss reads: the
    earliest response token's predecessor. Every position before it is prompt in every row."""
    cols = torch.nonzero(batch.mask.any(0))
    return int(cols[0]) if len(cols) else 0


def token_logprobs(model, batch: Batch, dtype: str = "fp32", fp32_lm_head: bool = False,
                   entropy_grad: bool = False, response_only: bool = True,
                   share_prompt: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the entropy of its distribution, both (N, T-1), fp32.

    ``model`` may be wrapped (DistributedDataParallel): its forward is what runs, so
    gradients are synchronised. Each row's logits are divided by the temperature it was
    sampled with and truncated to its top-k/top-p (:func:`truncation_mask`); the softmax
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

    ``use_cache=False``: a model whose config enables the KV cache (SmolLM2's, most real
    ones) would otherwise build one on every learner forward, for nothing, and under
    activation checkpointing the recomputed layers appended their keys to it a second time
    (a shape error: tests/test_activation_checkpointing.py, every family).
    """
    inner = getattr(model, "module", model)
    plain_only = batch.routes is not None or hasattr(model, "module") or (fp32_lm_head and dtype != "fp32")
    if share_prompt and not plain_only:
        return shared_prompt_logprobs(model, batch, dtype, entropy_grad)
    # routing replay: every forward of these rows through the rollout's experts; an MoE's routers
    # count their load over the rows' tokens either way (learner/routing.py)
    with routes_for(inner, batch.routes, batch.attention_mask):
        return _token_logprobs(model, inner, batch, dtype, fp32_lm_head, entropy_grad, response_only)


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
    if start:  # the prompt positions, which no loss or metric reads, as 0
        logp, entropy = (torch.nn.functional.pad(t, (start, 0)) for t in (logp, entropy))
    return logp, entropy


def _logp_entropy(logits: torch.Tensor, batch: Batch, rows: torch.Tensor, targets: torch.Tensor,
                  entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` and entropies from ``logits`` (R, L, V) of ``batch``'s ``rows``:
    each row's temperature, top-k and top-p applied as vLLM's sampler does, in fp32."""
    scaled = logits.float() / batch.temperature[rows, None, None]  # (R, L, V)
    keep = truncation_mask(scaled, batch.top_k[rows], batch.top_p[rows])
    if keep is None:  # no row truncated: the plain softmax over the vocabulary
        logp_all = torch.log_softmax(scaled, dim=-1)
    else:  # renormalised over each position's kept tokens; the others get OUTSIDE_LOGPROB
        logp_all = torch.log_softmax(scaled.masked_fill(~keep, -math.inf), dim=-1).masked_fill(~keep, OUTSIDE_LOGPROB)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    return logp, token_entropy(logp_all if entropy_grad else logp_all.detach())


def shared_prompt_logprobs(model, batch: Batch, dtype: str = "fp32",
                           entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
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
    logp = torch.zeros(n_rows, width - 1, device=device)
    entropy = torch.zeros(n_rows, width - 1, device=device)
    for g in torch.unique(batch.group_index).tolist():
        rows = torch.nonzero(batch.group_index == g).squeeze(1)
        plen = int(batch.prompt_len[rows[0]])
        end = int(batch.attention_mask[rows].sum(1).max())  # the group's longest row
        prompt = batch.input_ids[rows[:1], :plen]
        with autocast(dtype, device.type):
            with routes_for(model, None, torch.ones_like(prompt)):  # an MoE's load: the prompt's tokens once
                head = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
            cache = head.past_key_values
            cache.batch_repeat_interleave(len(rows))
            with routes_for(model, None, batch.attention_mask[rows, plen:end]):
                body = model(input_ids=batch.input_ids[rows, plen:end], attention_mask=batch.attention_mask[rows, :end],
                             past_key_values=cache, use_cache=True)
        logits = torch.cat([head.logits.expand(len(rows), -1, -1), body.logits[:, :-1]], dim=1)  # (n, end-plen, V)
        lp, ent = _logp_entropy(logits, batch, rows, batch.targets[rows, plen - 1:end - 1], entropy_grad)
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
