"""Rollout routing replay (R3, issue 36): the learner forwards a mixture-of-experts model
through the experts the rollout engine chose, and measures how often its own router agrees.

Why: an engine and the learner compute a token's router logits in different kernels (and
precisions), and where two experts score nearly alike they pick different ones. On the
feasibility probe 1.6% of a bf16 engine's tokens were routed differently by the learner,
and those few tokens gave log-prob gaps up to 0.66; replaying the engine's experts cut the
largest gap to 0.018 (the LoRA and MoE feasibility probe). Replay forces only the
*choice*: the router's probabilities are still computed, softmax over all experts, and the
chosen ones' weights are gathered from them (renormalised as the model does), so the router
keeps its gradient.

The routers handled are transformers' softmax-then-top-k routers (``ROUTERS``: Qwen3-MoE,
Qwen2-MoE, Mixtral, OLMoE), which is also how vLLM routes those models. Their layer order
in ``model.modules()`` is the engine's capture order (rollout_service/routes.py).

:func:`install` wraps each router's ``forward`` once. A forward under :func:`routes_for`
replays the given routes, laid out like the model's input (``(B, S, layers, top_k)``, -1
where there is none: that position routes itself); outside it the routers behave exactly as
before. Either way, where routes are given, each router counts the (token, layer) pairs whose
own top-k set equals the replayed one: the routing agreement (:class:`Tally`).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ROUTERS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "MixtralTopKRouter", "OlmoeTopKRouter")


@dataclass
class Tally:
    """Per MoE layer: (token, layer) pairs with a replayed route, and those the learner's own
    router agreed on (the same top-k set); and the router's load, over the tokens of the
    forwards (not the padding): top-k assignments and summed probabilities per expert."""

    agree: list[int] = field(default_factory=list)
    total: list[int] = field(default_factory=list)
    load: dict[int, torch.Tensor] = field(default_factory=dict)
    probs: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)

    def add(self, layer: int, agree: int, total: int) -> None:
        while len(self.total) <= layer:
            self.agree.append(0)
            self.total.append(0)
        self.agree[layer] += agree
        self.total[layer] += total

    def add_load(self, layer: int, chosen: torch.Tensor, probs: torch.Tensor) -> None:
        """Count one forward's ``chosen`` experts (tokens x top_k) and ``probs`` (tokens x experts)."""
        # kept on the forward's device: a copy to the host here would wait on it in every MoE layer
        counts = torch.bincount(chosen.reshape(-1), minlength=probs.shape[-1]).float()
        self.load[layer] = self.load.get(layer, 0) + counts
        self.probs[layer] = self.probs.get(layer, 0) + probs.detach().float().sum(0)
        self.tokens[layer] = self.tokens.get(layer, 0) + len(probs)

    def metrics(self) -> dict:
        """``routing_agreement`` overall and per layer (where routes were replayed), and the load
        balance (where tokens were routed); empty when neither."""
        out = {}
        if sum(self.total):
            out = {"routing_agreement": sum(self.agree) / sum(self.total),
                   "routing_agreement_by_layer": [a / t if t else None for a, t in zip(self.agree, self.total)]}
        if sum(self.tokens.values()):
            out.update(load_balance(self.load, self.probs, self.tokens))
        return out


def load_balance(load: dict[int, torch.Tensor], probs: dict[int, torch.Tensor], tokens: dict[int, int]) -> dict:
    """``router_load_max``: the busiest expert's share of a layer's top-k assignments, in units
    of an even share (1: balanced; ``experts / top_k``: every token on the same experts), the
    worst layer's and per layer; ``router_aux_loss``: the model's load-balancing loss as
    transformers computes it (``load_balancing_loss_func``: experts x the sum over experts of
    assignments per token x mean probability, all layers pooled). The learner never adds it to
    its loss; it shows a router collapsing onto a few experts, which RL can drive."""
    layers = sorted(load)
    experts = len(load[layers[0]])
    by_layer = [float(load[i].max() / load[i].sum() * experts) if i in load and load[i].sum() else None
                for i in range(layers[-1] + 1)]
    rows = sum(tokens.values())
    aux = experts * float((sum(load.values()) / rows * sum(probs.values()) / rows).sum())
    return {"router_load_max": max(v for v in by_layer if v is not None), "router_load_max_by_layer": by_layer,
            "router_aux_loss": aux}


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers, in layer order (also the order of the engine's routes)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Router") and hasattr(m, "top_k")]


def moe_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The sparse MoE blocks in ``module``: each router's parent (router and experts), which
    FSDP2 shards as units of their own (learner/dist.py)."""
    routers = {id(r) for r in moe_routers(module)}
    return [m for m in module.modules() if any(id(c) in routers for c in m.children())]


def routing_shape(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """(MoE layers, top_k, experts) of ``model``, None without MoE layers."""
    routers = moe_routers(model)
    if not routers:
        return None
    return len(routers), int(routers[0].top_k), int(routers[0].num_experts)


def replay_problem(model: torch.nn.Module) -> str | None:
    """Why routing replay cannot run on ``model`` (None when it can)."""
    routers = moe_routers(model)
    if not routers:
        return "the model has no mixture-of-experts layers to replay"
    other = sorted({type(r).__name__ for r in routers} - set(ROUTERS))
    if other:
        return f"routing replay handles the softmax top-k routers {list(ROUTERS)}, not {other}"
    return None


def install(model: torch.nn.Module, replay: bool = True) -> int:
    """Wrap every MoE router's forward (once; idempotent). Returns the routers wrapped.
    ``replay`` False: routes given are only compared with the learner's own choice (the
    agreement), not forced. ``model`` is the bare model (not a DDP wrapper); FSDP2's hooks
    stay on the layers."""
    if problem := replay_problem(model):
        raise ValueError(problem)
    routers = moe_routers(model)
    state = model.__dict__.setdefault("_rlpipe_routing", {"routes": None, "tally": Tally()})
    state["replay"] = replay
    for layer, router in enumerate(routers):
        if not getattr(router, "_rlpipe_replays", False):
            router.forward = _replaying(router, layer, state)
            router._rlpipe_replays = True
    return len(routers)


@contextmanager
def routes_for(model: torch.nn.Module, routes: torch.Tensor | None, valid: torch.Tensor | None = None):
    """Forwards of ``model`` in this block replay ``routes`` (the input's ``(B, S, layers,
    top_k)``), and count the routers' load over the ``valid`` positions (``(B, S)``, the
    attention mask; without it nothing is counted: padding would be). Both None, or a model
    :func:`install` never saw: nothing changes."""
    state = model.__dict__.get("_rlpipe_routing")
    if state is None or (routes is None and valid is None):
        yield
        return
    state["routes"], state["valid"] = routes, valid
    try:
        yield
    finally:
        state["routes"] = state["valid"] = None


def recompute_contexts(model: torch.nn.Module):
    """``torch.utils.checkpoint``'s ``context_fn`` for a layer of ``model`` (learner.activation_checkpointing):
    its recomputation in the backward pass, after :func:`routes_for` has exited, routes as the forward did
    (the same replayed experts and load mask, so the same tensors are saved and the gradient is the one of
    the experts that were used), and counts nothing a second time. Called at the forward, so it sees the
    routes in force then."""
    state = model.__dict__.get("_rlpipe_routing")
    if state is None:
        return nullcontext(), nullcontext()
    return nullcontext(), _as_in_forward(state, state["routes"], state.get("valid"))


@contextmanager
def _as_in_forward(state: dict, routes, valid):
    kept = state["routes"], state.get("valid"), state["tally"]
    state["routes"], state["valid"], state["tally"] = routes, valid, Tally()  # this count is dropped
    try:
        yield
    finally:
        state["routes"], state["valid"], state["tally"] = kept


def take_tally(model: torch.nn.Module) -> Tally:
    """The agreement counted since the last call (and a fresh count from here)."""
    state = model.__dict__.get("_rlpipe_routing")
    if state is None:
        return Tally()
    tally, state["tally"] = state["tally"], Tally()
    return tally


def _replaying(router: torch.nn.Module, layer: int, state: dict):
    """``router``'s forward with the replay: the routes in force for this layer, flattened as the
    router flattens its input (row-major over batch and sequence)."""

    def forward(hidden_states: torch.Tensor):
        routes, valid = state["routes"], state.get("valid")
        forced = None
        if routes is not None:
            forced = routes[..., layer, :].reshape(-1, routes.shape[-1]).to(hidden_states.device, torch.long)
        if valid is not None:
            valid = valid.reshape(-1).to(hidden_states.device, torch.bool)
        return routed(router, hidden_states, forced, state["tally"], layer, state["replay"], valid)

    return forward


def routed(router: torch.nn.Module, hidden_states: torch.Tensor, forced: torch.Tensor | None, tally: Tally,
           layer: int, replay: bool = True, valid: torch.Tensor | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the router returns (logits, weights of the chosen experts, their ids), its choice
    replaced by ``forced`` on each row whose ids are all >= 0 (with ``replay``; without, the
    rows are only counted for the agreement). The ``valid`` rows' experts and probabilities
    are counted for the load balance."""
    hidden = hidden_states.reshape(-1, router.weight.shape[1])
    logits = F.linear(hidden, router.weight)
    probs = torch.softmax(logits.float(), dim=-1)
    _, own = torch.topk(probs, router.top_k, dim=-1)
    chosen = own
    if forced is not None:
        if forced.shape != own.shape:
            raise ValueError(f"routes for layer {layer}: {tuple(forced.shape)} rows, the forward has "
                             f"{tuple(own.shape)} (tokens x top_k)")
        given = (forced >= 0).all(-1)
        replayed = torch.where(given[:, None], forced.clamp(min=0), own)
        same = (own.sort(-1).values == replayed.sort(-1).values).all(-1) & given
        tally.add(layer, int(same.sum()), int(given.sum()))
        if replay:
            chosen = replayed
    if valid is not None:
        if valid.shape[0] != len(chosen):  # a mask of another layout would count the wrong rows
            raise ValueError(f"router load for layer {layer}: a mask of {valid.shape[0]} rows, the forward has "
                             f"{len(chosen)} tokens")
        tally.add_load(layer, chosen[valid], probs.detach()[valid])  # counting saves nothing for the backward
    weights = probs.gather(-1, chosen)
    if getattr(router, "norm_topk_prob", True):  # Mixtral always renormalises (no attribute)
        weights = weights / weights.sum(-1, keepdim=True)
    if type(router).__name__ != "MixtralTopKRouter":  # as each model's own forward returns them
        weights = weights.to(logits.dtype)
    return logits, weights, chosen
