"""Receiving new global versions: the background ``Receiver`` that fetches and
decodes them, and ``receive_rule``, the pure function that folds one into the
learner's parameters."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ddiloco_cli.learner.stats import LearnerStats
from ddiloco_cli.protocol import ledger
from ddiloco_cli.protocol.fragments import landed
from ddiloco_cli.protocol.published import FragmentReader
from ddiloco_cli.store.base import NotFound, Store

log = logging.getLogger(__name__)

MAX_SCAN = 64  # manifests a receive looks through for refusals of this learner's contributions

Tensors = dict[str, torch.Tensor]


@dataclass
class InFlight:
    """A fragment sent and not yet received back."""

    receive_step: int  # step + tau: from here on the learner takes a newer version
    seq: int
    theta: Tensors  # the learner's fragment at the send
    counters: tuple[int, int]  # (c_steps, c_tokens) at the send
    wanted: bool = False  # registered with the Receiver (from step receive_step - 1 on)
    held: Ready | None = None  # a newer version that does not account for this send yet [L8]


def receive_rule(local: Tensors, new_global: Tensors, theta_at_send: Tensors, *, alpha: float,
                 keep_progress: bool) -> Tensors:
    """The learner's new fragment value after receiving ``new_global``:

        theta <- alpha * theta + (1 - alpha) * (Theta_new + progress)

    where progress = local - theta_at_send is what the overlap window trained after
    the send (dropped unless ``keep_progress``). Pure: the inputs are not modified.
    Every tensor is fp32 on one device; the arithmetic runs as one ``_foreach`` op
    per term, not a Python loop over tensors."""
    keys = list(local)
    news = [new_global[k] for k in keys]
    theta_at_send = landed(theta_at_send)  # a CUDA send's copies are over
    if keep_progress:
        progress = torch._foreach_sub([local[k] for k in keys], [theta_at_send[k] for k in keys])
        targets = torch._foreach_add(news, progress)
    else:
        targets = news
    if alpha == 0.0:
        return dict(zip(keys, targets))
    if alpha == 1.0:
        return {k: local[k].clone() for k in keys}
    out = torch._foreach_mul([local[k] for k in keys], alpha)
    torch._foreach_add_(out, targets, alpha=1.0 - alpha)
    return dict(zip(keys, out))


def difference(a: Tensors, b: Tensors, *, pin: bool = False) -> Tensors:
    """a - b per key of a (fp32 CPU), one ``_foreach`` op; with ``pin``, written into pinned
    memory (the same fp32 subtraction, so the same bits) for a non-blocking copy to a CUDA
    device (``ReceivePath._add_to_params``)."""
    keys = list(a)
    if not pin:
        return dict(zip(keys, torch._foreach_sub([a[k] for k in keys], [b[k] for k in keys])))
    out = {}
    for k in keys:
        out[k] = torch.sub(a[k], b[k], out=torch.empty(a[k].shape, dtype=a[k].dtype, pin_memory=True))
    return out


@dataclass(frozen=True)
class Ready:
    """A newer version of a fragment, downloaded and decoded."""

    version: int
    value: Tensors
    manifest: dict[str, Any]
    refused: list[dict[str, Any]]  # ledger entries refusing this learner's contributions, since the version it had
    increment: Tensors | None = None  # value - the ``subtract`` given to want(), computed off the main thread
    # the ``subtract`` it was computed with: a version that comes in after the fragment's next send
    # may carry the previous send's, and the receive path then computes it again
    subtracted: Tensors | None = None


def refusals(manifests: list[dict[str, Any]], learner_id: str) -> list[dict[str, Any]]:
    """The ledger entries in ``manifests`` that refuse a contribution of ``learner_id``."""
    return [c for m in manifests for c in m["contributions"]
            if c.get("status") == "refused" and c.get("learner_id") == learner_id]


class Receiver(threading.Thread):
    """Polls for newer committed versions of wanted fragments, downloads and decodes
    them (the main thread only copies ready values in).

    It polls only for fragments the loop registered (``want``: from step t + tau - 1
    on), in the order of their sends, each on its own schedule: the oldest one every
    ``pace_s()`` (the learner's step time: a version is only taken at a step boundary,
    so polling faster buys nothing; never faster than ``min_poll_s``), the others
    ``BACKLOG_SLOWDOWN`` times less often, and that again up to ``MAX_BACKOFF`` times
    less often while their polls find nothing. Versions come in the order of the sends:
    while the oldest wanted fragment has no new version the younger ones rarely have one,
    so a syncer that falls behind does not multiply the polls (each fragment is then
    polled about once it is the oldest); when one of the younger ones does have a version
    (several syncers, one of them behind), the younger ones go back to every
    ``BACKLOG_SLOWDOWN`` intervals. A fragment is polled at once when registered with
    nothing older waiting, else when it is due. A poll GETs the manifest of the version
    after the one held, and the ones after it until one is missing (``_newest``): a poll
    that finds nothing is one GET of a missing object (on a local store one failed
    ``open``, no parse), and the manifests a poll finds are the ones the delta chain and
    the refusal scan read next (the reader keeps them). Every ``LIST_EVERY``-th poll of a
    fragment LISTs its manifests instead, in case the versions after the one held were
    garbage-collected. The ``latest`` hint is not read: it would cost a GET and a parse
    on every poll, and one more manifest GET on every poll that finds a version.

    ``run`` (the thread) repeats ``tick``; a driver without threads (the deterministic
    simulation) calls ``tick`` itself, at the time it returns, on its own ``clock``."""

    LIST_EVERY = 8
    BACKLOG_SLOWDOWN = 4
    MAX_BACKOFF = 8  # the younger fragments' polls, at most this much rarer again while they find nothing

    def __init__(self, store: Store, readers: dict[int, FragmentReader], *, learner_id: str, min_poll_s: float,
                 stats: LearnerStats, pace_s: Callable[[], float] = lambda: 0.0,
                 clock: Callable[[], float] = time.monotonic, pin: bool = False,
                 on_ready: Callable[[int], None] | None = None):
        super().__init__(name="ddiloco-receiver", daemon=True)
        self.on_ready = on_ready  # called (on this thread) with a fragment once a version of it is ready
        self.clock = clock
        self.store, self.readers, self.min_poll_s, self.stats = store, readers, min_poll_s, stats
        self.learner_id = learner_id
        self.pace_s = pace_s
        self.pin = pin  # increments in pinned memory: a CUDA learner adds them without a stream sync
        self.lock = threading.Lock()
        self.wanted: dict[int, tuple[int, Tensors]] = {}  # fragment -> (have version, have value)
        self.subtract: dict[int, Tensors] = {}  # fragment -> what to subtract from its new value (see want)
        self.polled_t: dict[int, float] = {}  # fragment -> when it was last polled (monotonic)
        self.polls: dict[int, int] = {}  # fragment -> polls since it was registered
        self.order: dict[int, float] = {}  # fragment -> its place in line (the send's sequence number)
        self.backoff = 1  # the younger fragments are polled every BACKLOG_SLOWDOWN * backoff intervals
        self._next_order = 0
        self.ready: dict[int, Ready] = {}
        self.stopping = threading.Event()
        self.wake = threading.Event()
        self.num_polls = 0
        self.num_downloads = 0  # newer versions downloaded and decoded
        self.num_waits = 0  # times the thread went to sleep

    def want(self, p: int, have: tuple[int, Tensors], *, subtract: Tensors | None = None,
             blocking: bool = False, order: float | None = None) -> None:
        """Poll for a version of p newer than ``have`` = (version, value). With ``subtract``
        (the fragment at the send), the Ready also carries ``increment`` = new value -
        subtract, one ``_foreach`` op here rather than on the training thread. ``order``: p's
        place in line (the sequence number of its send; default: after every fragment
        registered so far). ``blocking``: the loop waits for p (lock-step), so p goes first."""
        with self.lock:
            self._next_order += 1
            self.order[p] = -math.inf if blocking else (self._next_order if order is None else order)
            self.wanted[p] = have
            if subtract is not None:
                self.subtract[p] = subtract
            else:
                self.subtract.pop(p, None)
            # at once when first in line (the download then overlaps the window's last step); a
            # fragment wanted again while its poll is pending keeps its clock: re-registered every
            # H steps, steps shorter than the poll interval would otherwise never let it come due
            waiting = self._waiting()
            first = not waiting or waiting[0] == p
            if first:
                self.polled_t[p] = -math.inf
            else:
                self.polled_t.setdefault(p, self.clock())
        if first:  # else the thread's next wake-up (for the first in line, due sooner) comes first
            self.wake.set()

    def has_ready(self, p: int) -> bool:
        """Whether a version of p is ready for ``take`` (a peek, without the lock)."""
        return p in self.ready

    def take(self, p: int) -> Ready | None:
        with self.lock:
            got = self.ready.pop(p, None)
            if got is not None:
                self.wanted.pop(p, None)
                self.subtract.pop(p, None)
                self.polled_t.pop(p, None)
                self.polls.pop(p, None)
                self.order.pop(p, None)
            return got

    def _waiting(self) -> list[int]:
        """Wanted fragments without a ready version, in line (under the lock)."""
        return sorted((p for p in self.wanted if p not in self.ready), key=self.order.__getitem__)

    def _due(self, now: float) -> tuple[list[tuple[int, tuple[int, Tensors], bool]], float | None]:
        """The wanted fragments due for a poll now (their next poll scheduled), each with
        whether it is a younger one (not first in line), and how long until the next one is
        due (None: nothing wanted)."""
        interval_s = max(self.min_poll_s, self.pace_s())
        due, next_t = [], None
        with self.lock:
            slow = self.BACKLOG_SLOWDOWN * self.backoff
            for i, p in enumerate(self._waiting()):
                every_s = interval_s * (1 if i == 0 else slow)
                due_t = self.polled_t[p] + every_s
                if due_t <= now:
                    due.append((p, self.wanted[p], i > 0))
                    self.polled_t[p] = now
                    due_t = now + every_s
                next_t = due_t if next_t is None else min(next_t, due_t)
        return due, None if next_t is None else max(0.0, next_t - now)

    def _polled(self, younger: bool, found: bool) -> None:
        """After a poll: a younger fragment's poll that found nothing makes the next ones rarer
        (up to MAX_BACKOFF); one that found a version brings them back (out-of-order versions)."""
        if younger:
            with self.lock:
                self.backoff = 1 if found else min(self.MAX_BACKOFF, 2 * self.backoff)

    def run(self) -> None:
        while not self.stopping.is_set():
            self.wake.clear()  # before looking: a want() from now on ends the wait below
            polled, wait_s = self.tick()
            if not polled:  # nothing wanted (wait_s None: until the loop registers a fragment), or not yet due
                self.num_waits += 1
                self.wake.wait(wait_s)

    def tick(self) -> tuple[bool, float | None]:
        """Poll every wanted fragment that is due now (downloading the newer versions found).
        Returns (whether any was polled, seconds until the next one is due; None: nothing
        wanted)."""
        due, wait_s = self._due(self.clock())
        for p, have, younger in due:
            try:
                found = self._fetch(p, have)
            except Exception as exc:  # noqa: BLE001 - never stop training over a bad download
                log.warning("fragment %d: download failed: %s", p, exc)
                found = True  # there is a version (or the bucket is in trouble): keep polling as often
            self._polled(younger, found)
        return bool(due), wait_s

    def _fetch(self, p: int, have: tuple[int, Tensors]) -> bool:
        """Poll p; when a newer version is there, download and decode it. Returns whether
        there was one."""
        # the manifests after the one held (a GET each); a LIST now and then, in case those were collected
        self.num_polls += 1
        with self.lock:
            self.polls[p] = n = self.polls.get(p, 0) + 1
        reader = self.readers[p]
        latest = self._newest(p, reader, have[0]) if n % self.LIST_EVERY else ledger.latest_version(self.store, p)
        if latest is None or latest <= have[0]:
            return False
        self.num_downloads += 1
        before = reader.bytes_down
        value = reader.read(latest, have=have)
        refused = refusals(self._manifests_since(reader, have[0], latest), self.learner_id)
        self.stats.bytes_down += reader.bytes_down - before
        with self.lock:
            subtract = self.subtract.get(p)
        increment = None
        if subtract is not None:
            increment = difference(value, landed(subtract), pin=self.pin)
        with self.lock:
            ready = p in self.wanted
            if ready:
                self.ready[p] = Ready(latest, value, reader.manifest(latest), refused, increment, subtract)
        if ready and self.on_ready is not None:
            self.on_ready(p)
        return True

    def _newest(self, p: int, reader: FragmentReader, have: int) -> int | None:
        """The newest version of p above ``have`` whose manifest GETs (each read, validated and
        kept by the reader), or None when the next one is missing. Versions are contiguous
        [Commit], so the first missing manifest ends the scan; after MAX_SCAN found, a LIST
        says how far they go."""
        v = have
        while v - have < MAX_SCAN:
            try:
                reader.manifest(v + 1)
            except NotFound:
                return v if v > have else None
            v += 1
        return ledger.latest_version(self.store, p)

    @staticmethod
    def _manifests_since(reader: FragmentReader, have: int, latest: int) -> list[dict[str, Any]]:
        """Manifests (have, latest], the newest MAX_SCAN of them; gone ones are skipped.
        The reader caches them: those a delta chain needed cost nothing more."""
        out = []
        for v in range(max(have + 1, latest - MAX_SCAN + 1), latest + 1):
            try:
                out.append(reader.manifest(v))
            except NotFound:
                continue
        return out

    def close(self) -> None:
        self.stopping.set()
        self.wake.set()
        if self.is_alive():
            self.join(timeout=10)
