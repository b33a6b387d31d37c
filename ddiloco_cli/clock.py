"""Time as an injected dependency: the seam between ddiloco's logic and its drivers.

Logic modules (the syncer's decisions, the learner's schedule and receive rule, leases,
fences) take a ``Clock`` instead of calling ``time.time()``, ``time.monotonic()`` or
``time.sleep()``. Production drivers pass ``WALL`` (threads and wall time); the
deterministic simulation passes a ``VirtualClock`` that a seeded, single-threaded event
loop advances, so a run repeats to the bit whatever the host's load.

Contract of a clock:

* ``time()``: seconds since the epoch, for what is written into records (``created_s``,
  heartbeats). Only ordering and differences against other records' times matter.
* ``monotonic()``: seconds on a clock that never goes back, for intervals and deadlines.
* ``sleep(seconds)``: wait. A virtual clock advances itself instead; a driver that runs
  many actors on one virtual clock schedules them rather than letting logic sleep.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float: ...

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class WallClock:
    """The host's clocks: what every production driver uses."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


WALL = WallClock()

# a virtual epoch far from 0, so virtual record times look like real ones (2026-01-01 UTC)
VIRTUAL_EPOCH_S = 1_767_225_600.0


class VirtualClock:
    """A clock that moves only when told: ``advance``/``advance_to`` by an event loop, or
    ``sleep`` by the one actor that owns it. ``time()`` and ``monotonic()`` read the same
    virtual instant (``time()`` offset by ``VIRTUAL_EPOCH_S``)."""

    def __init__(self, start_s: float = 0.0):
        self._now_s = float(start_s)

    def time(self) -> float:
        return VIRTUAL_EPOCH_S + self._now_s

    def monotonic(self) -> float:
        return self._now_s

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._now_s += seconds

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, seconds
        self._now_s += seconds

    def advance_to(self, t_s: float) -> None:
        """Move to virtual instant ``t_s`` (never backwards)."""
        assert t_s >= self._now_s, (t_s, self._now_s)
        self._now_s = t_s
