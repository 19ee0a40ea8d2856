"""Data-parallel learner ranks under ``torchrun`` (FSDP2 or DDP; gloo on CPU, NCCL on CUDA).

Rank 0 is the only one that talks to Redis, the workers and the disk; it hands every
rank the whole batch, and each rank trains on its share of the rows (row r of every
minibatch goes to rank r mod world). Loss denominators come from the whole minibatch,
so the averaged gradient equals the single-process one. Per-row results that the
metrics need (pi_old, entropy) are put back together with one all-reduce, as each
rank fills only its own rows.

``learner.parallel``:

- ``fsdp`` (the default with more than one rank): ``fully_shard`` on every decoder layer
  (and first on its mixture-of-experts block, if it has one) and on the model, so each
  rank holds 1/world of the weights, gradients and Adam state; parameters are all-gathered
  in the training dtype (bf16/fp16, or fp32) for each layer's (and block's) forward and
  backward, and gradients reduce-scattered in fp32. With ``fp32_lm_head`` the
  model's own parameters (embeddings, final norm, head) stay fp32 when gathered.
- ``ddp``: every rank holds the whole model; gradients are all-reduced.

Under FSDP, whatever needs whole tensors outside a training step (weight sync, a
checkpoint) is a collective: rank 0 sends a :class:`Command` that the other ranks,
waiting for their next step in :meth:`Ranks.exchange`, carry out beside it. Weight
sync gathers one bucket's parameters at a time (weight_sync/sender.py), so no rank
ever holds the whole model for it. A sharded checkpoint (learner/checkpoint.py) gathers
only the weights; each rank writes its own optimizer shard, over a process group of
their own (:attr:`Ranks.checkpoint_group`) as the writes run in the background.

Without ``WORLD_SIZE`` in the environment (a plain ``rlpipe learner``) every method here
is a no-op. Tested on CPU only (2 gloo ranks, tests/test_ddp.py, tests/test_fsdp.py); the
NCCL branch is the same calls with CUDA devices and has not been run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from learner.policy import DTYPES, decoder_layers
from learner.routing import moe_blocks
from weight_sync.names import served_pieces

# Ranks other than 0 wait in a broadcast while rank 0 waits for rollouts: a long wait is normal.
IDLE_TIMEOUT = timedelta(hours=6)


@dataclass(frozen=True)
class Command:
    """What rank 0 asks every other rank to do beside it: ``handlers[name](*args)``."""

    name: str
    args: tuple = ()


@dataclass(frozen=True)
class _Slot:
    """Where a tensor was in what :meth:`Ranks.share` sends: its place in the broadcasts, and its shape."""

    index: int
    shape: tuple
    dtype: torch.dtype


def _walk(obj, f):
    """``obj`` with ``f`` applied to each item of its dicts, lists and tuples (others as they are)."""
    if isinstance(obj, dict):
        return {k: f(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(f(v) for v in obj)
    return obj


def full(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor (DTensor) gathered whole on every rank (a collective); others as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class Ranks:
    def __init__(self, parallel: str = "auto"):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.sharded = self.world > 1 and parallel in ("auto", "fsdp")
        self.parallel = "fsdp" if self.sharded else "ddp" if self.world > 1 else "none"
        self.released = False  # rank 0 has let the other ranks go (see release)
        if self.world > 1 and not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, timeout=IDLE_TIMEOUT)
        # Sharded checkpoints' collectives (learner/checkpoint.py save_shards) run in each rank's
        # background writer while the next steps train: a group of their own keeps them from
        # interleaving with the training's, and gloo carries the host-memory copies they write.
        self.checkpoint_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if self.world > 1 else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")

    def wrap(self, model: torch.nn.Module, dtype: str = "fp32", fp32_lm_head: bool = False) -> torch.nn.Module:
        """The module to train: ``model`` itself (one rank; or sharded in place under FSDP,
        its parameters becoming DTensors with the same names), or a DDP wrapper."""
        if self.world == 1:
            return model
        if not self.sharded:
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(model, device_ids=[self.local_rank] if torch.cuda.is_available() else None)
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        gathered = None if dtype == "fp32" else DTYPES[dtype]
        layers = MixedPrecisionPolicy(param_dtype=gathered, reduce_dtype=torch.float32)
        for layer in decoder_layers(model):
            for block in moe_blocks(layer):  # an MoE block (most of its layer's weights) is gathered
                fully_shard(block, mp_policy=layers)  # for its own forward only, apart from the attention's
            fully_shard(layer, mp_policy=layers)
        # The model's own parameters (embeddings, final norm, LM head); gathered in fp32 when
        # the head must run in fp32 (learner/policy.py token_logprobs calls it directly).
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=None if fp32_lm_head else gathered,
                                                          reduce_dtype=torch.float32))
        return model

    def no_sync(self, model: torch.nn.Module, sync: bool):
        """Gradient accumulation: backward passes inside skip the all-reduce (DDP) or the
        reduce-scatter (FSDP), except the one with ``sync`` (the last micro-batch's)."""
        if self.sharded:
            model.set_requires_gradient_sync(sync)
            return contextlib.nullcontext()
        if sync or not hasattr(model, "no_sync"):
            return contextlib.nullcontext()
        return model.no_sync()

    # -- rank 0 leads, the others follow ------------------------------------------------------
    def exchange(self, work, handlers: dict):
        """Rank 0: hand ``work`` to every rank. The others: carry out rank 0's commands
        (:meth:`command`) until its work comes, and return it (None: released, stop)."""
        if self.world == 1:
            return work
        if self.is_main:
            return self.broadcast(work)
        while True:
            message = self.broadcast(None)
            if isinstance(message, Command):
                handlers[message.name](*message.args)
                continue
            self.released = message is None
            return message

    def command(self, name: str, *args) -> None:
        """Rank 0: have every other rank (waiting in :meth:`exchange`) run ``handlers[name](*args)``
        now, beside rank 0 doing the same: the collectives of a sharded model outside a step."""
        if self.world > 1:
            self.broadcast(Command(name, args))

    def release(self, handlers: dict) -> None:
        """The end of the run. Rank 0 lets the others go; they serve its commands until it does
        (its last checkpoint may still gather the model)."""
        if self.world == 1 or self.released:
            return
        if self.is_main:
            self.broadcast(None)
            self.released = True
        elif self.exchange(None, handlers) is not None:
            raise RuntimeError("rank 0 sent a step after the run ended")

    def full_tensors(self, model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
        """The named parameters of ``model`` (by their served names), whole (every rank must ask for
        the same names). A fused parameter (an MoE layer's experts) is gathered once for all
        of its slices among ``names``, then sliced. A name that is a parameter's own (a LoRA
        adapter's, which no checkpoint serves) is gathered as it is."""
        pieces, params = served_pieces(model), dict(model.named_parameters())
        own = [n for n in names if n not in pieces and n in params]
        served = [n for n in names if n not in own]
        whole = {pieces[n].param: None for n in served}
        whole = {p: full(params[p].detach()) for p in whole}
        return {**{n: pieces[n].of(whole[pieces[n].param]) for n in served},
                **{n: full(params[n].detach()) for n in own}}

    @torch.no_grad()
    def probe(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """A forward of ``model`` outside a training step, which int8's monitors watch through
        hooks (quant/monitor.py). Under FSDP every rank runs it (each layer gathers its
        shards), and after it the model's own parameters, which FSDP keeps gathered after a
        forward for the backward that follows in training, are sharded again."""
        model(input_ids.to(self.device), attention_mask=attention_mask.to(self.device))
        if self.sharded:
            model.reshard()

    def max(self, value: int) -> int:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def share(self, obj):
        """Rank 0's ``obj`` (tensors in dicts, lists and tuples) on every rank, for what rank 0
        alone read from disk (a checkpoint's trainer and optimizer state across nodes,
        learner/checkpointer.py): its structure pickled by :meth:`broadcast`, each tensor by
        ``dist.broadcast`` on this rank's device (NCCL's on GPUs, never pickled whole), one at
        a time, received into host memory as rank 0 holds it."""
        if self.world == 1:
            return obj
        tensors: list[torch.Tensor] = []

        def strip(o):
            if isinstance(o, torch.Tensor):
                tensors.append(o)
                return _Slot(len(tensors) - 1, tuple(o.shape), o.dtype)
            return _walk(o, strip)

        def fill(o):
            if not isinstance(o, _Slot):
                return _walk(o, fill)
            if self.is_main:
                dist.broadcast(tensors[o.index].to(self.device).contiguous(), src=0)
                return tensors[o.index]
            t = torch.empty(o.shape, dtype=o.dtype, device=self.device)
            dist.broadcast(t, src=0)
            return t.cpu()

        return fill(self.broadcast(strip(obj) if self.is_main else None))

    def mine(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[self.rank :: self.world]

    def share_rows(self, local: torch.Tensor, rows: torch.Tensor, n_rows: int) -> torch.Tensor:
        """Every rank's per-row results, ``local`` holding this rank's ``rows``, as one (n_rows, ...) tensor."""
        full = torch.zeros((n_rows, *local.shape[1:]), dtype=local.dtype, device=local.device)
        full[rows] = local
        if self.world > 1:
            dist.all_reduce(full)
        return full

    def sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def exit_rank(code: int) -> None:
    """A torchrun rank's exit, once everything is durable and its process group destroyed:
    without the interpreter's finalization. There gloo's worker threads may still hold
    tensors whose destruction needs the GIL being torn down, and the process aborts
    ("terminate called without an active exception", SIGABRT; pytorch#190489, #179291),
    after which torchrun fails the whole job. Measured: 6 aborts in 12 runs of 2 FSDP
    ranks that gather, release and destroy their group; none in 12 with this exit."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
