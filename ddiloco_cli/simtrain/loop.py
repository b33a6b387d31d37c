"""The seeded, single-threaded event loop and the turn clocks of its actors.

Every actor (a learner's training loop, its upload workers, its receiver and heartbeat,
the syncer) runs in *turns*: the loop pops the earliest event, sets the virtual time
``now`` and calls it; the turn runs the real ddiloco code to completion, charging what
its I/O would cost to the actor's ``TurnClock`` (``spent``); the actor then schedules
its next turn at ``now + spent + wait``. Ties are broken by insertion order, so the
whole run is a function of the scenario and the seed.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable

from ddiloco_cli.clock import VIRTUAL_EPOCH_S


class SimCrash(BaseException):
    """Raised inside an actor's turn to kill that actor at an injected crash point
    (``crash.CrashPlan``): the loop calls ``kill`` and goes on with the other actors. A
    BaseException, as a SIGKILL is: no ``except Exception`` in the real code may survive it."""

    def __init__(self, what: str, kill: Callable[[], None]):
        super().__init__(what)
        self.kill = kill


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._order = itertools.count()
        self.num_events = 0
        self.crashes: list[tuple[float, str]] = []

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` at virtual time ``t`` (never before now)."""
        heapq.heappush(self._heap, (max(t, self.now), next(self._order), fn, args))

    def run(self, *, done: Callable[[], bool], limit_s: float = float("inf")) -> None:
        """Run events in time order until ``done()`` or nothing is left or time passes ``limit_s``."""
        while self._heap and not done():
            t, _, fn, args = heapq.heappop(self._heap)
            if t > limit_s:
                heapq.heappush(self._heap, (t, next(self._order), fn, args))
                return
            self.now = t
            self.num_events += 1
            try:
                fn(*args)
            except SimCrash as crash:
                self.crashes.append((t, str(crash)))
                crash.kill()


class TurnClock:
    """One actor's view of virtual time (a ``ddiloco_cli.clock.Clock``): the loop's ``now``
    plus what the actor's current turn has spent so far. ``sleep`` spends; so does every
    store request the actor makes (``bucket.SimStore``)."""

    def __init__(self, loop: EventLoop):
        self.loop = loop
        self.spent = 0.0

    def begin(self) -> None:
        """A new turn starts at the loop's now."""
        self.spent = 0.0

    def monotonic(self) -> float:
        return self.loop.now + self.spent

    def time(self) -> float:
        return VIRTUAL_EPOCH_S + self.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self.spent += seconds


class Timer:
    """A re-armable wake-up for one actor: ``arm(t)`` schedules ``fn`` at t unless an
    earlier wake-up is pending; stale wake-ups (superseded, or after ``cancel``) are
    dropped when they fire."""

    def __init__(self, loop: EventLoop, fn: Callable[[], None]):
        self.loop, self.fn = loop, fn
        self.next_t: float | None = None
        self._gen = 0

    def arm(self, t: float, *, earlier_only: bool = True) -> None:
        t = max(t, self.loop.now)
        if earlier_only and self.next_t is not None and self.next_t <= t:
            return
        self._gen += 1
        self.next_t = t
        self.loop.at(t, self._fire, self._gen)

    def cancel(self) -> None:
        self._gen += 1
        self.next_t = None

    def _fire(self, gen: int) -> None:
        if gen != self._gen:
            return
        self.next_t = None
        self.fn()
