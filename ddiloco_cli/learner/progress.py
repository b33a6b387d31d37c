"""What a learner reports about itself across sessions and to its operator: when its
first session started (carried in its heartbeat, ``first_started``, so that goodput
counts from it after a restart)."""

from __future__ import annotations

from typing import Any


def first_started(held: Any, *, now_s: float) -> float:
    """When this learner id's first session started, on this session's clock (``now_s``
    is this session's start on it). ``held`` is the previous session's heartbeat and its
    age by the store's clock (``session.HeldBy``) or None: its first start lay
    ``time_s - first_started_s`` (its own clock, or ``started_s`` for an older heartbeat)
    before it was written, which was ``age_s`` ago. Without a usable record: ``now_s``."""
    if held is None:
        return now_s
    rec = held.record
    first, written = rec.get("first_started_s", rec.get("started_s")), rec.get("time_s")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (first, written)):
        return now_s
    before_s = float(written) - float(first)
    if not 0.0 <= before_s < 1e9 or not 0.0 <= float(held.age_s) < 1e9:
        return now_s
    return now_s - float(held.age_s) - before_s


__all__ = ["first_started"]
