"""Typed protocol records and the decision a manifest records: what a commit writes reads
back as the same decision, and a record round-trips whole (unknown keys included)."""

from __future__ import annotations

import uuid

from ddiloco_cli.protocol import ledger, records
from ddiloco_cli.protocol.typed_records import LedgerEntry, Manifest, SyncerHeartbeat
from ddiloco_cli.store import open_store
from ddiloco_cli.syncer.update import Decision

from support.runs import beat, contribution, live_syncer, make_run, step


def test_the_committed_manifest_is_the_decision():
    """The syncer decides, then commits; ``Decision.from_manifest`` of the manifest it wrote
    is the decision it applied (what a replay applies in turn)."""
    run_store = open_store(f"memory://decision-{uuid.uuid4().hex}")
    make_run(run_store, quorum=2)
    s = live_syncer(run_store)
    for lid in ("a", "b"):
        beat(run_store, lid)
    contribution(run_store, 0, "a", 1, c_tokens=64, c_steps=2)
    contribution(run_store, 0, "b", 1, c_tokens=32, c_steps=2)
    contribution(run_store, 0, "b", 2, c_tokens=48, c_steps=3)  # supersedes b's seq 1 (same base)
    applied = []
    decide = s.decider.decide
    s.decider.decide = lambda *a, **k: applied.append(decide(*a, **k)) or applied[-1]
    assert step(s, 0)
    raw = ledger.read_manifest(run_store, 0, 1)
    m = Manifest.from_json(raw)
    again = Decision.from_manifest(m, default_lr=123.0)
    assert again == applied[0]
    assert [(e.learner_id, e.seq) for e in again.used] == [("a", 1), ("b", 2)]
    assert [(e.seq, e.final_status, e.carried_by) for e in again.closed] == [(1, "superseded", 2)]
    assert again.weights == [e.weight * e.discount for e in again.used]
    assert records.dumps(m.to_record()) == records.dumps({k: v for k, v in raw.items()})


def test_unknown_keys_survive_a_round_trip():
    entry = {"learner_id": "a", "seq": 3, "key": "k", "size": 1, "used": False, "status": "refused",
             "reason": "stale", "from_the_future": [1, 2]}
    e = LedgerEntry.from_json(entry)
    assert e.extra == {"from_the_future": [1, 2]} and e.final_status == "refused"
    assert e.to_json() == entry
    beat = records.make("syncer_heartbeat", run_id="r", epoch=2, syncer_id="s", fragments=[0, 1], state="serving",
                        time_s=5.0)
    beat["newer_field"] = {"x": 1}
    hb = SyncerHeartbeat.from_json(beat)
    assert hb.fragments == (0, 1) and hb.extra == {"newer_field": {"x": 1}}
    assert hb.to_record() == beat
