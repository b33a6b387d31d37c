"""A learner's counters, shared by the loop, the wrapper and its worker threads."""

from __future__ import annotations

from dataclasses import dataclass, field


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
