"""A tampered ledger never halts anything (issue 25), on a local directory, in memory, on S3
(the moto server) and on GCS (fake-gcs-server), with a real Syncer in-process: a manifest copied
to the next version's key stops only its fragment, with an ALERT that ``status --check`` reports; a deleted newest manifest
is put back by the syncer that committed it; a reader meets a gap with one line, not a
traceback; ``inspect --verify`` names each."""

from __future__ import annotations

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


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_manifest_copied_to_the_next_version_halts_only_its_fragment(backend, store_url):
    from ddiloco_cli.ops.observe import verify_run

    store = open_store(store_url(backend))
    s, contribution, step = _two_fragment_syncer(store)
    store.put_if_absent(layout.manifest_key(0, 4), store.get(layout.manifest_key(0, 3)))  # v3's content at key v4
    for p in (0, 1):
        contribution(store, p, "a", 100 + p, base_version=3)
    s.tick()  # fragment 0 tries version 4 (taken), cannot re-read its ledger: not an exception
    assert 0 in s.unavailable and 0 not in s.states and "claims" in s.unavailable[0]
    assert s.states[1].version == 4  # the other fragment keeps advancing
    contribution(store, 1, "a", 200, base_version=4)
    s.tick()
    assert s.states[1].version == 5
    beat = records.loads(store.get(layout.syncer_heartbeat_key(s.epoch.epoch)), "syncer_heartbeat", where="hb")
    assert any("fragment 0 is not served" in a for a in beat["alerts"])
    from ddiloco_cli.ops.observe import run_status

    assert any("fragment 0 is not served" in a for a in run_status(store)["alerts"])  # what status --check prints
    assert any(layout.manifest_key(0, 4) in p for p in verify_run(store))


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
