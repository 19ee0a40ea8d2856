"""The trajectory wire schema (docs/design.md): one msgpack map per group, ``schema: 1``.

Kept free of heavy imports (numpy and msgpack only) so that a reader never pulls in the
trainer's or the engine's stack. Token ids and log-probs travel as little-endian int32 /
float32 byte strings; the response tokens are exactly those the engine sampled.

:func:`decode_group` validates everything and raises :class:`SchemaError` with a reason,
which readers put on the dead-letter stream instead of crashing.

Multi-turn episodes (issue 23; a schema change in DESIGN's sense, made as an optional field of
schema 1 rather than a schema 2): a sample's ``tokens`` are then the whole episode after the
prompt, the model's turns and the environment's messages (tool results, user turns)
interleaved, each exactly as sampled or tokenized once at append time. The optional
``mask`` (bin, one uint8 per token) says which is which: 1 a model token (it trains), 0 an
environment token (context only). Absent means all ones, so a record written before it
reads exactly as before. ``logprobs`` are the behavior log-probs of the model tokens and
exactly 0 at environment positions; ``versions`` is per token as before (at an environment
position: the version in force when it was appended, not interpreted by the learner).

Routing replay (issue 36, ``rollout.routing_replay``; optional too): a mixture-of-experts
engine's chosen experts travel with the sample so the learner forwards through the same
ones. The group's ``routing`` map gives the shape (``layers``, ``top_k``, ``experts``); each
sample's ``routes`` is one row per token the engine forwarded, the prompt's and the
response's except the last sampled one (it is never forwarded): ``P + L - 1`` rows of
``layers x top_k`` expert ids, uint8 when ``experts`` <= 256 and little-endian uint16 up to
65,536, the smallest integer that holds an id (1 byte a (token, layer, k) on any model
with at most 256 experts: 96 bytes a token for 48 layers of top-2).

The sampler's top-k (score centering, ``learner.score_centering_k``; optional too): the group's
``sampler_topk`` is k, and each sample's ``topk_ids`` and ``topk_logprobs`` hold the k best
candidates of every response position (rlpipe/sampler_topk.py packs and checks them).
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field

import msgpack
import numpy as np

from rlpipe import sampler_topk
from rlpipe.precisions import PRECISIONS

SCHEMA_VERSION = 1
FINISH_REASONS = ("stop", "length", "abort")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "seed")

I32 = np.dtype("<i4")
F32 = np.dtype("<f4")
U8 = np.dtype("u1")
U16 = np.dtype("<u2")
MAX_EXPERTS = 1 << 16

# What a sample's reward and reward_info may be (issue 33 item 12: one bad reward function stopped a run).
# A reward within float32's range with room for the learner's float32 sums over a group and a batch (a
# reward of 1e39 is finite in float64 and inf in float32: every update's loss was NaN).
MAX_REWARD = 1e30
PLAIN = (str, int, float, bool, type(None))  # a reward_info value (msgpack packs these, flat)
MAX_INFO_ENTRIES = 64
MAX_INFO_BYTES = 4096  # msgpack-encoded, per sample: a chatty reward must not fill Redis (200k entries: +500 MB/min)


class SchemaError(ValueError):
    """A record that does not follow the wire schema; the message is the reason."""


@dataclass
class Sample:
    tokens: np.ndarray  # (L,) int32, the response exactly as sampled
    logprobs: np.ndarray  # (L,) float32, behavior log-prob of each sampled token
    finish_reason: str
    reward: float
    versions: np.ndarray | None = None  # (L,) int32, only when an update happened mid-sequence
    reward_info: dict | None = None
    # (L,) uint8, multi-turn episodes only: 1 model token (trains), 0 environment token
    # (context only; its logprob is 0). None: every token is the model's.
    mask: np.ndarray | None = None
    # (P + L - 1, layers, top_k) expert ids, routing replay only (the module docstring)
    routes: np.ndarray | None = None
    # (L, k) int32 ids and float16 log-probs of the sampler's top-k at each position (score centering only)
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None

    def model_mask(self) -> np.ndarray:
        """(L,) bool: which tokens the model sampled (all of them without a ``mask``)."""
        if self.mask is None:
            return np.ones(len(self.tokens), dtype=bool)
        return np.asarray(self.mask).astype(bool)

    def model_turns(self) -> int:
        """The model's turns in this sample: its runs of model tokens (1 for a single-turn sample)."""
        m = self.model_mask()
        return int(m[:1].sum() + (m[1:] & ~m[:-1]).sum())

    def oldest_version(self, policy_version: int) -> int:
        """The version of the oldest weights that sampled a model token of this sample:
        ``policy_version`` unless per-token versions say otherwise (environment tokens
        were not sampled, so their versions do not count)."""
        if self.versions is None:
            return policy_version
        sampled = np.asarray(self.versions)[self.model_mask()]
        return int(sampled.min()) if len(sampled) else policy_version


@dataclass
class GroupRecord:
    run_id: str
    group_id: str
    prompt_id: str
    worker_id: str
    policy_version: int
    policy_version_end: int
    precision: str
    quant_profile: str
    sampling: dict
    prompt_tokens: np.ndarray  # (P,) int32
    samples: list[Sample]
    created_at: float = field(default_factory=time.time)
    gen_seconds: float = 0.0
    schema: int = SCHEMA_VERSION
    # Not in docs/design.md's field list (optional, so older readers and writers still agree): the
    # prompt's index from the shared cursor and how many times it had been handed out before.
    # The learner settles each index once (rlpipe/queue.py, 'Prompt leases'); -1: not from the cursor.
    prompt_index: int = -1
    attempt: int = 0
    # (layers, top_k, experts) when the samples carry ``routes``, else None
    routing: tuple[int, int, int] | None = None
    sampler_topk: int = 0  # k when the samples carry the sampler's top-k (score centering), else 0

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def oldest_version(self) -> int:
        """The version staleness is counted from: that of the oldest model token of the group."""
        return min(s.oldest_version(self.policy_version) for s in self.samples)


def _short(x) -> str:
    """``x`` for a message: never raises, never long (str() of a huge int raises)."""
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        try:
            return f"{float(x):.6g}"
        except OverflowError:
            return "an integer beyond float64"
    return repr(x)[:50]


def reward_problem(reward) -> str | None:
    """Why ``reward`` cannot be a sample's reward (None when it can): a real number (not a
    bool; numpy's too) within +-MAX_REWARD, so the learner's float32 arithmetic stays finite."""
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        return f"reward {_short(reward)} is a {type(reward).__name__}, not a finite number"
    if not -MAX_REWARD <= reward <= MAX_REWARD:  # NaN fails it too; exact for ints of any size
        return f"reward {_short(reward)} is not a finite number within +-{MAX_REWARD:g} (the learner's float32)"
    return None


def info_problem(info) -> str | None:
    """Why ``info`` cannot be a sample's reward_info by its types (None when it can): a map
    of str keys to plain values that msgpack packs (ints of at most 64 bits, valid UTF-8)."""
    if not isinstance(info, dict):
        return f"reward_info is a {type(info).__name__}, not a map"
    for k, v in info.items():
        if not isinstance(k, str):
            return f"reward_info key {_short(k)} is a {type(k).__name__}, not a str"
        if not isinstance(v, PLAIN):
            return f"reward_info[{k[:50]!r}] is a {type(v).__name__}, not one of the plain values (str, int, " \
                   "float, bool, None)"
        if isinstance(v, int) and not -2**63 <= v < 2**64:
            return f"reward_info[{k[:50]!r}] is an integer beyond 64 bits"
        for text in (k, v) if isinstance(v, str) else (k,):
            try:
                text.encode()
            except UnicodeEncodeError:
                return f"reward_info[{k[:50]!r}]: not valid UTF-8 (a lone surrogate)"
    return None


def info_size_problem(info: dict) -> str | None:
    """Why ``info`` (plain by :func:`info_problem`) is too big for a record, or None: over
    MAX_INFO_ENTRIES entries or MAX_INFO_BYTES encoded. Counted before it is encoded, so a
    huge one costs no encoding."""
    if len(info) > MAX_INFO_ENTRIES:
        return f"reward_info has {len(info)} entries (at most {MAX_INFO_ENTRIES})"
    if sum(len(k) + (len(v) if isinstance(v, str) else 0) for k, v in info.items()) > MAX_INFO_BYTES or \
            len(msgpack.packb(info, use_bin_type=True)) > MAX_INFO_BYTES:
        return f"reward_info is over {MAX_INFO_BYTES} bytes encoded"
    return None


def _pack_array(a, dtype: np.dtype) -> bytes:
    return np.ascontiguousarray(a, dtype=dtype).tobytes()


def encode_group(rec: GroupRecord) -> bytes:
    """Serialize a record; validates it first, so a bad record never reaches the stream."""
    samples = []
    for s in rec.samples:
        m = {
            "tokens": _pack_array(s.tokens, I32),
            "logprobs": _pack_array(s.logprobs, F32),
            "finish_reason": s.finish_reason,
            "reward": float(s.reward),
        }
        if s.versions is not None:
            m["versions"] = _pack_array(s.versions, I32)
        if s.reward_info is not None:
            m["reward_info"] = s.reward_info
        if s.mask is not None:
            m["mask"] = _pack_array(s.mask, U8)
        if s.routes is not None:
            m["routes"] = _pack_array(s.routes, route_dtype(rec.routing[2]) if rec.routing else U8)
        if s.topk_ids is not None:
            m.update(sampler_topk.pack(s.topk_ids, s.topk_logprobs))
        samples.append(m)
    payload = {
        "schema": rec.schema,
        "run_id": rec.run_id,
        "group_id": rec.group_id,
        "prompt_id": rec.prompt_id,
        "worker_id": rec.worker_id,
        "policy_version": int(rec.policy_version),
        "policy_version_end": int(rec.policy_version_end),
        "precision": rec.precision,
        "quant_profile": rec.quant_profile,
        "sampling": dict(rec.sampling),
        "prompt_tokens": _pack_array(rec.prompt_tokens, I32),
        "samples": samples,
        "created_at": float(rec.created_at),
        "gen_seconds": float(rec.gen_seconds),
    }
    if rec.prompt_index >= 0:
        payload.update(prompt_index=int(rec.prompt_index), attempt=int(rec.attempt))
    if rec.routing is not None:
        payload["routing"] = dict(zip(ROUTING_KEYS, map(int, rec.routing)))
    if rec.sampler_topk:
        payload["sampler_topk"] = int(rec.sampler_topk)
    data = msgpack.packb(payload, use_bin_type=True)
    decode_group(data)  # the writer holds itself to the reader's rules
    return data


def _need(m: dict, key: str, types, where: str = ""):
    if key not in m:
        raise SchemaError(f"{where}{key}: missing")
    v = m[key]
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise SchemaError(f"{where}{key}: expected {types}, got bool")
    if not isinstance(v, types):
        raise SchemaError(f"{where}{key}: expected {getattr(types, '__name__', types)}, got {type(v).__name__}")
    return v


def _array(m: dict, key: str, dtype: np.dtype, where: str) -> np.ndarray:
    raw = _need(m, key, bytes, where)
    if len(raw) % dtype.itemsize:
        raise SchemaError(f"{where}{key}: {len(raw)} bytes is not a whole number of {dtype.itemsize}-byte items")
    return np.frombuffer(raw, dtype=dtype).copy()


def _token_ids(m: dict, key: str, where: str) -> np.ndarray:
    """Token ids: int32, none negative (an embedding would index from its end, or fail,
    instead of refusing them; the run's vocabulary bounds them above, rlpipe/admission.py)."""
    ids = _array(m, key, I32, where)
    if len(ids) and ids.min() < 0:
        raise SchemaError(f"{where}{key}: negative token id")
    return ids


def _mask(s: dict, tokens: np.ndarray, logprobs: np.ndarray, where: str) -> np.ndarray:
    """A sample's loss mask, validated: one 0/1 per token, at least one model token, and a
    behavior log-prob of exactly 0 at every environment position (the schema's rule; a
    non-zero one there is the mark of a mask shifted against its tokens)."""
    mask = _array(s, "mask", U8, where)
    if len(mask) != len(tokens):
        raise SchemaError(f"{where}mask: {len(mask)} values for {len(tokens)} tokens")
    if np.any(mask > 1):
        raise SchemaError(f"{where}mask: values other than 0 (environment) and 1 (model)")
    if not mask.any():
        raise SchemaError(f"{where}mask: no model token (a sample must have at least one token to train)")
    off = np.flatnonzero((mask == 0) & (logprobs != 0))
    if len(off):
        raise SchemaError(f"{where}logprobs: {float(logprobs[off[0]])} at environment position {int(off[0])} "
                          f"(mask 0 carries log-prob 0)")
    return mask


ROUTING_KEYS = ("layers", "top_k", "experts")


EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # as MoE configs name it


def expert_count(config: dict) -> int:
    """The experts a layer of the model with this ``config.json`` has (0: a dense model)."""
    return next((v for k in EXPERT_COUNT_KEYS if isinstance(v := config.get(k), int) and v > 0), 0)


def route_dtype(experts: int) -> np.dtype:
    """The smallest unsigned integer that holds an expert id below ``experts``."""
    return U8 if experts <= 256 else U16


def _routing(m: dict) -> tuple[int, int, int] | None:
    """The group's routing shape, validated, or None when it carries no routes."""
    if "routing" not in m:
        return None
    r = _need(m, "routing", dict)
    if set(r) != set(ROUTING_KEYS):
        raise SchemaError(f"routing: expected the keys {list(ROUTING_KEYS)}, got {sorted(map(str, r))}")
    shape = tuple(_need(r, k, int, "routing.") for k in ROUTING_KEYS)
    layers, top_k, experts = shape
    if not (layers > 0 and 0 < top_k <= experts <= MAX_EXPERTS):
        raise SchemaError(f"routing: {dict(zip(ROUTING_KEYS, shape))} is not 0 < top_k <= experts <= {MAX_EXPERTS} "
                          f"with layers > 0")
    return shape


def _routes(s: dict, routing: tuple[int, int, int] | None, rows: int, where: str) -> np.ndarray | None:
    """A sample's expert ids, validated: one row of ``layers x top_k`` per forwarded token
    (``rows``), every id below ``experts``, no expert twice in a row's top-k."""
    if "routes" not in s:
        if routing is not None:
            raise SchemaError(f"{where}routes: missing, and the group's routing says its samples carry them")
        return None
    if routing is None:
        raise SchemaError(f"{where}routes: present without the group's routing (layers, top_k, experts)")
    layers, top_k, experts = routing
    ids = _array(s, "routes", route_dtype(experts), where)
    if len(ids) != rows * layers * top_k:
        raise SchemaError(f"{where}routes: {len(ids)} expert ids, expected {rows} forwarded tokens x {layers} layers "
                          f"x top_k {top_k} = {rows * layers * top_k}")
    ids = ids.reshape(rows, layers, top_k)
    if len(ids) and int(ids.max()) >= experts:
        raise SchemaError(f"{where}routes: expert id {int(ids.max())} is not below the routing's {experts} experts")
    if top_k > 1 and np.any(np.diff(np.sort(ids, axis=-1), axis=-1) == 0):
        raise SchemaError(f"{where}routes: an expert chosen twice in one token's top-k")
    return ids


def _sample(s, i: int, prompt_len: int, routing: tuple[int, int, int] | None, topk: int = 0) -> Sample:
    """Sample ``i`` of a group, validated (its routes against the group's ``routing``, its top-k
    against the group's ``sampler_topk``)."""
    where = f"samples[{i}]."
    if not isinstance(s, dict):
        raise SchemaError(f"samples[{i}]: expected map")
    tokens = _token_ids(s, "tokens", where)
    logprobs = _array(s, "logprobs", F32, where)
    if len(tokens) != len(logprobs):
        raise SchemaError(f"{where}logprobs: {len(logprobs)} values for {len(tokens)} tokens")
    if not np.all(np.isfinite(logprobs)) or np.any(logprobs > 1e-4):
        raise SchemaError(f"{where}logprobs: not finite non-positive log-probabilities")
    mask = _mask(s, tokens, logprobs, where) if "mask" in s else None
    versions = None
    if "versions" in s:
        versions = _array(s, "versions", I32, where)
        if len(versions) != len(tokens):
            raise SchemaError(f"{where}versions: {len(versions)} values for {len(tokens)} tokens")
    finish = _need(s, "finish_reason", str, where)
    if finish not in FINISH_REASONS:
        raise SchemaError(f"{where}finish_reason: {finish!r} not one of {FINISH_REASONS}")
    reward = _need(s, "reward", (int, float), where)
    problem = reward_problem(reward)
    info = s.get("reward_info")
    if info is not None:
        problem = problem or info_problem(info) or info_size_problem(info)
    if problem:
        raise SchemaError(f"{where}{problem}")
    routes = _routes(s, routing, prompt_len + len(tokens) - 1, where)
    try:
        topk_ids, topk_logprobs = sampler_topk.unpack(s, topk, len(tokens), where)
    except ValueError as e:
        raise SchemaError(str(e)) from None
    return Sample(tokens, logprobs, finish, float(reward), versions, info, mask, routes, topk_ids, topk_logprobs)


def decode_group(data: bytes) -> GroupRecord:
    """Parse and validate one stream entry's ``data`` field."""
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise SchemaError(f"not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(m, dict):
        raise SchemaError(f"top level: expected map, got {type(m).__name__}")
    schema = _need(m, "schema", int)
    if schema != SCHEMA_VERSION:
        raise SchemaError(f"schema: unknown version {schema}")
    precision = _need(m, "precision", str)
    if precision not in PRECISIONS:
        raise SchemaError(f"precision: {precision!r} not one of {PRECISIONS}")
    sampling = _need(m, "sampling", dict)
    unknown = set(sampling) - set(SAMPLING_KEYS)
    if unknown:
        raise SchemaError(f"sampling: unknown keys {sorted(unknown)}")
    v0 = _need(m, "policy_version", int)
    v1 = _need(m, "policy_version_end", int)
    if v0 < 0 or v1 < v0:
        raise SchemaError(f"policy_version_end: {v1} precedes policy_version {v0}")
    raw_samples = _need(m, "samples", list)
    if not raw_samples:
        raise SchemaError("samples: empty group")
    prompt_tokens = _token_ids(m, "prompt_tokens", "")
    if not len(prompt_tokens):
        raise SchemaError("prompt_tokens: empty prompt")
    routing = _routing(m)
    try:
        topk = sampler_topk.check_k(m.get("sampler_topk", 0))
    except ValueError as e:
        raise SchemaError(str(e)) from None
    samples = [_sample(s, i, len(prompt_tokens), routing, topk) for i, s in enumerate(raw_samples)]
    for key in ("prompt_index", "attempt"):
        if key in m and (isinstance(m[key], bool) or not isinstance(m[key], int) or m[key] < 0):
            raise SchemaError(f"{key}: expected a non-negative int, got {m[key]!r}")
    prompt_index, attempt = m.get("prompt_index", -1), m.get("attempt", 0)
    return GroupRecord(
        run_id=_need(m, "run_id", str),
        group_id=_need(m, "group_id", str),
        prompt_id=_need(m, "prompt_id", str),
        worker_id=_need(m, "worker_id", str),
        policy_version=v0,
        policy_version_end=v1,
        precision=precision,
        quant_profile=_need(m, "quant_profile", str),
        sampling=sampling,
        prompt_tokens=prompt_tokens,
        samples=samples,
        created_at=float(_need(m, "created_at", (int, float))),
        gen_seconds=float(_need(m, "gen_seconds", (int, float))),
        schema=schema,
        prompt_index=prompt_index,
        attempt=attempt,
        routing=routing,
        sampler_topk=topk,
    )
