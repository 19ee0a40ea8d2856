"""Numbers read back from Redis, checked.

Whoever can write to Redis can put anything in a hash rlpipe reads: ``step abc`` in the
learner hash made ``rlpipe up`` crash after it had stopped every role, and
``fleet_desired_workers nan`` did the same under ``--autoscale``. A value that does not parse
as a finite number within its range is replaced by a safe default, with a warning (once per
field and value, so a supervisor that reads it twice a second does not flood its log).
"""

from __future__ import annotations

import logging
import math

log = logging.getLogger(__name__)

_warned: set[tuple[str, str]] = set()


def number(raw, what: str, default, kind: type = int, low: float | None = None, high: float | None = None):
    """``raw`` (bytes, str or None, as Redis returns it) as a finite ``kind`` (int or float)
    within ``low``..``high``; otherwise ``default``. A missing or empty value is ``default``
    without a warning: a field not written yet. An int may be written as an integral float
    (``3.0``)."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else "" if raw is None else str(raw)
    if not text:
        return default
    value = _parse(text, kind)
    if value is None or (low is not None and value < low) or (high is not None and value > high):
        if (what, text) not in _warned and len(_warned) < 1000:  # (a flood of distinct values: the first 1000)
            _warned.add((what, text))
            bounds = "" if low is None and high is None else \
                f" in {'-inf' if low is None else low}..{'inf' if high is None else high}"
            log.warning("%s: %r read back from Redis is not a finite %s%s; using %r instead", what, text[:80],
                        kind.__name__, bounds, default)
        return default
    return value


def _parse(text: str, kind: type):
    if kind is int:
        try:
            return int(text)
        except ValueError:
            pass
    try:
        value = float(text)
    except ValueError:
        return None
    if not math.isfinite(value):
        return None
    if kind is int:
        return int(value) if value.is_integer() else None
    return value
