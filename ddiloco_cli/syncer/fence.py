"""Fencing of every write a syncer makes (PROTOCOL.md, "Fencing and leases", [F5]).

A syncer paused past its lease (GC, SIGSTOP, a suspended VM) may resume after a
standby claimed a higher epoch for its fragments. ``FencedStore`` wraps the
store a syncer writes through. Before every write of any kind (``put``,
``put_if_absent``, ``delete``) it checks the fence: is there an epoch above its
own whose fragments overlap its own? It checks at most every ``interval_s``
(the injected clock's monotonic time) and always right before creating a manifest. Once fenced it
raises ``FencedError`` for every later write without touching the bucket, so a
fenced syncer writes nothing: no quarantine report, heartbeat, checkpoint or
manifest.

Why an interval below the lease is enough: a standby claims only after the
owner's heartbeat is ``lease_s`` old by the store's clock, and the owner writes
that heartbeat through this wrapper. So any pause long enough to lose the lease
also exceeds ``interval_s``, and the first write after it checks the fence. The
only write that can slip through is one whose check passed just before a pause
(the known window, PROTOCOL.md "Known limitations").
"""

from __future__ import annotations

import logging
import math

from ddiloco_cli.clock import WALL, Clock
from ddiloco_cli.errors import FencedError
from ddiloco_cli.protocol import layout, ledger
from ddiloco_cli.protocol.records import NewerProtocolError
from ddiloco_cli.protocol.signing import Trust
from ddiloco_cli.store.base import ObjectInfo, Store, StoreWrapper

log = logging.getLogger(__name__)


def fence_interval_s(lease_s: float) -> float:
    """How often (at most) a serving syncer re-checks the fence before a write: well
    inside its lease, and at least once a second."""
    return min(1.0, lease_s / 4)


class FencedStore(StoreWrapper):
    """A Store that checks the fence of ``epoch`` before each write (see module doc).
    Reads pass through unchecked.

    A syncer builds one at start, unarmed (``epoch`` None: its writes pass, the only one
    being its epoch claim), and every part of it reads and writes through that one object;
    ``Lease.acquire`` arms it with the claimed epoch (``arm``), from then on for good."""

    def __init__(self, inner: Store, *, run_id: str, interval_s: float, epoch: ledger.Epoch | None = None,
                 trust: Trust | None = None, clock: Clock = WALL):
        super().__init__(inner)
        self.clock = clock
        self.trust = trust  # in a run that requires signatures, an unsigned epoch fences nobody
        self.run_id = run_id
        self.epoch = epoch
        self.interval_s = interval_s
        self._checked_t = -math.inf
        self._fenced: FencedError | None = None
        self._harmless: set[int] = set()  # epochs above ours that are invalid, foreign or disjoint

    def arm(self, epoch: ledger.Epoch) -> None:
        """Check every later write against ``epoch`` (the one this syncer claimed)."""
        assert self.epoch is None or self.epoch == epoch, "armed already, with another epoch"
        self.epoch = epoch
        self._checked_t = -math.inf

    # -------------------------------------------------------------- the fence
    def check_fence(self) -> None:
        """Raise FencedError if an epoch above ours overlaps our fragments (then for good).

        One LIST of the epochs, plus one GET per epoch key above ours not seen before.
        A claim above ours written by a newer protocol fences too: a newer syncer runs.
        """
        if self._fenced is not None:
            raise self._fenced
        assert self.epoch is not None, "claim an epoch (Lease.acquire) first"
        mine = self.epoch
        for n, _ in ledger.listed_epochs(self.inner):
            if n <= mine.epoch or n in self._harmless:
                continue
            try:
                other = ledger.read_epoch(self.inner, n, run_id=self.run_id, trust=self.trust)
            except NewerProtocolError as exc:
                self._fence(f"epoch {n} was claimed by a newer ddiloco ({exc}); this syncer (epoch {mine.epoch}) stops")
            if other is None or not other.fragments & mine.fragments:
                self._harmless.add(n)
                continue
            self._fence(f"epoch {n} ({other.syncer_id}) took over fragments {sorted(other.fragments & mine.fragments)}; "
                        f"this syncer (epoch {mine.epoch}) stops")
        self._checked_t = self.clock.monotonic()

    @property
    def fenced(self) -> bool:
        return self._fenced is not None

    def _fence(self, message: str) -> None:
        self._fenced = FencedError(message)
        log.error("%s", message)
        raise self._fenced

    def _before_write(self, key: str) -> None:
        if self._fenced is not None:
            raise self._fenced
        if self.epoch is None:  # unarmed: no epoch claimed yet, nothing to be fenced from
            return
        kind = layout.key_kind(key)
        if (kind is not None and kind[0] == "manifests") or self.clock.monotonic() - self._checked_t >= self.interval_s:
            self.check_fence()

    # ------------------------------------------------------------ the writes
    def put_if_absent(self, key: str, data: bytes) -> bool:
        self._before_write(key)
        return self.inner.put_if_absent(key, data)

    def put(self, key: str, data: bytes) -> None:
        self._before_write(key)
        self.inner.put(key, data)

    def delete(self, key: str) -> None:
        self._before_write(key)
        self.inner.delete(key)

    def remove_stale_temp(self, *, older_than_s: float, dry_run: bool = False) -> list[ObjectInfo]:
        if not dry_run:
            self._before_write(layout.CLOCK_PREFIX)
        return self.inner.remove_stale_temp(older_than_s=older_than_s, dry_run=dry_run)
