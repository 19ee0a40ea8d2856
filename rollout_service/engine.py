"""The rollout engine: a vLLM ``AsyncLLM`` that returns behavior log-probs and takes
weight updates in flight.

- Log-probs are vLLM's ``processed_logprobs`` (after temperature), the distribution the
  tokens were actually sampled from: exactly what importance sampling needs.
- Token ids flow unchanged from the engine into the result; nothing is re-tokenized.
- An update is received in the background while generation goes on; then the scheduler
  pauses with ``mode="keep"`` (running requests are frozen, not aborted), the new weights
  are loaded and generation resumes. Every request in flight records at which of its tokens
  the version changed. The prefix cache is kept: each request is salted with the weights
  it (its session) started on, so no request reads another version's KV
  (rollout_service/prefix_cache.py).
- An update runs one way: the weight follower (weight_sync/follower.py) calls this
  engine, which runs the slow steps in its worker process through ``collective_rpc``
  (the binding, rollout_service/worker_ext.py, and its ``WeightStager``,
  weight_sync/stager.py) and pauses only to load; under nccl or ipc it drives the receiver
  weight_sync/transport_choice.py gives it (weight_sync/device_updates.py, bound to vLLM
  by rollout_service/transfer_engine.py) instead.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np

from quant.precision_profile import PrecisionProfile
from rlpipe import sampler_topk
from rlpipe.config import ConfigError, RolloutConfig
from rollout_service import vllm_compat
from rollout_service.adapters import AdapterVersions, LoraServe, lora_engine_kwargs
from rollout_service.engine_args import engine_args_problems, engine_processes
from rollout_service.prefix_cache import CacheSalts
from rollout_service.transfer_engine import VllmTransferEngine
from rollout_service.worker_ext import EXTENSION_CLS
from weight_sync.device_updates import DeviceUpdates
from weight_sync.follower import SyncOutcome
from weight_sync.manifest import Manifest
from weight_sync.transport_choice import receiver_for, transfer_backend

log = logging.getLogger(__name__)

FINISH_REASONS = {"stop": "stop", "length": "length"}


class WeightsCorrupted(RuntimeError):
    """Loading new weights failed after it started: the engine must not serve again."""


class InvalidRequest(ValueError):
    """The engine refused the sampling parameters; ``field`` names the offending one."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    @classmethod
    def from_vllm(cls, e: Exception) -> InvalidRequest:
        """From vLLM's ``VLLMValidationError`` (which names the parameter) or a plain ValueError."""
        return cls(getattr(e, "parameter", None) or "sampling", e.args[0] if e.args else str(e))


@dataclass
class SampleResult:
    tokens: np.ndarray  # int32, as sampled
    logprobs: np.ndarray  # float32, behavior log-probs
    finish_reason: str
    versions: np.ndarray | None  # int32 per token, only if the version changed mid-sequence
    # (P + L - 1, layers, top_k) expert ids of every forwarded token, routing replay only
    # (rollout.routing_replay; rollout_service/routes.py)
    routes: np.ndarray | None = None
    cache_salt: str = ""  # the prefix-cache salt it was sampled under: a session's later turns pass it on
    cached_tokens: int = 0  # prompt tokens read from the prefix cache instead of forwarded
    # (L, k) the sampler's top-k ids and log-probs of each token, on request (rlpipe/sampler_topk.py)
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None


@dataclass
class _Tracked:
    """A request in flight: its children's token counts and the version changes they saw."""

    start_version: int
    counts: dict[int, int] = field(default_factory=dict)
    changes: list[tuple[dict[int, int], int]] = field(default_factory=list)

    def versions_for(self, index: int, length: int) -> np.ndarray | None:
        if not self.changes:
            return None
        out = np.full(length, self.start_version, dtype=np.int32)
        for counts, version in self.changes:
            out[min(counts.get(index, 0), length):] = version
        return out


class RolloutEngine:
    def __init__(self, model_path: str, profile: PrecisionProfile, cfg: RolloutConfig, seed: int = 0,
                 transport: str = "gloo", lora: LoraServe | None = None, sampler_topk: int = 0):
        """``transport``: the run's resolved ``sync.transport``; under nccl or ipc updates go
        through vLLM's own weight-transfer engine (weight_sync/device_updates.py). ``lora``:
        versions are adapters on a base held for good (rollout_service/adapters.py)."""
        self.lora, self.sampler_topk = lora, sampler_topk  # sampler_topk: how many top log-probs with_topk returns
        self.adapters = AdapterVersions()
        self.model_path = model_path
        self.transport = transport
        self.device_updates: DeviceUpdates | None = None  # nccl's or ipc's receiver, once started with one
        self.profile = profile
        self.cfg = cfg
        self.seed = seed
        self.llm = None
        self.version = 0
        self.synced = False  # True once weights came from the learner or a checkpoint (not the base model)
        self.weights_source = "base"  # where the weights in the engine came from: base, learner, checkpoint
        self.model_dir = profile.checkpoint or model_path  # what the engine starts from
        self.quant_profile = profile.quant_hash  # the profile of the weights in the engine (a recalibration moves it)
        self._active: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self._update_lock = asyncio.Lock()
        self.paused_seconds_total = 0.0
        self.salts = CacheSalts()  # the prefix cache's, one per weights loaded (prefix_cache.py)
        self.routing: tuple[int, int, int] | None = None  # (layers, top_k, experts) under routing replay
        # vLLM records the routes itself (GPU, vllm_compat.native_routes); else the capture hook
        self.native_routes = cfg.routing_replay and vllm_compat.native_routes()

    def engine_kwargs(self) -> dict:
        """The vLLM engine arguments (also what bench/rollout.py gives offline vLLM): rlpipe's,
        and the run's ``rollout.engine`` (which may not set rlpipe's, engine_args.py)."""
        if problems := engine_args_problems(self.cfg.engine, self.transport):
            raise ConfigError("; ".join(problems))
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.cfg.kv_cache_gib))
        vllm_compat.before_engine_start()
        if self.cfg.routing_replay and self.cfg.engine.get("enable_prefix_caching"):
            raise ConfigError("rollout.engine.enable_prefix_caching: routing replay (rollout.routing_replay) needs "
                              "the prefix cache off: a cached prefix is not forwarded and has no routes")
        return dict(
            model=self.model_dir,
            tokenizer=self.model_dir,
            enforce_eager=self.cfg.enforce_eager,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=EXTENSION_CLS,
            max_model_len=self.cfg.max_model_len,
            **({"max_num_batched_tokens": self.cfg.max_num_batched_tokens} if self.cfg.max_num_batched_tokens else {}),
            seed=self.seed,
            # one process: the engine's own ("uni"), which keeps rlpipe's gloo follower in it;
            # tensor/pipeline parallel ranks are processes of their own (nccl transport only)
            distributed_executor_backend="uni" if engine_processes(self.cfg.engine) == 1 else "mp",
            **({"weight_transfer_config": {"backend": backend}} if (backend := transfer_backend(self.transport))
               else {}),
            disable_log_stats=not self.cfg.vllm_metrics,  # on: vLLM's vllm:* series (rollout/metrics.py)
            **lora_engine_kwargs(self.lora),
            # the run's own over the precision's (its hf_overrides replace the head dtype); under routing replay
            # a cached prefix is not forwarded: its tokens would have no routes
            **self.profile.engine_kwargs() | self.cfg.engine
            | ({"enable_prefix_caching": False} if self.cfg.routing_replay else {}),
            **({"enable_return_routed_experts": True} if self.native_routes else {}),
            **({"max_logprobs": self.sampler_topk} if self.sampler_topk > 20 else {}),  # vLLM's default: 20
        )

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_kwargs()))
        lora_rank = self.lora.rank if self.lora else 0
        info = (await self.llm.collective_rpc("rlpipe_init", args=(self.model_dir, self.profile.compat,
                                                                   self.quant_profile, lora_rank)))[0]
        for workaround in ("keep_reloaded_kernel_tensors", "rewind_cpu_generators",
                           *(("grouped_cpu_lora",) if self.lora else ())):
            if not info[workaround]:
                raise RuntimeError(f"the vLLM workaround vllm_compat.{workaround} did not take")
        if self.cfg.routing_replay and not self.native_routes:
            await self._start_routes()
        self.device_updates = self.receiver()
        if info["ppid"] != os.getpid():
            log.warning("the model runs in a separate worker process (pid %s): vLLM's multiprocess "
                        "executor is in use and busy-polls a core", info["pid"])

    async def _start_routes(self) -> None:
        """Record each token's experts in the engine process (rollout_service/routes.py); a
        model whose experts cannot be recorded (no MoE layers) is refused here."""
        info = (await self.llm.collective_rpc("rlpipe_capture_routes"))[0]
        if not info["ok"]:
            self.shutdown()
            raise ConfigError(f"rollout.routing_replay: {info['error']} ({self.model_dir})")
        self.routing = (info["layers"], info["top_k"], info["experts"])

    async def _take_routes(self, request_id: str, routed: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """The request's routes by child, unchecked: those the capture hook recorded in the
        engine process, or vLLM's own (``routed``, GPU) in the wire's dtype, the first of
        which give the run's routing shape."""
        from rlpipe.schema import expert_count, route_dtype
        from rollout_service.routes import decode

        if not self.native_routes:
            return decode((await self.llm.collective_rpc("rlpipe_take_routes", args=(request_id,)))[0],
                          *self.routing)
        if self.routing is None and routed:
            experts = expert_count(self.llm.model_config.hf_config.to_dict())
            self.routing = (*next(iter(routed.values())).shape[1:], experts)
        return {i: np.asarray(r).astype(route_dtype(self.routing[2])) for i, r in routed.items()}

    def receiver(self) -> DeviceUpdates | None:
        """The run's transport's receiver in this process (weight_sync/transport_choice.py):
        under nccl and ipc, the one that drives this engine's ``AsyncLLM`` through vLLM's
        transfer engine; None under gloo, whose receiver is the worker process's stager."""
        return receiver_for(self.transport, lambda: VllmTransferEngine(self.llm), self.model_dir, self.profile.compat,
                            engine_processes(self.cfg.engine))

    @property
    def inflight(self) -> int:
        return len(self._active)

    @property
    def errored(self) -> bool:
        return self.llm is not None and self.llm.errored

    async def generate(self, prompt_ids: list[int], n: int, temperature: float, top_p: float = 1.0,
                       top_k: int = -1, max_tokens: int = 16, min_tokens: int = 0, seed: int | None = None,
                       stop: list[str] | None = None, cache_salt: str | None = None,
                       with_topk: bool = False) -> tuple[list[SampleResult], int, int]:
        """Sample ``n`` responses; returns ``(samples, version_at_start, version_at_end)``. ``cache_salt``: a
        session's (its first request's ``SampleResult.cache_salt``), else the current weights' (prefix_cache.py).
        ``with_topk``: each sample's ``topk_ids``/``topk_logprobs`` too, its tokens' ``sampler_topk`` best."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        try:
            # DELTA: each step brings only its new tokens (cumulative outputs would copy every
            # sequence so far at every step). Text is only needed to match stop strings; the
            # caller decodes the final tokens itself.
            params = SamplingParams(
                n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                min_tokens=min_tokens, seed=seed, stop=stop or None, detokenize=bool(stop),
                logprobs=self.sampler_topk if with_topk else 0, output_kind=RequestOutputKind.DELTA,
            )
        except (VLLMValidationError, ValueError) as e:
            raise InvalidRequest.from_vllm(e) from None
        request_id = f"r{next(self._ids)}"
        tracked = _Tracked(start_version=self.version)
        salt = cache_salt or self.salts.current
        cached: dict[int, int] = {}
        self._active[request_id] = tracked
        tokens: dict[int, list[int]] = {i: [] for i in range(n)}
        logprobs: dict[int, list[float]] = {i: [] for i in range(n)}
        steps: dict[int, list[dict]] = {i: [] for i in range(n)}  # with_topk: each token's candidates
        finish: dict[int, str] = {}
        routed: dict[int, np.ndarray] = {}  # vLLM's own routes, each child's at its end (GPU)
        try:
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids), cache_salt=salt),
                                               params, request_id=request_id, lora_request=self.adapters.current):
                for c in out.outputs:  # each event carries the new tokens of one child
                    cached[c.index] = out.num_cached_tokens or 0
                    tokens[c.index] += c.token_ids
                    logprobs[c.index] += [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
                    steps[c.index] += c.logprobs if with_topk else []
                    tracked.counts[c.index] = len(tokens[c.index])
                    if c.finish_reason is not None:
                        finish[c.index] = c.finish_reason
                    if getattr(c, "routed_experts", None) is not None:
                        routed[c.index] = c.routed_experts
        except VLLMValidationError as e:  # refused when the request was added (e.g. too long)
            raise InvalidRequest.from_vllm(e) from None
        finally:
            self._active.pop(request_id, None)
            if self.lora:  # the adapters of versions no request holds any more go
                await self.adapters.retire(self.llm, {t.start_version for t in self._active.values()})
        routes = {}
        if self.native_routes or self.routing:
            from rollout_service.routes import checked

            routes = checked(request_id, await self._take_routes(request_id, routed), len(prompt_ids), tokens, finish,
                             bool(stop), FINISH_REASONS)
        results = [SampleResult(np.asarray(tokens[i], dtype=np.int32), np.asarray(logprobs[i], dtype=np.float32),
                                FINISH_REASONS.get(finish.get(i), "abort"), tracked.versions_for(i, len(tokens[i])),
                                routes.get(i), salt, cached.get(i, 0),
                                *(sampler_topk.from_steps(steps[i], self.sampler_topk) if with_topk else ()))
                   for i in range(n)]
        end_version = tracked.changes[-1][1] if tracked.changes else tracked.start_version
        return results, tracked.start_version, end_version

    # -- weight sync -----------------------------------------------------------------
    async def _in_worker(self, op: str, *args) -> dict:
        """Run a slow weight operation in the engine process's background thread while
        generation goes on, polling for its result."""
        started = (await self.llm.collective_rpc("rlpipe_start", args=(op, *args)))[0]
        if not started["ok"]:
            return started
        while True:
            await asyncio.sleep(0.01)
            result = (await self.llm.collective_rpc("rlpipe_poll"))[0]
            if result is not None:
                return result

    async def join(self, host: str, port: int, slot: str, generation: int, manifest: Manifest,
                   timeout_s: float) -> SyncOutcome:
        """Check in under ``slot`` and join ``generation`` (or refuse it) while generating;
        the manifest crosses to the engine process once, as JSON, and stays there."""
        if self.device_updates:
            return await self.device_updates.join(host, port, slot, generation, manifest, timeout_s)
        return SyncOutcome.of(await self._in_worker("join", host, port, slot, generation, manifest.to_json(),
                                                    timeout_s))

    async def update(self, version: int, manifest: Manifest) -> SyncOutcome:
        """Receive ``version`` while generating, then load it with generation paused. The
        weights carry their quantization profile (a recalibrated one after a recalibration)."""
        if self.device_updates:
            result = await self._device_update(version, manifest)
        else:
            result = await self._stage_and_apply(version, "learner", "receive", version, manifest.hash)
        if result.ok:
            self.quant_profile = manifest.quant_profile or self.quant_profile
        return result

    async def _device_update(self, version: int, manifest: Manifest) -> SyncOutcome:
        """Under nccl or ipc: take the version's header while generating, then receive and
        load it with generation paused (weight_sync/device_updates.py)."""
        if error := await self.device_updates.expect(version, manifest):
            return SyncOutcome.failed(error)
        async with self._update_lock:
            return SyncOutcome.of(await self._apply(version, "learner",
                                                    lambda: self.device_updates.transfer(version, manifest)))

    async def load_checkpoint(self, model_dir: str, version: int, quant_profile: str | None = None) -> SyncOutcome:
        """Catch up to a checkpoint's weights (a worker that missed syncs); a quantized
        engine's come with the profile they were quantized with."""
        if self.lora and quant_profile is not None and quant_profile != self.quant_profile:
            return SyncOutcome.failed(f"checkpoint {model_dir}: its adapter is rewritten for int8 profile "
                                      f"{quant_profile or '-'}, this worker's base has {self.quant_profile or '-'}")
        result = await self._stage_and_apply(version, "checkpoint", "read", model_dir)
        if result.ok and quant_profile:
            self.quant_profile = quant_profile
        return result

    async def _stage_and_apply(self, version: int, source: str, op: str, *args) -> SyncOutcome:
        async with self._update_lock:
            staged = await self._in_worker(op, *args)
            if not staged["ok"]:
                return SyncOutcome.of(staged)
            adopt = self._adopt_adapter if staged.get("adapter") else self._apply
            return SyncOutcome.of({**staged, **await adopt(version, source)})

    async def _adopt_adapter(self, version: int, source: str) -> dict:
        """A LoRA version: the staged adapter written to its directory and added under a new
        id, without pausing generation: requests in flight keep theirs to their end (their
        tokens are all of their start version), new ones carry this one (rollout_service/adapters.py)."""
        t0 = time.perf_counter()
        if not self.lora:
            return {"ok": False, "error": "an adapter came to an engine started without learner.lora"}
        written = (await self.llm.collective_rpc("rlpipe_adapter", args=(version,)))[0]
        if not written["ok"]:
            return written
        await self.adapters.adopt(self.llm, version, written["adapter_dir"])
        self.version, self.synced, self.weights_source = version, True, source
        self.salts.loaded(version)
        await self.adapters.retire(self.llm, {t.start_version for t in self._active.values()})
        return {"ok": True, "load_s": time.perf_counter() - t0, "pause_s": 0.0, "activated_at": time.time()}

    async def _load_staged(self) -> dict:
        return (await self.llm.collective_rpc("rlpipe_apply"))[0]

    async def _apply(self, version: int, source: str, load=None) -> dict:
        """Load new weights with generation paused ("keep": running requests are frozen, not
        aborted), give new requests a new prefix-cache salt and record the version change in
        every request in flight. ``load``: how (default: the weights staged in the engine
        process; under nccl or ipc, the transfer itself)."""
        t0 = time.perf_counter()
        await self.llm.pause_generation(mode="keep", clear_cache=False)
        try:
            for _ in range(3):  # let streamed outputs of the last step reach their requests
                await asyncio.sleep(0)
            result = await (load or self._load_staged)()
        except Exception as e:
            # The model may be half-loaded: never resume generating with it.
            raise WeightsCorrupted(f"loading version {version} failed part-way: {e!r}") from e
        try:
            if result.get("ok"):
                self.version, self.synced, self.weights_source = version, True, source
                self.salts.loaded(version)  # no reset: new requests read none of the old weights' KV
                for tracked in self._active.values():
                    tracked.changes.append((dict(tracked.counts), version))
        finally:
            await self.llm.resume_generation()
        # The activation pause: from asking the scheduler to pause until it resumed on the new
        # weights (staging, the transfer itself under gloo, happened before, while generating).
        pause = time.perf_counter() - t0
        self.paused_seconds_total += pause
        return {**result, "pause_s": pause, "activated_at": time.time()}

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
        self.adapters.close()

