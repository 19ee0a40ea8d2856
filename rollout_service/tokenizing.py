"""The API's text work, kept off the event loop: a text that cannot fit is refused from its
bytes before it is tokenized (``TokenBound``), and the rest is rendered and tokenized in a few
threads of the worker's own (``OffLoop``).

The worker's event loop serves every request, /healthz and the rollout loop's heartbeat. A
tokenizer call on it holds it for as long as the text takes: 48 concurrent 1 MB prompts, each
refused with a 409 once tokenized, froze it for 43 s and let the worker's registry entry expire
(issue 33 item 13); on this machine the toy model's tokenizer takes 4 to 15 s for 1 MB of
digits, one token per character.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np

log = logging.getLogger(__name__)

TOKENIZE_THREADS = 2  # threads a worker renders and tokenizes requests' text in (OffLoop)
# Characters outside ASCII the bound counts only if the tokenizer keeps each of them (a byte-level
# or byte-fallback vocabulary covers them all; one that drops or fuses unknown characters does not):
# Latin, Cyrillic, Arabic, CJK, a rare CJK radical, Yi, Deseret and an emoji.
NON_ASCII_PROBES = "éжا中\u2f00\ua000\U00010400\U0001f9ea"
# A normalizer may compose several characters outside ASCII into fewer bytes (NFC: at most 3 to 1,
# e.g. Hangul jamo, or a Greek letter with three marks); each of their bytes counts this much.
NON_ASCII_WEIGHT = 0.25


class TokenBound:
    """The fewest tokens a text can make, from its bytes alone, so a text that cannot fit is
    refused without being tokenized (tokenizing 1 MB takes seconds, the refusal microseconds).

    A token stands for at most ``per_token`` bytes: the longest piece of the vocabulary in
    UTF-8 (a byte-level piece is one character per byte, a SentencePiece ``▁`` three bytes for a
    space, so this is an upper bound for both). Every byte the tokenizer keeps is in some token,
    so a text of ``kept`` such bytes makes at least ``kept / per_token`` tokens. Which bytes it
    keeps is measured once, on runs of each ASCII character (and of ``NON_ASCII_PROBES``):
    kept if a run makes no unknown token and at least its length over ``per_token`` tokens. So
    a character the tokenizer drops (the toy's letters), folds into an unknown token or collapses
    in runs (whitespace, for some) counts for nothing, and bytes outside ASCII count only in a
    vocabulary that keeps every probe, at ``NON_ASCII_WEIGHT`` each. An ASCII character right
    before one outside ASCII counts for nothing either: a normalizer may compose the two into a
    character the tokenizer drops (NFC makes "=" and U+0338 one "≠", which the toy drops)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @functools.cached_property
    def measured(self) -> tuple[int, np.ndarray]:
        """``(per_token, weight of each byte value)``; every weight 0 (no bound) for a tokenizer
        this cannot measure."""
        weights = np.zeros(256, dtype=np.float64)
        try:
            per_token = max(len(piece.encode("utf-8", "surrogatepass")) for piece in self.tokenizer.get_vocab())
            unknown = getattr(self.tokenizer, "unk_token_id", None)
            run = 4 * per_token
            probes = [chr(c) * run for c in range(1, 128)] + [ch * run for ch in NON_ASCII_PROBES]
            backend = getattr(self.tokenizer, "backend_tokenizer", None)  # a fast tokenizer's own encoder
            encoded = [e.ids for e in backend.encode_batch(probes, add_special_tokens=False)] if backend else \
                self.tokenizer(probes, add_special_tokens=False)["input_ids"]
        except Exception as e:  # noqa: BLE001 - a tokenizer without a vocabulary: no bound, tokenized as before
            log.warning("no token bound for this tokenizer (%r): long texts are tokenized to be refused", e)
            return 1, weights

        def keeps(ids, text: str, weight: float) -> bool:
            return unknown not in ids and len(ids) * per_token >= weight * len(text.encode("utf-8"))

        for c, ids in zip(range(1, 128), encoded):
            weights[c] = keeps(ids, probes[c - 1], 1.0)
        if all(keeps(ids, text, NON_ASCII_WEIGHT) for ids, text in zip(encoded[127:], probes[127:])):
            weights[128:] = NON_ASCII_WEIGHT
        return per_token, weights

    def least(self, text: str) -> int:
        """At least how many tokens ``text`` makes (special tokens the tokenizer adds not counted)."""
        per_token, weights = self.measured
        data = np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8)
        kept = float(np.bincount(data, minlength=256) @ weights)
        before = data[:-1][data[1:] >= 0x80]  # the bytes right before one outside ASCII
        kept -= float(weights[before[before < 0x80]].sum())  # ASCII ones: perhaps composed with it
        return int(max(kept, 0.0) // per_token)

    def over(self, text: str, limit: int) -> str | None:
        """Why ``text`` makes more than ``limit`` tokens, known from its bytes alone; None if
        that takes tokenizing it."""
        least = self.least(text)
        if least <= limit:
            return None
        return (f"makes at least {least} tokens (by its {len(text.encode('utf-8', 'surrogatepass'))} bytes, at most "
                f"{self.measured[0]} a token; not tokenized)")


class OffLoop:
    """Runs text work (a chat template, a tokenizer) in ``threads`` threads of its own, off the
    event loop, which goes on serving meanwhile: a fast tokenizer lets go of the GIL while it
    encodes (transformers' call goes through ``encode_batch``), and a template's Python gives
    it up every few milliseconds. Work beyond the threads waits its turn, not on the event loop.
    ``threads=0``: on the caller's thread (the rollout loop's own episodes, tests)."""

    def __init__(self, threads: int = TOKENIZE_THREADS):
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="rlpipe-text") if threads else None

    async def __call__(self, fn, *args):
        if self.pool is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
