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
"""

from __future__ import annotations

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
