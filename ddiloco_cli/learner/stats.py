"""A learner's counters, shared by the loop, the wrapper and its worker threads."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

LAG_WINDOW = 64  # the receives the lag quantiles of the heartbeat and `status` cover
# the counters the uploader and receiver keep: an io helper process reports them (``ioproc``)
WORKER_COUNTERS = ("bytes_up", "bytes_down", "num_contributions", "uploads_failed")


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


def threads_cpu_s(threads: Iterable[threading.Thread]) -> float | None:
    """CPU seconds of the live threads among ``threads``, read from their own CPU clocks by the
    calling thread (nothing runs in them); None where the platform has no such clocks."""
    clock_of = getattr(time, "pthread_getcpuclockid", None)
    if clock_of is None:
        return None
    total = 0.0
    for t in threads:
        if t.ident is None or not t.is_alive():
            continue
        try:
            total += time.clock_gettime(clock_of(t.ident))
        except OSError:  # it ended in between
            continue
    return total


class CostMeter:
    """What ddiloco itself costs a learner per inner step, as its heartbeat reports it, each the
    mean over the steps since the previous report: ``sync_step_ms``, the training thread's wall
    time inside ``DiLoCoSync.step`` (the sends' snapshots and outer gradients, the receives'
    adds, the bookkeeping; with the waits in it: a device's copies, a worker thread that took
    the core or the GIL), ``sync_step_cpu_ms``, that thread's CPU time in it, and
    ``sync_worker_cpu_ms``, the CPU of ddiloco's worker threads (encoding and uploads, polls and
    decoding, heartbeats) and of the thread that makes an S3 or GCS bucket's requests for them
    (``store.base.io_threads``)."""

    def __init__(self) -> None:
        # added to by the training thread, read by the heartbeat thread
        self.in_step_s = 0.0
        self.in_step_cpu_s = 0.0
        self._last: tuple[int, float, float, float | None] | None = None
        self._fields: dict[str, float] = {}

    def fields(self, step: int, workers: Iterable[threading.Thread], *,
               extra_cpu_s: float | None = None) -> dict[str, float]:
        """The heartbeat's fields at ``step`` (none before two reports). The last report's again
        when no step was made since, or when a worker thread has ended (the heartbeat written
        on leaving comes after the worker threads stop: their clocks are gone)."""
        workers = list(workers)
        if any(not t.is_alive() for t in workers):
            return dict(self._fields)
        cpu = threads_cpu_s(workers)
        if cpu is not None and extra_cpu_s is not None:
            cpu += extra_cpu_s  # the CPU of a helper process doing the workers' job (``ioproc``)
        now = (step, self.in_step_s, self.in_step_cpu_s, cpu)
        last, self._last = self._last, now
        if last is not None and step > last[0]:
            n = step - last[0]

            def per_step(i: int) -> float:
                return round(1e3 * max(0.0, now[i] - last[i]) / n, 4)

            fields = {"sync_step_ms": per_step(1), "sync_step_cpu_ms": per_step(2)}
            if now[3] is not None and last[3] is not None:
                fields["sync_worker_cpu_ms"] = per_step(3)
            self._fields = fields
        return dict(self._fields)

    @property
    def last(self) -> dict[str, float]:
        """The fields of the latest report (empty before two)."""
        return dict(self._fields)
