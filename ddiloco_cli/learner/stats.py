"""A learner's counters, shared by the loop, the wrapper and its worker threads."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

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
    num_refused: int = 0  # own contributions the syncer's ledger refused (this session)
    last_refusal: str | None = None  # "fragment P seq N: reason" of the newest of them
    num_receives: int = 0  # versions folded in (this session)
    num_held: int = 0  # of those, versions lacking the contribution in flight ([L8]: held_alpha)
    uploads_failed: int = 0  # contributions given up (this session): not encodable, or the store's retries ran out
    versions: dict[int, int] = field(default_factory=dict)
    state: str = "running"
    lags: deque = field(default_factory=lambda: deque(maxlen=LAG_WINDOW))  # send -> receive, in steps

    def lag_quantiles(self) -> tuple[int, int] | None:
        """(p50, p95) of the recent send -> receive lags in steps, or None before the first receive."""
        if not self.lags:
            return None
        ordered = sorted(self.lags)
        return ordered[(len(ordered) - 1) // 2], ordered[min(len(ordered) - 1, (95 * len(ordered)) // 100)]
