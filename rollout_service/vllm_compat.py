"""Workarounds for vLLM (CPU build 0.32.0) behaviour that hurts an RL rollout worker.

One documented function per problem. :func:`after_reload` applies the weight-update
fixes after every ``reload_weights``; each is harmless where the bug does not apply, and
the tests that compare a synced engine's log-probs with the learner's fail if one stops
working. :func:`before_engine_start` and :func:`check_engine_process` handle the engine
process itself.
"""

from __future__ import annotations

import os
import signal

import torch

from rlpipe.proc import set_parent_death_signal


def before_engine_start() -> None:
    """Run the model inside the EngineCore process (vLLM's ``uni`` executor).

    On CPU vLLM otherwise forces its multiprocess executor, whose worker process
    busy-polls a shared-memory queue (``sched_yield`` for 1 s after every message): under
    steady load it burns most of a core doing nothing, measured here at ~0.75 core per
    worker, which starves the learner on a small machine. ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
    keeps the ``uni`` executor; ``AsyncLLM`` still runs the engine core in its own process.
    Thread count and CPU affinity then come from ``OMP_NUM_THREADS`` and the process
    affinity (see rollout_service.server) instead of vLLM's OpenMP binding.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def quick_exit() -> bool:
    """Skip the garbage collector's last pass when the engine process exits.

    On a normal shutdown vLLM sends the EngineCore SIGTERM and force-kills it 5 s later.
    After its own shutdown ours sat in the interpreter's final collection (``gc_collect_main``
    in ``Py_FinalizeEx``, seen with ``py-spy dump --native``) for seconds, traversing every
    object the engine, transformers and the tokenizer made; a toy-moe worker was killed
    there at the 5 s limit. Every worker stop (the demo's, each test's) paid it. Freezing
    the heap at exit (``gc.freeze``: the objects move to the permanent generation, which no
    collection traverses) lets it exit at once; nothing is lost, as the process ends anyway
    and the memory goes with it (a toy demo's stop, from draining to exit: 6.5 s -> 4.5 s).
    Runs inside the engine process (via collective_rpc)."""
    import atexit
    import gc

    atexit.register(gc.freeze)
    return True


def lora_on_prepacked_int8() -> bool:
    """Let LoRA layers wrap an int8 linear whose weight the CPU kernel prepacked.

    On a CPU without AMX, vLLM's int8 kernel packs the weight into a oneDNN handle and sets
    ``layer.weight = None`` (model_executor/kernels/linear/scaled_mm/cpu.py), and the LoRA
    layer reads its device from that weight (lora/layers/utils.py ``_get_lora_device``):
    an int8 engine with ``enable_lora`` died at start. Such a layer lives on the CPU; every
    other layer keeps vLLM's answer. Must run in the engine process before the model is
    built (rollout_service/worker_ext.py does, on import). Measured in
    ../shared/feasibility/LORA_MOE_NOTES.md: nothing else in the LoRA path reads the weight."""
    try:
        from vllm.lora.layers import base_linear, utils
    except ImportError:  # no vLLM LoRA support in this build: nothing to fix
        return False
    original = getattr(utils._get_lora_device, "__wrapped__", utils._get_lora_device)

    def lora_device(base_layer):
        inner = getattr(base_layer, "routed_experts", base_layer)
        if getattr(inner, "weight", 0) is None:
            return torch.device("cpu")
        return original(base_layer)

    lora_device.__wrapped__ = original
    utils._get_lora_device = base_linear._get_lora_device = lora_device
    return True


def _per_adapter(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype) -> torch.Tensor:
    """``inputs[t] @ weights[indices[t]].T`` for every token ``t``, returned in ``dtype``: one
    matmul per adapter in the batch instead of one weight matrix copied out per token. The
    products are computed in fp32 whatever the engine's dtype: an adapter's matrices are thin
    (rank 8-64), so fp32 costs little where bf16 is native, and a CPU without native bf16
    (AVX2) runs a bf16 matmul through torch's slow path: there these products took 37% of an
    int8 SmolLM2 engine's time with a rank-8 adapter (py-spy). fp32 is also closer to the
    learner's own sums."""
    w = weights.squeeze(1) if weights.dim() == 4 else weights
    x = inputs.float()
    adapters = torch.unique(indices)
    if len(adapters) == 1:
        return (x @ w[int(adapters[0])].float().T).to(dtype)
    out = torch.empty(x.shape[0], w.shape[1], dtype=dtype, device=x.device)
    for a in adapters.tolist():
        rows = indices == a
        out[rows] = (x[rows] @ w[a].float().T).to(dtype)
    return out


def grouped_cpu_lora() -> bool:
    """vLLM's CPU LoRA kernels, grouped by adapter.

    The CPU build applies LoRA with torch ops (lora/ops/torch_ops/lora_ops.py) that gather
    each token's adapter matrix (``weights[indices]``, a (tokens, out, rank) copy per linear
    per layer) and einsum over it. At a real prompt's length that copy is the whole cost:
    SmolLM2 with a rank-8 adapter on every linear pushed 1 group in 10 minutes of an int8
    engine, every sample in ``bgmv_expand_slice``'s einsum (py-spy). Tokens of one adapter
    share one matrix, so one matmul per adapter in the batch computes the same sums. Same
    indexing as vLLM's (an index of -1 reads the last slot, as there). Must run in the engine
    process before it serves (rollout_service/worker_ext.py does, on import)."""
    try:
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return False

    def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
        outputs = _per_adapter(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
        common = min(outputs.shape[1], output_tensor.shape[1])  # the adapter and model may pad differently
        if add_inputs:
            output_tensor[:, :common] += outputs[:limit, :common]
        else:
            output_tensor[:, :common] = outputs[:limit, :common]

    def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        outputs = _per_adapter(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        output_tensor[:, : outputs.shape[1]] = scaling * outputs

    def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size,
                          add_inputs=True):
        outputs = _per_adapter(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        if add_inputs:
            output_tensor[:, slice_offset: slice_offset + slice_size] += outputs
        else:
            output_tensor[:, slice_offset: slice_offset + slice_size] = outputs

    for module in (lora_ops, punica_cpu):  # the sgmv ops call lora_ops' names; the wrapper its own
        module.bgmv_expand, module.bgmv_shrink, module.bgmv_expand_slice = bgmv_expand, bgmv_shrink, bgmv_expand_slice
    wrapper = punica_cpu.PunicaWrapperCPU
    if not hasattr(wrapper.add_lora_linear, "__wrapped__"):
        wrapper.add_lora_linear = _fused_decode(wrapper.add_lora_linear)
    return True


def _fused_decode(original):
    """``add_lora_linear`` for a batch whose tokens all use one adapter: every slice's shrink in one matmul and
    every slice's expand in another (the slices' A matrices stacked, their B matrices block-diagonal,
    made once per adapter version), instead of two small matmuls and their slicing per slice. At
    decode the per-call cost was the adapter's whole cost: py-spy put vLLM's per-slice path at about
    the int8 GEMMs' own time. Each output column still sums one slice's products in fp32, rounded
    once. vLLM's CPU engine marks its batches prefill whether or not they decode, so the per-token
    adapter indices decide: several adapters in a batch, tokens without one, or a caller's buffer
    take vLLM's path."""
    cache: dict = {}

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None, **kwargs):
        x2 = x.view(-1, x.shape[-1])
        indices = self.token_lora_indices[: x2.shape[0]]
        if getattr(self, "no_lora", False) or buffer is not None or len(indices) != x2.shape[0] or \
                tuple(w.shape[-2] for w in lora_b_stacked) != tuple(output_slices):
            return original(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer, **kwargs)
        adapters = torch.unique(indices)
        if len(adapters) != 1 or int(adapters[0]) < 0:  # several adapters, or tokens without one
            return original(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer, **kwargs)
        a, b = _stacked(cache, lora_a_stacked, lora_b_stacked, int(adapters[0]))
        y2 = y.view(-1, y.shape[-1])
        y2[:, : b.shape[1]] += ((x2.float() @ a) * scale @ b).to(y2.dtype)

    add_lora_linear.__wrapped__ = original
    return add_lora_linear


def _stacked(cache: dict, lora_a, lora_b, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(in, sum r) stacked A and (sum r, sum out) block-diagonal B of one adapter slot, fp32, kept
    until a weight of the slot changes (a new adapter version is copied into the same tensors)."""
    key = (id(lora_a[0]), slot)
    stamp = tuple(t._version for t in (*lora_a, *lora_b))
    hit = cache.get(key)
    if hit is None or hit[0] != stamp:
        squeeze = lambda w: (w.squeeze(1) if w.dim() == 4 else w)[slot].float()  # noqa: E731
        a = torch.cat([squeeze(w) for w in lora_a], dim=0).T.contiguous()
        b = torch.block_diag(*[squeeze(w) for w in lora_b]).T.contiguous()
        hit = cache[key] = (stamp, a, b)
    return hit[1], hit[2]


def die_with_parent() -> bool:
    """Make this (engine) process get SIGKILL when its parent, the API server, dies.

    vLLM's EngineCore does not notice a parent killed with SIGKILL and lives on as an
    orphan holding memory and cores. Runs inside the engine process (via collective_rpc).
    """
    return set_parent_death_signal(signal.SIGKILL)


def refresh_tied_lm_head(model: torch.nn.Module) -> bool:
    """Bug 1: with tied embeddings the CPU backend keeps a *prepacked copy* of the
    embedding for the LM-head GEMM. ``reload_weights`` updates ``embed_tokens.weight``
    but not that copy, so logits come from the old weights (off by up to ~3.8 on the toy
    model). Re-dispatching the LM head's CPU GEMM rebuilds the copy from the new weight.

    Returns True when a tied head was refreshed.
    """
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or not hasattr(lm_head, "weight"):
        return False
    if lm_head.weight.data_ptr() != embed.weight.data_ptr() or lm_head.weight.device.type != "cpu":
        return False
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
    return True


def keep_reloaded_kernel_tensors() -> bool:
    """Bug 2: reloading a compressed-tensors W8A8 INT8 model gives NaN log-probs. The
    layerwise reloader (``model_loader/reload/layerwise.py``) re-runs
    ``process_weights_after_loading``, which builds a new oneDNN handle pointing at the new
    weight and scale tensors, then copies them into the old parameters and drops the new
    ones: the handle is left pointing at freed memory. Keeping the newest tensors alive on
    the layer (until the next reload replaces them) keeps the handle valid; the reloaded
    engine then equals a fresh one started from the same tensors exactly (the int8 sync
    tests check this).

    Patches the reloader in this (engine) process, once; returns True when it is in place.
    """
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    if getattr(layerwise, "_rlpipe_keepalive", False):
        return True
    restore = layerwise._copy_and_restore_kernel_tensors

    def keep_then_restore(layer, info):
        layer._rlpipe_kernel_tensors = [getattr(layer, n) for n in get_layer_tensors(layer)]
        return restore(layer, info)

    layerwise._copy_and_restore_kernel_tensors = keep_then_restore
    layerwise._rlpipe_keepalive = True
    return layerwise._copy_and_restore_kernel_tensors is keep_then_restore


def reload_weights(model_runner, weights: list) -> None:
    """Load new weights into the running model as a fresh engine loads a checkpoint: in
    name order, under the model's dtype. Both matter for compressed-tensors INT8:

    *Order.* A fresh engine reads a single-file checkpoint in name order. Given the same
    tensors in another order (the sync's buckets, grouped by dtype), the layerwise reloader
    failed on the fused qkv layer of a static INT8 model with ``'Parameter' object has no
    attribute 'weight_loader'``; in name order it loads them.

    *Dtype* (bug 3): reloading a *static*-activation compressed-tensors INT8 engine corrupted the
    heap (``malloc(): unsorted double linked list corrupted``, a segfault or a hang at the
    next generate). The CPU int8 kernel builds its oneDNN handle with
    ``output_type=torch.get_default_dtype()`` (``kernels/linear/scaled_mm/cpu.py``). The
    first load runs under ``set_default_torch_dtype(model dtype)``, so the handle writes
    bf16; ``reload_weights`` has no such context, so the rebuilt static handle writes fp32
    into the bf16 output buffer the kernel allocates, twice its size. (Dynamic activations
    use an fp32 handle plus an epilogue and were unaffected.) Reloading under the model's
    dtype rebuilds the handle as the first load did; with :func:`keep_reloaded_kernel_tensors`
    a reloaded static engine equals a fresh one exactly.
    """
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_default_torch_dtype(model_runner.model_config.dtype):
        model_runner.reload_weights(weights_iterator=sorted(weights, key=lambda item: item[0]))


def rewind_cpu_generators(model_runner) -> bool:
    """Bug 4: a seeded request that is chunk-prefilled kills the engine on CPU
    (``RuntimeError: CPU Generator does not use offset``), and real prompts are long enough
    to be chunk-prefilled (the toy's never were).

    The model runner samples a token for every scheduled request, also for one whose prompt
    was only partly prefilled this step, then discards that token and undoes the draw on its
    seeded generator so the request's samples do not depend on how its prompt was chunked:
    ``gen.set_offset(gen.get_offset() - 4)`` in ``_bookkeeping_sync``, which is CUDA's
    Philox counter. A CPU generator (a Mersenne Twister) has no offset, so the call raises.
    On CPU the same undo is exact with the generator's state: it is saved before sampling
    for each discarded request and put back after, and ``_bookkeeping_sync`` then sees no
    CPU generator to rewind. So a seed still gives the same samples however the prompt was
    chunked (tests/test_worker.py checks that on the real engine).

    Patches this (engine) process's model runner, once; returns True when it is in place.
    """
    import numpy as np

    if getattr(model_runner, "_rlpipe_rewinds", False):
        return True
    sample, bookkeeping = model_runner._sample, model_runner._bookkeeping_sync

    def cpu_generators(batch) -> dict:
        return {i: g for i, g in batch.generators.items() if g.device.type == "cpu"}

    def sample_then_undo_discarded(*args, **kwargs):
        batch = model_runner.input_batch
        discarded = np.nonzero(model_runner.discard_request_mask.np[:batch.num_reqs])[0]
        cpu = cpu_generators(batch)
        saved = {int(i): cpu[int(i)].get_state() for i in discarded if int(i) in cpu}
        out = sample(*args, **kwargs)
        for i, state in saved.items():
            cpu[i].set_state(state)
        return out

    def bookkeeping_without_cpu_rewind(*args, **kwargs):
        batch = model_runner.input_batch
        generators = batch.generators
        batch.generators = {i: g for i, g in generators.items() if g.device.type != "cpu"}
        try:
            return bookkeeping(*args, **kwargs)
        finally:
            batch.generators = generators

    model_runner._sample = sample_then_undo_discarded
    model_runner._bookkeeping_sync = bookkeeping_without_cpu_rewind
    model_runner._rlpipe_rewinds = True
    return True


def repack_cpu_experts(model: torch.nn.Module) -> bool:
    """Bug 5: on CPU an MoE layer's experts run from weights prepacked into the CPU kernel's
    grouped-GEMM layout, packed once, when the kernel is set up at the first load
    (``UnquantizedFusedMoEMethod._setup_kernel``: a weight update only copies the new
    tensors in). ``reload_weights`` thus leaves the new experts' weights unpacked where the
    kernel reads packed ones: measured 0.1 off in log-prob on a tiny Qwen3-MoE. Re-running
    the kernel's own ``process_weights_after_loading`` packs the new weights as a fresh
    engine does (tests/test_architectures.py ``qwen3_moe`` checks the log-probs).

    Returns True when an MoE layer's experts were repacked."""
    repacked = False
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and layer.w13_weight.device.type == "cpu" and \
                hasattr(experts, "process_weights_after_loading"):
            experts.process_weights_after_loading(layer)
            repacked = True
    return repacked


def moe_routers(model: torch.nn.Module) -> list:
    """Gap 6: vLLM's own ``enable_return_routed_experts`` is refused on this CPU build (it
    needs Model Runner V2, which needs Triton with a CPU backend: vllm/config/vllm.py). The
    default V1 runner still calls every MoE layer's router capture hook
    (``BaseRouter.set_capture_fn``, fused_moe/router/base_router.py) with the logical
    ``topk_ids`` [tokens, top_k] before any EPLB mapping, the hook vLLM's own capturer binds
    (fused_moe/routed_experts_capturer.py); rollout_service/routes.py binds its own there.

    Returns the routers in layer order ([] for a model without MoE layers). Raises when a
    layer's kernel is monolithic: it routes inside the kernel and never calls the router, so
    its routes could not be recorded."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runners = sorted((m for m in model.modules() if isinstance(m, MoERunner)), key=lambda m: m.layer_id)
    if mono := [m.layer_name for m in runners if m.is_monolithic]:
        raise RuntimeError(f"routing replay: the MoE layers {mono} run a monolithic kernel that never calls "
                           "the router, so their experts cannot be recorded")
    return [m.router for m in runners]


def native_routes() -> bool:
    """Whether vLLM records routing replay's routes itself: ``enable_return_routed_experts``
    (its V2 model runner, on CUDA), read from each finished ``CompletionOutput.routed_experts``,
    [P + L - 1, MoE layers, top_k] (distributed/aux_output_connector/connector.py
    ``take_output``: rows up to ``num_tokens - 1``). False on this CPU build, whose V2 runner
    needs Triton: there :func:`moe_routers`' capture hook records them. The GPU path is a thin
    layer over vLLM's own capture, and no test here runs it (no GPU): the rows it hands over
    pass the same check as the hook's (rollout_service/routes.py ``checked``)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    return current_platform.is_cuda() and "enable_return_routed_experts" in EngineArgs.__dataclass_fields__


def after_reload(model: torch.nn.Module) -> dict[str, bool]:
    """Apply every post-reload workaround; returns which ones acted."""
    return {"tied_lm_head": refresh_tied_lm_head(model), "moe_experts": repack_cpu_experts(model)}
