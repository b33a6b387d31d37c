"""A learner's counters, shared by the loop, the wrapper and its worker threads; and how
those worker threads ask the scheduler to let the training thread run (``background_thread``)."""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# "batch": the learner's worker threads run as SCHED_BATCH (see background_thread); "normal" (the
# default): as the training thread. Opt-in until an A/B on a quiet machine shows it pays (docs/results.md)
BACKGROUND_SCHED_ENV = "DDILOCO_BACKGROUND_SCHED"
LAG_WINDOW = 64  # the receives the lag quantiles of the heartbeat and `status` cover


@dataclass
class LearnerStats:
    step: int = 0
    tokens: int = 0
    loss: float | None = None
    step_time_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    num_contributions: int = 0
    blocked_s: float = 0.0
    num_refused: int = 0  # own contributions the syncer's ledger refused
    versions: dict[int, int] = field(default_factory=dict)
    state: str = "running"
    lags: deque = field(default_factory=lambda: deque(maxlen=LAG_WINDOW))  # send -> receive, in steps

    def lag_quantiles(self) -> tuple[int, int] | None:
        """(p50, p95) of the recent send -> receive lags in steps, or None before the first receive."""
        if not self.lags:
            return None
        ordered = sorted(self.lags)
        return ordered[(len(ordered) - 1) // 2], ordered[min(len(ordered) - 1, (95 * len(ordered)) // 100)]


def background_thread() -> str:
    """Called first in each of the learner's worker threads (uploader, receiver, heartbeat): with
    ``$DDILOCO_BACKGROUND_SCHED=batch``, on Linux, it makes the calling thread SCHED_BATCH. Such a
    thread gets the same share of the CPU as before (its nice value is kept), but its wake-ups (a queued contribution, a poll timer,
    the GIL handed back) no longer preempt the training thread on a busy core: it runs when the
    scheduler's tick gives it its turn. On a learner with fewer cores than busy threads each of
    those preemptions cost the training step cache refills and a context switch (docs/results.md,
    "Learner overhead": it cut the training thread's preemptions, but no gain in CPU or wall
    time per step could be shown on the shared development machine). Nothing the threads compute
    changes. Returns the policy now in force ("batch" or "normal"); by default the thread is left
    as it is."""
    if os.environ.get(BACKGROUND_SCHED_ENV, "normal") != "batch" or not hasattr(os, "SCHED_BATCH"):
        return "normal"
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # 0: the calling thread only
    except OSError as exc:  # not allowed here (a seccomp profile): the thread runs as it was
        log.debug("SCHED_BATCH refused: %s", exc)
        return "normal"
    return "batch"
