"""When each fragment is sent, and the per-fragment counters sent with it
(docs/design.md, "Fragments and the schedule"; PROTOCOL.md "Learner contributions"
for the counters' meaning).

Step convention: `step` is the learner's number of *completed* inner steps; the
learner calls `fragments_due(step, ...)` right after inner step `step` (so the
first call has step = 1). Fragment p is due when

    step >= 1  and  (step - t_p) % H == 0,      t_p = floor(p * H / P)

so each fragment goes up exactly once every H steps, and its first send comes
after t_p steps (or after H steps when t_p = 0), never before the first step.
Offsets are distinct when P <= H and spread evenly over {0..H-1}; with P = H
exactly one fragment is due per step.

A decoupled learner may run this schedule shifted by a *schedule offset* o in
[0, H): it calls `fragments_due(step + o, ...)`. At start it picks the offset that
puts its sends in phase with the learners already running (`aligned_offset`, from
their heartbeats), so that learners of equal speed send each fragment at the same
time and the syncer merges them together without a grace wait.
"""

from __future__ import annotations

import cmath
import math
from typing import Iterable

from ddiloco_cli.errors import UsageError


def _check(num_fragments: int, sync_every: int) -> None:
    if num_fragments < 1:
        raise UsageError(f"--fragments must be >= 1, got {num_fragments}")
    if sync_every < 1:
        raise UsageError(f"--sync-every must be >= 1, got {sync_every}")


def fragments_due(step: int, *, num_fragments: int, sync_every: int) -> list[int]:
    """Fragments whose outer gradient is due after completed inner step `step`
    (ascending). Empty for step < 1."""
    _check(num_fragments, sync_every)
    if step < 1:
        return []
    phase = step % sync_every
    # Offsets are non-decreasing in p, so this is a short scan; P is small (<= ~1000).
    return [
        p
        for p in range(num_fragments)
        if (p * sync_every) // num_fragments == phase
    ]


def aligned_offset(own_step: int, phases: Iterable[float], *, sync_every: int) -> int:
    """The schedule offset in [0, H) that puts a learner about to take step ``own_step + 1``
    in phase with others whose schedules are now at ``phases`` (each its completed steps plus
    the fraction of the step under way plus its own offset, in steps). Their circular mean on
    the cycle of H steps; 0 with no one to follow, or when their phases cancel out."""
    H = sync_every
    turn = sum((cmath.exp(2j * math.pi * (ph % H) / H) for ph in phases), 0j)
    if abs(turn) < 1e-9:
        return 0
    mean = (cmath.phase(turn) / (2 * math.pi) * H) % H
    return int(round(mean - own_step)) % H


class FragmentCounters:
    """Per fragment: inner steps and tokens since the learner last received it.

    Call `on_step(num_tokens)` after every inner step, `snapshot(p)` when sending
    fragment p, `reset(p)` when a new version of p is merged into the model.
    """

    def __init__(self, num_fragments: int):
        assert num_fragments >= 1
        self.c_steps = [0] * num_fragments
        self.c_tokens = [0] * num_fragments

    @property
    def num_fragments(self) -> int:
        return len(self.c_steps)

    def on_step(self, num_tokens: int) -> None:
        assert num_tokens >= 0, num_tokens
        for p in range(self.num_fragments):
            self.c_steps[p] += 1
            self.c_tokens[p] += num_tokens

    def snapshot(self, p: int) -> tuple[int, int]:
        """(c_steps, c_tokens) of fragment p."""
        return self.c_steps[p], self.c_tokens[p]

    def reset(self, p: int, *, since: tuple[int, int] | None = None) -> None:
        """Restart fragment p's counts from zero, or, with ``since`` = a snapshot taken
        when p was sent, keep only what was counted after that snapshot (the learner
        keeps its progress of the overlap window on receive)."""
        steps, tokens = since if since is not None else (self.c_steps[p], self.c_tokens[p])
        self.c_steps[p] -= steps
        self.c_tokens[p] -= tokens
