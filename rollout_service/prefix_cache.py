"""Which requests may share vLLM's prefix cache across weight updates: the salt.

vLLM keys a cached block by its tokens and, for a request's first block, by the request's
``cache_salt``; every later block's key chains on the one before it, so two requests share
cached KV only when their salts are equal. The engine salts each request with the weights it
started on (a new salt at every load), so a request started after an update never reads KV
the old weights computed, while requests of one version (a group's ``n`` samples, the same
prompt asked again) still share theirs. A session (a multi-turn episode, an answer paused
for a tool) keeps the salt its first request started with, so each turn reads the KV of the
turns before it instead of forwarding the whole history again.

This replaces resetting the cache at each update, which vLLM refuses while any request holds
blocks (it always does under in-flight updates), after which new requests read the old
weights' KV. What a request may read is KV computed no earlier than its own start (its
session's): requests in flight at an update go on over the KV they have, as before, and a
request still queued then, or a session's later turn, forwards its new tokens with the new
weights over that older prefix; each sampled token records the weights it was sampled with.
"""

from __future__ import annotations


class CacheSalts:
    """The salt of the weights in the engine: a new one at each load. It counts loads rather
    than naming the version, because a version number can come back with other weights (a
    learner restarted from an older checkpoint sends its next versions again)."""

    def __init__(self) -> None:
        self.loads = 0
        self.current = "w0"

    def loaded(self, version: int) -> None:
        """New weights (``version``) are in the engine: requests from now on get a new salt."""
        self.loads += 1
        self.current = f"w{self.loads}-v{version}"
