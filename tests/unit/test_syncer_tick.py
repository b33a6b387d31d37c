"""The syncer as a state machine stepped by a driver on an injected clock: ``tick`` does one
round of work and says when it wants to run next; nothing in the syncer's side reads the
host's time or sleeps (so the deterministic simulation can drive it on a virtual clock)."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

from ddiloco_cli.clock import VirtualClock
from ddiloco_cli.protocol import ledger
from ddiloco_cli.store import open_store
from ddiloco_cli.syncer.core import Syncer, SyncerOptions

from support.runs import beat, contribution, make_run

PACKAGE = Path(__file__).resolve().parents[2] / "ddiloco_cli"
# the syncer's side: its logic reads time only through an injected clock.Clock: the syncer package,
# the protocol operations it calls and the numerics of a merge
SYNCER_SIDE = sorted(str(p.relative_to(PACKAGE)) for p in (PACKAGE / "syncer").glob("*.py")) + [
    "protocol/ledger.py", "protocol/published.py", "protocol/signing.py", "protocol/typed_records.py",
    "numerics/outer.py", "numerics/merge.py"]


def test_no_syncer_side_module_reads_the_hosts_clock_or_sleeps():
    assert len(SYNCER_SIDE) >= 20 and "syncer/core.py" in SYNCER_SIDE
    host_time = re.compile(r"\btime\.(time|monotonic|sleep|perf_counter)\(")
    found = [f"{name}:{n}" for name in SYNCER_SIDE for n, line in
             enumerate((PACKAGE / name).read_text().splitlines(), 1) if host_time.search(line)]
    assert found == []


def _virtual_syncer(store, clock: VirtualClock, syncer_id: str = "v") -> Syncer:
    return Syncer(store, options=SyncerOptions(syncer_id=syncer_id, gc=False, poll_s=0.1, clock=clock,
                                               decode_threads=1))


def test_a_virtual_clock_drives_a_syncer_by_tick():
    """Lockstep with two live learners: tick merges once both reported, waits at poll_s while a
    contribution is pending, and backs off while idle; record times come from the clock."""
    store = open_store(f"memory://tick-{uuid.uuid4().hex}")
    make_run(store, num_fragments=1, sync_every=2, overlap_steps=1, quorum=2, heartbeat_s=1000.0, lease_s=10_000.0,
             grace_max_s=0.0)
    for lid in ("a", "b"):
        beat(store, lid, step_time_s=4.0)
    clock = VirtualClock(start_s=5.0)
    s = _virtual_syncer(store, clock)
    assert s.acquire(wait=False)
    s.start()
    assert s.intake._pool is None
    pauses = [s.tick()]
    contribution(store, 0, "a", 1)
    clock.advance(pauses[-1])
    assert s.tick() == 0.1 and s.progress()["versions"] == {0: 0}  # b has not reported: a waits
    contribution(store, 0, "b", 1)
    clock.advance(0.1)
    s.tick()
    assert s.progress()["versions"] == {0: 1} and s.committed == 1
    manifest = ledger.read_manifest(store, 0, 1)
    assert manifest["created_s"] == clock.time()
    assert {c["learner_id"] for c in manifest["contributions"]} == {"a", "b"}
    for _ in range(6):  # idle: the pause doubles up to a quarter of the learners' step time
        clock.advance(pauses[-1])
        pauses.append(s.tick())
    assert pauses[-1] == 1.0 and pauses[-2] <= pauses[-1]
    assert s.intake._pool is None  # decode_threads=1 never starts a pool


def test_a_standby_that_does_not_wait_returns_at_once_while_the_lease_is_held():
    store = open_store(f"memory://standby-{uuid.uuid4().hex}")
    make_run(store, num_fragments=1, heartbeat_s=1000.0, lease_s=10_000.0)
    clock = VirtualClock()
    owner = _virtual_syncer(store, clock, "owner")
    assert owner.acquire(wait=False)
    owner.start()
    standby = _virtual_syncer(store, clock, "standby")
    assert not standby.acquire(wait=False)
    assert clock.monotonic() == 0.0  # it did not sleep on the clock either
    assert owner.lease.holder()[0].syncer_id == "owner"
    owner.heartbeat(force=True, state="stopped")  # a stopped owner frees the lease at once
    assert standby.acquire(wait=False) and standby.epoch.epoch == owner.epoch.epoch + 1
