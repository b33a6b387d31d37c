"""The syncer's lease on its fragments: claim, heartbeat, fence check, pre-commit check.

PROTOCOL.md "Fencing and leases". A syncer stands by while another epoch over
its fragments is serving with a fresh heartbeat (judged by the store's clock),
then claims the next epoch create-only. The lease works on the syncer's one
``fence.FencedStore``, and arms it with the claimed epoch: from then on every write
checks the fence, and halts the syncer (``FencedError``) as soon as a higher epoch
overlaps its fragments; the lease heartbeats every ``heartbeat_s`` through it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ddiloco_cli.clock import WALL, Clock
from ddiloco_cli.errors import ProtocolError
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.protocol.runconfig import RunConfig
from ddiloco_cli.protocol.signing import Signer, Trust
from ddiloco_cli.protocol.typed_records import SyncerHeartbeat
from ddiloco_cli.store.base import NotFound
from ddiloco_cli.syncer.fence import FencedStore

log = logging.getLogger(__name__)


class Lease:
    """One syncer's claim on a set of fragments. ``epoch`` is None until ``acquire`` succeeds."""

    def __init__(self, store: FencedStore, *, config: RunConfig, syncer_id: str, fragments: list[int],
                 trust: Trust | None = None, signer: Signer | None = None, clock: Clock = WALL):
        self.store = store
        self.clock = clock
        self.trust = trust  # signed runs: only admitted syncers' epochs count [A5]
        self.signer = signer
        self.run_id = config.run_id
        self.lease_s = config.lease_s
        self.heartbeat_s = config.heartbeat_s
        self.syncer_id = syncer_id
        self.fragments = fragments
        self.epoch: ledger.Epoch | None = None
        self.last_fence_check_t = -float("inf")
        self._last_beat_t = -float("inf")

    def acquire(self, *, stop: Callable[[], bool] = lambda: False, wait: bool = True) -> bool:
        """Stand by until the fragments' lease is free or expired, then claim the next epoch.
        Returns False when ``stop`` said so first, or (``wait=False``) when the lease is held
        now: a driver stepping the syncer tries again later instead of sleeping here."""
        announced = None
        while not stop():
            holder = self.holder()
            if holder is not None:
                if announced != holder[0].epoch:
                    log.info("standing by: epoch %d (%s) holds the lease (heartbeat %.1fs ago, lease %.0fs)",
                             holder[0].epoch, holder[0].syncer_id, holder[1], self.lease_s)
                    announced = holder[0].epoch
                if not wait:
                    return False
                self.clock.sleep(self.standby_poll_s())
                continue
            self.epoch = ledger.claim_epoch(self.store, run_id=self.run_id, syncer_id=self.syncer_id,
                                            fragments=self.fragments, created_s=self.clock.time(), stop=stop,
                                            signer=self.signer)
            if self.epoch is None:
                return False
            self.store.arm(self.epoch)
            return True
        return False

    def standby_poll_s(self) -> float:
        """How often a standby looks at the lease again."""
        return min(1.0, self.heartbeat_s)

    def holder(self) -> tuple[ledger.Epoch, float] | None:
        """The epoch holding the fragments' lease now and its heartbeat's age (store clock),
        or None when the lease is free: no owner, a stopped owner, or an expired heartbeat."""
        owner = ledger.current_owner(self.store, run_id=self.run_id, fragments=self.fragments, trust=self.trust)
        if owner is None:
            return None
        age = ledger.syncer_heartbeat_age(self.store, owner.epoch)
        if age is None:
            infos = self.store.list(layout.epoch_key(owner.epoch))
            age = self.store.now() - infos[0].mtime_s if infos else self.lease_s + 1
        state = self._owner_state(owner.epoch)
        if state in ("serving", None) and age <= self.lease_s:  # a stopped owner frees the lease at once
            return owner, age
        return None

    def _owner_state(self, epoch: int) -> str | None:
        try:
            rec = records.loads(self.store.get(layout.syncer_heartbeat_key(epoch)), "syncer_heartbeat", where="heartbeat")
            return SyncerHeartbeat.from_json(rec).state
        except (NotFound, ProtocolError):
            return None

    def check_fence(self) -> None:
        """Raise FencedError if a higher epoch overlapping our fragments exists [F1]."""
        assert self.epoch is not None, "acquire first"
        self.store.check_fence()
        self.last_fence_check_t = self.clock.monotonic()

    def fence_due(self) -> bool:
        """Whether the periodic fence check is due [F3]: every max(1 s, heartbeat_s)."""
        return self.clock.monotonic() - self.last_fence_check_t > max(1.0, self.heartbeat_s)

    def before_commit(self, beat: Callable[[], None]) -> None:
        """The pre-commit check [F3]: a pause (GC, SIGSTOP, preemption) longer than half a
        lease since the last fence check may have let a standby take over."""
        if self.clock.monotonic() - self.last_fence_check_t > self.lease_s / 2:
            self.check_fence()
            beat()

    def beat_due(self) -> bool:
        return self.clock.monotonic() - self._last_beat_t >= self.heartbeat_s

    def write_heartbeat(self, **fields: Any) -> None:
        """Overwrite this epoch's heartbeat (its mtime is the lease clock)."""
        assert self.epoch is not None
        rec = SyncerHeartbeat(epoch=self.epoch.epoch, syncer_id=self.syncer_id, fragments=tuple(self.fragments),
                              run_id=self.run_id, time_s=self.clock.time(), **fields).to_record()
        self.store.put(layout.syncer_heartbeat_key(self.epoch.epoch), records.dumps(rec))
        self._last_beat_t = self.clock.monotonic()
