"""Signatures before decoding and quarantine reports that survive a restart [A2] (issue 25), on a
local directory, in memory, on S3 (the moto server) and on GCS (fake-gcs-server), with a real
Syncer in-process: junk is refused before it is decoded (a fake id's before it is even read),
costs each syncer once, and does not delay an honest merge; a forged report is not believed."""

from __future__ import annotations

import pytest

from ddiloco_cli.numerics import codec
from ddiloco_cli.protocol import layout, ledger, records, signing
from ddiloco_cli.store import open_store
from ddiloco_cli.syncer.core import Syncer

from support.runs import ALL_BACKENDS, fragment0_contribution, signed_run, signed_syncer


@pytest.fixture
def keys(tmp_path):
    return {name: signing.new_key(tmp_path / f"{name}.pem") for name in ("admin", "a", "syncer")}


def _signed_run(store_url, backend, keys):
    store = open_store(store_url(backend))
    return store, signed_run(store, keys)


def _syncer(store, keys, name: str) -> Syncer:
    return signed_syncer(store, keys, name)


def _counting(monkeypatch):
    calls = {"decode": 0, "verify": 0}
    decode, verify = codec.decode_tensors, signing.verify_payload

    def counted_decode(*a, **kw):
        calls["decode"] += 1
        return decode(*a, **kw)

    def counted_verify(*a, **kw):
        calls["verify"] += 1
        return verify(*a, **kw)

    monkeypatch.setattr(codec, "decode_tensors", counted_decode)
    monkeypatch.setattr(signing, "verify_payload", counted_verify)
    return calls


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_junk_is_refused_before_decoding_and_costs_each_syncer_once_A2(backend, store_url, keys, monkeypatch):
    store, run = _signed_run(store_url, backend, keys)
    good_key, good = fragment0_contribution(store, run, "a", 1, signer=keys["a"])
    store.put_if_absent(good_key, good)
    junk = []
    for i in range(12):  # unsigned payloads under fake ids, and one of a's signed by another key
        key, data = fragment0_contribution(store, run, f"fake{i}", 1, signer=None)
        store.put_if_absent(key, data)
        junk.append(key)
    key, data = fragment0_contribution(store, run, "a", 2, signer=keys["syncer"])
    store.put_if_absent(key, data)
    junk.append(key)

    calls = _counting(monkeypatch)
    first = _syncer(store, keys, "first")
    calls.update(decode=0, verify=0)  # restoring decodes the published versions
    first.poll_contributions()
    assert calls["decode"] == 1  # only the good one was decoded: junk fails its signature first
    assert set(first.intake.bad_keys) == set(junk)
    for key in junk:
        report = records.loads(store.get(layout.quarantine_key(key)), "quarantine", where=key)
        assert report["key"] == key and report["size"] == len(store.get(key)) and "signature" in report
    assert [c.key for cs in first.states[0].pending.values() for c in cs] == [good_key]

    second = _syncer(store, keys, "second")  # a restart (or failover): the reports are believed
    calls.update(decode=0, verify=0)
    second.poll_contributions()
    assert calls == {"decode": 1, "verify": 1}  # the good one again (not yet merged); no junk
    assert second.intake.reports_believed == len(junk) and set(second.intake.bad_keys) == set(junk)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_forged_or_resized_quarantine_report_is_not_believed_A2(backend, store_url, keys, monkeypatch):
    store, run = _signed_run(store_url, backend, keys)
    good_key, good = fragment0_contribution(store, run, "a", 1, signer=keys["a"])
    store.put_if_absent(good_key, good)
    fake = records.make("quarantine", key=good_key, reason="junk", size=len(good))  # unsigned: anyone could write it
    store.put_if_absent(layout.quarantine_key(good_key), records.dumps(fake))
    s = _syncer(store, keys, "s")
    s.poll_contributions()
    assert s.intake.reports_believed == 0 and good_key not in s.intake.bad_keys
    assert [c.key for cs in s.states[0].pending.values() for c in cs] == [good_key]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_an_honest_merge_is_not_queued_behind_a_junk_flood_and_junk_is_judged_once_across_a_restart_A2(
        backend, store_url, keys, monkeypatch):
    from ddiloco_cli.syncer.poll import UNKNOWN_PER_POLL

    store, run = _signed_run(store_url, backend, keys)
    junk = set()
    for i in range(3 * UNKNOWN_PER_POLL + 5):  # unsigned payloads under fake ids
        key, data = fragment0_contribution(store, run, f"fake{i:03d}", 1, signer=None)
        store.put_if_absent(key, data)
        junk.add(key)
    good_key, good = fragment0_contribution(store, run, "a", 1, signer=keys["a"])
    store.put_if_absent(good_key, good)
    reads, reports = [], []
    get, put_if_absent = store.get, store.put_if_absent
    monkeypatch.setattr(store, "get", lambda key, **kw: reads.append(key) or get(key, **kw))
    monkeypatch.setattr(store, "put_if_absent", lambda key, data: reports.append(key) or put_if_absent(key, data))
    calls = _counting(monkeypatch)

    first = _syncer(store, keys, "first")
    calls.update(decode=0, verify=0)
    first.tick()  # one poll: a's contribution is merged now, the junk waits its turn
    assert ledger.latest_version(store, 0) == 1
    assert [e["key"] for e in ledger.read_manifest(store, 0, 1)["contributions"]] == [good_key]
    assert 0 < first.intake.num_quarantined <= UNKNOWN_PER_POLL
    for _ in range(100):  # a few polls more deal with the rest
        if first.intake.num_quarantined == len(junk):
            break
        first.tick()
    assert first.bad_keys == junk and first.intake.num_quarantined == len(junk)
    assert calls == {"decode": 1, "verify": 1}  # a's contribution; no junk

    second = _syncer(store, keys, "second")  # a restart: the reports are believed, each once
    calls.update(decode=0, verify=0)  # restoring decodes the published versions
    for _ in range(100):
        if second.intake.reports_believed == len(junk):
            break
        second.tick()
    assert second.intake.reports_believed == len(junk) and second.intake.num_quarantined == 0
    assert second.bad_keys == junk
    assert not junk & set(reads)  # never downloaded: a fake id has no admitted key to sign with
    assert calls == {"decode": 0, "verify": 0}  # a's is merged already; no junk
    written = [k for k in reports if k.startswith(layout.QUARANTINE_PREFIX)]
    assert sorted(written) == sorted(layout.quarantine_key(k) for k in junk)  # one report each, across both
