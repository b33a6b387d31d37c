"""What a learner reports about itself across sessions and to its operator: when its
first session started (carried in its heartbeat, ``first_started``, so that goodput
counts from it after a restart); the resume line, the plain progress line (with
tokens/s) and the one-line summary at the end. The terminal's live bar is
``ddiloco_cli.cli.live.learner_view``."""

from __future__ import annotations

import logging
from typing import Any

from ddiloco_cli.learner.stats import LearnerStats

log = logging.getLogger("ddiloco_cli.learner")


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


def log_resume(resume: dict[str, Any] | None, *, start: int, batch_size: int, with_state: bool) -> None:
    """Say where a restarted learner's data stream continues (nothing on a first start)."""
    if start > 0:
        log.info("continuing the data stream from example %s (batch %s of this shard)",
                 f"{start * batch_size:,}", f"{start:,}")
    elif with_state and resume and resume.get("state") is not None:
        log.info("continuing the data stream from the task's saved iterator state")


def log_step(step: int, stats: LearnerStats, *, lr: float, tokens_per_step: int,
             ddiloco_share: float | None = None) -> None:
    """The plain progress line (every log_every steps); ``ddiloco_share``: ddiloco's own share of
    a step as the heartbeat measured it (`status` column ``ddiloco``), when known."""
    tok_s = tokens_per_step / stats.step_time_s if stats.step_time_s > 0 else 0.0
    log.info("step %d loss %.4f lr %.2e %.1f ms/step %s tok/s up %.1f MB down %.1f MB%s", step, stats.loss, lr,
             stats.step_time_s * 1e3, f"{tok_s:,.0f}", stats.bytes_up / 1e6, stats.bytes_down / 1e6,
             "" if ddiloco_share is None else f" ddiloco {ddiloco_share:.1%} of a step")


# learn's stop reasons as the summary says them ("steps": this session's --steps were done)
_REASONS = {"steps": "this session's --steps done", "left": "left (SIGTERM)"}


def summary(learner_id: str, reason: str, stats: LearnerStats | None, *, first_step: int | None = None) -> str:
    """One line for the end of a session: why it ended, steps, tokens, contributions
    sent and refused by the syncer, bytes up and down."""
    reason = _REASONS.get(reason, reason)
    if stats is None:
        return f"learner {learner_id}: {reason}"
    steps = f"step {stats.step:,}" if first_step is None else f"steps {first_step:,}->{stats.step:,}"
    return (f"learner {learner_id}: {reason}; {steps}, {stats.tokens:,} tokens, {stats.num_contributions:,} "
            f"contributions sent, {stats.num_refused:,} refused, up {stats.bytes_up / 1e6:.1f} MB, "
            f"down {stats.bytes_down / 1e6:.1f} MB")


__all__ = ["first_started", "log_resume", "log_step", "summary"]
