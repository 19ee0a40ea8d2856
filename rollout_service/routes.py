"""Routing replay's capture (issue 36, ``rollout.routing_replay``): the experts a mixture-of-
experts model routes each forwarded token to, recorded inside the engine process so the
learner can forward each sample through the same experts.

vLLM's own capture is out of reach on CPU (rollout_service/vllm_compat.py ``moe_routers``);
this binds a callback to every MoE layer's router and maps each step's flattened token rows
back to requests from the V1 runner's state at forward time (vllm/v1/worker/gpu_model_runner.py
``_prepare_inputs``): the batch's requests in order are ``input_batch.req_ids[:num_reqs]``;
request j's tokens are rows ``query_start_loc[j]:query_start_loc[j + 1]``, at token positions
from ``input_batch.num_computed_tokens_cpu[j]`` on. A prompt prefilled in chunks, several
requests decoding together and n > 1 children (requests of their own) all follow from that.
A request forwarded again from position p (preempted and recomputed) overwrites its rows
from p. A cached prefix is never forwarded, so it would have no rows: routing replay runs
with the prefix cache off, and a request whose rows have a hole says so.

Rows are kept per vLLM request id: ``{external}-{8 random hex}`` for n = 1, and
``{index}_{external}-{8 random hex}`` for each child of n > 1 (vllm/v1/engine/input_processor.py
``assign_request_id``, vllm/v1/engine/parallel_sampling.py ``get_child_info``). When vLLM frees a
request (it leaves ``model_runner.requests``) its rows wait, at most ``MAX_DONE`` finished
requests, for :meth:`RouteCapture.take`; so an aborted request's rows are dropped in the end.

Everything here runs in the engine's step thread (collective_rpc calls run between steps).
"""

from __future__ import annotations

import base64
import re
from collections import OrderedDict
from functools import partial

import numpy as np

from rlpipe.schema import route_dtype
from rollout_service.vllm_compat import moe_routers

MAX_DONE = 4096  # finished requests whose rows wait to be taken; the oldest beyond are dropped
_INTERNAL_ID = re.compile(r"^(?:(\d+)_)?(.*?)(?:-[0-9a-f]{8})?$")


class _Rows:
    """One vLLM request's rows, by token position, in an array that grows as it is forwarded."""

    def __init__(self, internal_id: str, shape: tuple[int, int], dtype: np.dtype):
        index, self.parent = _INTERNAL_ID.match(internal_id).groups()
        self.index = int(index or 0)
        self.data = np.zeros((64, *shape), dtype=dtype)
        self.n = 0
        self.hole = False  # a position was never forwarded (a cached prefix): its rows are unknown

    def write(self, start: int, rows: np.ndarray) -> None:
        end = start + len(rows)
        if end > len(self.data):
            grown = np.zeros((max(end, 2 * len(self.data)), *self.data.shape[1:]), dtype=self.data.dtype)
            grown[:self.n] = self.data[:self.n]
            self.data = grown
        self.hole |= start > self.n
        self.data[start:end] = rows
        self.n = end  # forwarded again from ``start``: what came after is stale

    def to_json(self) -> dict:
        return {"rows": self.n, "hole": self.hole, "data": base64.b64encode(self.data[:self.n].tobytes()).decode()}


class RouteCapture:
    """Binds to every MoE router of ``model_runner``'s model and records each request's rows."""

    def __init__(self, model_runner):
        self.runner = model_runner
        routers = moe_routers(model_runner.get_model())
        if not routers:
            raise ValueError("routing replay needs a mixture-of-experts model; this one has no MoE layers")
        self.layers, self.top_k = len(routers), routers[0].top_k
        self.experts = routers[0].global_num_experts
        self.dtype = route_dtype(self.experts)
        self.live: dict[str, _Rows] = {}
        self.done: OrderedDict[str, _Rows] = OrderedDict()
        self.skipped_steps = 0  # forwards whose row count did not match the runner's batch (not recorded)
        self._step = None
        self.bind(routers)

    def bind(self, routers: list | None = None) -> None:
        """Set the capture hook on every router, in layer order (again after a weight reload,
        should it have rebuilt a layer)."""
        for i, router in enumerate(routers or moe_routers(self.runner.get_model())):
            router.set_capture_fn(partial(self._capture, i))

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.layers, self.top_k, self.experts

    def _capture(self, layer: int, topk_ids) -> None:
        """Called by layer ``layer``'s router with this forward's ``topk_ids`` [tokens, top_k]."""
        if layer == 0:
            self._step = self._begin_step()
        step = self._step
        if step is None:
            return
        buf = step[3]
        if topk_ids.shape[0] < len(buf):
            self._step = None
            self.skipped_steps += 1
            return
        buf[:, layer] = topk_ids[:len(buf)].cpu().numpy()
        if layer == self.layers - 1:
            self._step = None
            self._commit(*step)

    def _begin_step(self):
        """The runner's batch as this forward lays it out (set by ``_prepare_inputs``)."""
        batch = self.runner.input_batch
        n = batch.num_reqs
        qsl = self.runner.query_start_loc.np[:n + 1].copy()
        rows = np.empty((int(qsl[n]) if n else 0, self.layers, self.top_k), dtype=self.dtype)
        return list(batch.req_ids[:n]), batch.num_computed_tokens_cpu[:n].copy(), qsl, rows

    def _commit(self, req_ids: list[str], starts: np.ndarray, qsl: np.ndarray, rows: np.ndarray) -> None:
        for j, rid in enumerate(req_ids):
            self._rows(rid).write(int(starts[j]), rows[qsl[j]:qsl[j + 1]])
        freed = [rid for rid in self.live if rid not in self.runner.requests]
        for rid in freed:
            self.done[rid] = self.live.pop(rid)
        while len(self.done) > MAX_DONE:
            self.done.popitem(last=False)

    def _rows(self, rid: str) -> _Rows:
        rows = self.live.get(rid) or self.done.pop(rid, None)
        if rows is None:
            rows = _Rows(rid, (self.layers, self.top_k), self.dtype)
        self.live[rid] = rows
        return rows

    def take(self, request_id: str) -> dict[int, dict]:
        """Hand back, and forget, the rows of every vLLM request of our ``request_id`` (its
        children for n > 1), by child index: ``{"rows", "hole", "data"}`` (base64 of the
        rows' bytes, dtype :attr:`dtype`)."""
        out = {}
        for store in (self.live, self.done):
            for rid in [rid for rid, r in store.items() if r.parent == request_id]:
                rows = store.pop(rid)
                out[rows.index] = rows.to_json()
        return out


def decode(taken: dict, layers: int, top_k: int, experts: int) -> dict[int, np.ndarray]:
    """:meth:`RouteCapture.take`'s reply (after JSON: string keys) as (rows, layers, top_k)
    arrays by child index; raises on a hole (rows that were never forwarded)."""
    dtype = route_dtype(experts)
    out = {}
    for index, t in taken.items():
        if t["hole"]:
            raise RuntimeError(f"child {index}: part of its tokens were never forwarded (a cached prefix?), "
                               "their routes are unknown")
        out[int(index)] = np.frombuffer(base64.b64decode(t["data"]), dtype=dtype).reshape(t["rows"], layers, top_k)
    return out


def checked(request_id: str, routes: dict[int, np.ndarray], prompt_len: int, tokens: dict[int, list[int]],
            finish: dict[int, str], stop: bool, finished: tuple | dict) -> dict[int, np.ndarray]:
    """Each finished child's routes (``finished``: the finish reasons that make a record; an
    aborted child has none), checked: one row per forwarded token, P + L - 1, whoever
    recorded them (the capture here, or vLLM's own on GPU); a mismatch is a bug. With stop
    strings, matched after the engine sampled on, the engine may have forwarded tokens past
    the stop: rows beyond P + L - 1 are theirs and are cut."""
    out = {}
    for i, toks in tokens.items():
        if finish.get(i) not in finished:
            continue
        want = prompt_len + len(toks) - 1
        got = len(routes[i]) if i in routes else 0
        if got < want or (got > want and not stop):
            raise RuntimeError(f"routing replay: request {request_id} child {i} has {got} rows of routes, "
                               f"expected {want} ({prompt_len} prompt + {len(toks)} sampled - 1)")
        out[i] = routes[i][:want]
    return out

