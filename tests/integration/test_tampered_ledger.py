"""A tampered ledger never halts anything (issue 25), on a local directory, in memory, on S3
(the moto server) and on GCS (fake-gcs-server), with a real Syncer in-process. What the syncer
can prove it repairs (syncer/repair.py): junk at the key of the version it is about to commit
(case A: a copy of the previous manifest, or bytes that are no manifest) is deleted and its own
manifest committed; the newest manifest it committed, deleted or replaced, is put back (case B);
a VALID manifest at that key is never touched (it lost the race). What it cannot prove (a
damaged newest manifest met by a syncer that did not commit it) stops only its fragment, with an
ALERT that ``status --check`` reports. A reader meets a gap with one line, not a traceback;
``inspect --verify`` names each damage, and is clean after a repair."""

from __future__ import annotations

import time

import pytest

from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.store import open_store

from support.runs import ALL_BACKENDS


def _two_fragment_syncer(store, **run):
    from support.runs import beat, contribution, live_syncer, make_run, step

    make_run(store, **run)
    beat(store, "a")
    s = live_syncer(store)
    for v in range(3):
        for p in (0, 1):
            contribution(store, p, "a", 10 * v + p + 1, base_version=v)
            assert step(s, p)
    return s, contribution, step


def _repairs(store, s) -> tuple[int, list[str], dict]:
    """(num_repairs, repairs) of the syncer's heartbeat, and its row in ``status``."""
    from ddiloco_cli.ops.observe import run_status

    beat = records.loads(store.get(layout.syncer_heartbeat_key(s.epoch.epoch)), "syncer_heartbeat", where="hb")
    row = next(r for r in run_status(store)["syncers"] if r["epoch"] == s.epoch.epoch)
    return beat.get("num_repairs", 0), beat.get("repairs", []), row


def _valid(store, p: int, v: int) -> dict:
    run = ledger.read_run(store)
    return ledger.read_manifest(store, p, v, run_id=run["run_id"])


@pytest.mark.parametrize("junk", ["copy", "garbage"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_junk_at_the_next_versions_key_is_deleted_and_the_syncer_commits_its_own(backend, junk, store_url):
    """Case A: v3's content copied to key v4 (or bytes that are no manifest) before the syncer
    commits v4: no valid v4 can exist, so the lease holder deletes it and commits its own."""
    from ddiloco_cli.ops.observe import verify_run

    store = open_store(store_url(backend))
    s, contribution, step = _two_fragment_syncer(store)
    key4 = layout.manifest_key(0, 4)
    bad = store.get(layout.manifest_key(0, 3)) if junk == "copy" else b"\x00 not a manifest"
    assert store.put_if_absent(key4, bad)
    assert any(key4 in p for p in verify_run(store))  # named before the repair
    for p in (0, 1):
        contribution(store, p, "a", 100 + p, base_version=3)
    s.tick()  # fragment 0 finds v4 taken by junk: deletes it, commits its own v4
    assert s.unavailable == {} and s.states[0].version == 4 and s.states[1].version == 4
    assert store.get(key4) != bad and _valid(store, 0, 4)["syncer_id"] == s.syncer_id
    n, lines, row = _repairs(store, s)
    assert n == 1 and any(key4 in line for line in lines)
    assert row["num_repairs"] == 1 and any(key4 in r for r in row["repairs"])  # what `status` shows
    assert not any("fragment 0" in a for a in beat_alerts(store, s))
    for v in (4, 5):  # both fragments keep advancing
        for p in (0, 1):
            contribution(store, p, "a", 10 * v + 200 + p, base_version=v)
            assert step(s, p) and s.states[p].version == v + 1
    assert verify_run(store) == []  # clean after the repair


def beat_alerts(store, s) -> list[str]:
    beat = records.loads(store.get(layout.syncer_heartbeat_key(s.epoch.epoch)), "syncer_heartbeat", where="hb")
    return list(beat.get("alerts") or [])


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_valid_manifest_at_the_next_versions_key_is_kept_and_the_syncer_reloads(backend, store_url):
    """A VALID v4 from another syncer (a twin of the same epoch, as in the known fencing window)
    is not deleted: the syncer loses the race and re-reads, as before."""
    from ddiloco_cli.syncer.core import Syncer, SyncerOptions

    store = open_store(store_url(backend))
    s, contribution, step = _two_fragment_syncer(store)
    twin = Syncer(store, options=SyncerOptions(fragments=[0], syncer_id="twin", poll_s=0.01, gc=False))
    twin.lease.epoch = s.epoch  # the same epoch: no fence between them, only create-only
    twin.store.arm(s.epoch)
    twin.restore()
    contribution(store, 0, "a", 100, base_version=3)
    assert step(twin, 0) and twin.states[0].version == 4
    theirs = store.get(layout.manifest_key(0, 4))
    contribution(store, 1, "a", 101, base_version=3)
    s.tick()  # fragment 0: v4 is taken by a valid manifest; lost race, reload
    assert store.get(layout.manifest_key(0, 4)) == theirs and _valid(store, 0, 4)["syncer_id"] == "twin"
    assert s.states[0].version == 4 and s.states[1].version == 4 and s.unavailable == {}
    assert s.ctx.stats.num_repairs == 0
    contribution(store, 0, "a", 102, base_version=4)
    assert step(s, 0) and s.states[0].version == 5


@pytest.mark.parametrize("junk", ["older", "garbage"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_replaced_newest_manifest_is_put_back_by_the_syncer_that_committed_it(backend, junk, store_url):
    """Case B: the syncer's committed newest manifest (v3) is replaced (by v2's bytes, or by
    junk): within a lease, with no contribution to fragment 0 arriving, the syncer deletes it
    and puts its own bytes back; fragment 1 advances throughout; fragment 0 after."""
    from ddiloco_cli.ops.observe import verify_run

    store = open_store(store_url(backend))
    s, contribution, step = _two_fragment_syncer(store)
    key3 = layout.manifest_key(0, 3)
    kept = store.get(key3)
    bad = store.get(layout.manifest_key(0, 2)) if junk == "older" else b"{}"
    store.delete(key3)
    assert store.put_if_absent(key3, bad)
    assert any(key3 in p for p in verify_run(store))  # named before the repair
    v1 = s.states[1].version
    deadline = time.monotonic() + 120.0  # a ceiling, not a wait: the check runs every half lease (1 s)
    while store.get(key3) != kept:
        assert time.monotonic() < deadline, "the replaced manifest was not put back"
        contribution(store, 1, "a", 1000 + v1, base_version=v1)
        s.clock.sleep(s.tick())
        assert s.states[1].version > v1  # the other fragment advances throughout
        v1 = s.states[1].version
    assert s.unavailable == {}
    n, lines, row = _repairs(store, s)
    assert n == 1 and any(key3 in line for line in lines) and row["num_repairs"] == 1
    assert verify_run(store) == []  # clean after the repair
    contribution(store, 0, "a", 500, base_version=3)
    assert step(s, 0) and s.states[0].version == 4  # fragment 0 keeps advancing


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_damaged_newest_manifest_it_did_not_commit_stops_only_its_fragment(backend, store_url):
    """What a syncer cannot prove stays an ALERT: a fresh syncer (it did not commit v3) meets v2's
    content at key v3; it serves fragment 1 only and alerts on fragment 0, which ``status --check``
    reports and ``inspect --verify`` names."""
    from ddiloco_cli.ops.observe import run_status, verify_run
    from support.runs import live_syncer

    store = open_store(store_url(backend))
    s, contribution, step = _two_fragment_syncer(store)
    s.heartbeat(force=True, state="stopped")  # it stops; another takes over
    key3 = layout.manifest_key(0, 3)
    bad = store.get(layout.manifest_key(0, 2))
    store.delete(key3)
    assert store.put_if_absent(key3, bad)
    t = live_syncer(store, syncer_id="next")
    assert 0 in t.unavailable and 0 not in t.states and "claims" in t.unavailable[0]
    contribution(store, 1, "a", 200, base_version=3)
    assert step(t, 1) and t.states[1].version == 4  # the other fragment keeps advancing
    t.tick()
    t.heartbeat(force=True)  # as a serving syncer does every heartbeat_s
    assert store.get(key3) == bad and t.ctx.stats.num_repairs == 0  # nothing it could prove
    assert any("fragment 0 is not served" in a for a in beat_alerts(store, t))
    assert any("fragment 0 is not served" in a for a in run_status(store)["alerts"])  # what status --check prints
    assert any(key3 in p for p in verify_run(store))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_deleted_newest_manifest_is_put_back_and_learners_get_one_line(backend, store_url):
    from ddiloco_cli.errors import ProtocolError
    from ddiloco_cli.ops.observe import verify_run
    from ddiloco_cli.protocol.published import FragmentReader

    store = open_store(store_url(backend))
    s, contribution, step = _two_fragment_syncer(store, publish_codec="int8")  # odd versions: a delta only
    s.heartbeat(force=True)  # as a serving syncer does every heartbeat_s
    key3 = layout.manifest_key(0, 3)
    kept = store.get(key3)
    store.delete(key3)
    assert any(key3 in p and "deleted" in p for p in verify_run(store))
    run = ledger.read_run(store)
    plan = ledger.read_plan(store, run_id=run["run_id"])
    contribution(store, 0, "a", 100, base_version=3)
    assert step(s, 0) and s.states[0].version == 4  # commits over the gap only after putting v3 back
    assert store.get(key3) == kept
    assert verify_run(store) == []
    contribution(store, 0, "a", 101, base_version=4)
    assert step(s, 0)
    store.delete(layout.manifest_key(0, 4))  # gone under version 5, whose delta needs it: one line for a reader
    reader = FragmentReader(store, run_id=run["run_id"], plan=plan, fragment=0)
    with pytest.raises(ProtocolError, match="version 4 of fragment 0 is missing") as err:
        reader.read(5)
    assert "\n" not in str(err.value) and "inspect" in str(err.value)


def test_in_a_signed_run_a_manifest_not_signed_by_a_syncer_key_is_deleted(tmp_path):
    """Case A where signatures are required: an admitted learner with bucket write rights signs
    v1's content as version 2 with its own key and puts it at key v2; no reader accepts it (not an
    admitted syncer key), so the syncer deletes it and commits its own, signed v2."""
    from ddiloco_cli.ops.observe import verify_run
    from ddiloco_cli.protocol import signing
    from support.runs import fragment0_contribution, signed_run, signed_syncer, step

    keys = {name: signing.new_key(tmp_path / f"{name}.pem") for name in ("admin", "a", "syncer")}
    store = open_store(str(tmp_path / "run"))
    run = signed_run(store, keys)
    s = signed_syncer(store, keys, "s")
    trust = signing.Trust(store, run=run)
    for seq, version in ((10, 1), (11, 2)):
        if version == 2:
            v1 = {k: v for k, v in ledger.read_manifest(store, 0, 1, trust=trust).items()
                  if k != signing.RECORD_FIELD}
            key2 = layout.manifest_key(0, 2)
            forged = signing.sign_record({**v1, "version": 2}, run_id=run["run_id"], key=key2, signer=keys["a"])
            assert store.put_if_absent(key2, records.dumps(forged))
            assert any(key2 in p for p in verify_run(store))
        key, data = fragment0_contribution(store, run, "a", seq, signer=keys["a"])
        assert store.put_if_absent(key, data)
        assert step(s, 0) and s.states[0].version == version
    assert ledger.read_manifest(store, 0, 2, trust=trust)["syncer_id"] == "s"  # its own, signed by its key
    assert s.ctx.stats.num_repairs == 1 and s.unavailable == {}
    assert verify_run(store) == []
