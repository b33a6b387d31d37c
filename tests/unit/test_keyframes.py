"""Keyframes by size (run.json ``keyframe_rule = "size"``, the default with sparse published
deltas since 0.2.4): a version carries a full payload when the deltas since the newest
keyframe add up to at least its size, or ``keyframe_every`` versions after it. The syncer
decides it (``Decision.keyframe``) from the chain it keeps (``FragmentState.chain``, rebuilt
from the manifests on restore); a replay follows the manifest; GC keeps from the newest
keyframe at or below what it must retain, found in the manifests.
"""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from ddiloco_cli.errors import InvalidPayloadError
from ddiloco_cli.ops.observe import verify_run
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.protocol.published import FragmentReader, KeyframeChain, keyframe_chain, keyframe_due, payload_sizes
from ddiloco_cli.protocol.runconfig import RunConfig, SPARSE_KEYFRAME_EVERY
from ddiloco_cli.store import open_store
from ddiloco_cli.store.base import StoreWrapper
from ddiloco_cli.syncer.gc import collect_garbage

from support.runs import assert_same_state, beat, drive, live_syncer, make_run, manifests


@pytest.mark.parametrize("rule", ["every", "size"])
def test_keyframe_due(rule):
    due = lambda v, chain=None: keyframe_due(v, publish_codec="int4", keyframe_every=4, rule=rule, chain=chain)
    assert due(0) and keyframe_due(5, publish_codec="none", keyframe_every=4, rule=rule, chain=None)
    if rule == "every":
        assert [v for v in range(1, 13) if due(v)] == [4, 8, 12]
        return
    assert not due(3, KeyframeChain(keyframe=0, keyframe_bytes=1000, delta_bytes=999))
    assert due(3, KeyframeChain(keyframe=0, keyframe_bytes=1000, delta_bytes=1000))  # the chain is as large
    assert due(9, KeyframeChain(keyframe=5, keyframe_bytes=1000, delta_bytes=10))  # keyframe_every versions after
    assert not due(8, KeyframeChain(keyframe=5, keyframe_bytes=1000, delta_bytes=10))


def test_the_chain_follows_commits_and_reads_back_from_manifests():
    chain = KeyframeChain(keyframe=3, keyframe_bytes=100)
    chain = chain.after(4, {"delta": 7})
    chain = chain.after(5, {"delta": 9})
    assert chain == KeyframeChain(3, 100, 16)
    assert chain.after(6, {"delta": 5, "full": 90}) == KeyframeChain(6, 90, 0)
    ms = {3: {"fragment": 0, "payloads": [{"kind": "delta", "size": 8}, {"kind": "full", "size": 100}]},
          4: {"fragment": 0, "payloads": [{"kind": "delta", "size": 7}]},
          5: {"fragment": 0, "payloads": [{"kind": "delta", "size": 9}]}}
    assert keyframe_chain(ms.__getitem__, 5) == KeyframeChain(3, 100, 16)
    assert keyframe_chain(ms.__getitem__, 3) == KeyframeChain(3, 100, 0)
    del ms[3]["payloads"][1]
    ms.update({v: {"fragment": 0, "payloads": [{"kind": "delta", "size": 1}]} for v in range(3)})
    with pytest.raises(Exception, match="no keyframe at or below version 5"):
        keyframe_chain(ms.__getitem__, 5)


def test_defaults_new_runs_and_old_records():
    sparse = RunConfig(codec="sparse")
    assert (sparse.keyframe_rule, sparse.keyframe_every) == ("size", SPARSE_KEYFRAME_EVERY)
    int4 = RunConfig(codec="int4")
    assert (int4.keyframe_rule, int4.keyframe_every) == ("every", 8)
    assert RunConfig(codec="int4", keyframe_rule="size", keyframe_every=3).keyframe_rule == "size"
    record = sparse.to_record(run_id="r", created_s=0.0)
    assert record["keyframe_rule"] == "size" and record["features"] == ["keyframes_by_size"]  # 0.2.3 refuses it
    assert int4.to_record(run_id="r", created_s=0.0)["features"] == []
    del record["keyframe_rule"]  # a run.json written before the rule existed
    assert RunConfig.from_record(record).keyframe_rule == "every"


def _sized_run(store, *, rounds: int, **settings):
    """A run whose int4 published deltas follow the size rule (cap 1000: never reached), with
    ``rounds`` versions of both fragments from learners a and b; returns its live syncer."""
    make_run(store, codec="none", publish_codec="int4", keyframe_rule="size", keyframe_every=1000, **settings)
    live = live_syncer(store)
    _drive_more(store, live, rounds=rounds)
    return live


def _drive_more(store, syncer, *, rounds: int) -> None:
    beat(store, "a")
    beat(store, "b")
    syncer._refresh_learners()
    drive(store, syncer, rounds=rounds)


def _keyframes(store, p: int) -> list[int]:
    return [m["version"] for m in manifests(store, p) if "full" in payload_sizes(m["payloads"])]


def test_a_syncer_writes_keyframes_by_size_and_a_restart_and_gc_follow(tmp_path):
    """int4 published deltas of the test model's fragments are a sizeable share of a keyframe,
    so the size rule fires within a few versions, long before the cap (1000). Every version
    with a full payload is exactly one the rule asked for; a restarted syncer rebuilds the same
    chain and writes the same next payloads; GC keeps from a keyframe and everything stays
    readable."""
    root = tmp_path / "run"
    store = open_store(str(root))
    live = _sized_run(store, rounds=12, checkpoint_every=3, retain_versions=2, max_staleness=1)
    for p in (0, 1):
        ms = manifests(store, p)
        chain = None
        for m in ms:
            v, sizes = m["version"], payload_sizes(m["payloads"])
            if v > 0:
                want = keyframe_due(v, publish_codec="int4", keyframe_every=1000, rule="size", chain=chain)
                assert ("full" in sizes) == want, (p, v, chain, sizes)
                chain = chain.after(v, sizes)
            else:
                chain = KeyframeChain(0, sizes["full"])
        keyframes = _keyframes(store, p)
        assert len(keyframes) >= 3 and keyframes[0] == 0, keyframes  # the rule fired, more than once
        assert live.states[p].chain == chain
    # a restart rebuilds the chain from the manifests and continues the same way
    shutil.copytree(root, tmp_path / "copy")
    other = open_store(str(tmp_path / "copy"))
    again = live_syncer(other, syncer_id="again")
    assert_same_state(live, again)
    assert all(again.states[p].chain == live.states[p].chain for p in (0, 1))
    for store_, s in ((store, live), (other, again)):
        _drive_more(store_, s, rounds=4)
    for p in (0, 1):
        assert _keyframes(store, p) == _keyframes(other, p)
        got = [{e["kind"]: st.get(e["key"]) for e in ledger.read_manifest(st, p, 16)["payloads"]} for st in (store, other)]
        assert got[0] == got[1]
    assert verify_run(store) == []
    # a manifest whose keyframe is dropped (by hand) breaks the rule: `inspect --verify` says where
    k = _keyframes(other, 0)[1]
    m = ledger.read_manifest(other, 0, k)
    m["payloads"] = [e for e in m["payloads"] if e["kind"] != "full"]
    other.put(layout.manifest_key(0, k), records.dumps(m))
    problems = verify_run(other)
    assert any(f"version {k} of fragment 0 has no full payload" in x and "[W15]" in x for x in problems), problems
    # GC: the oldest retained version of each fragment is a keyframe, older ones go, all reads back
    report = collect_garbage(store, config=RunConfig.from_record(ledger.read_run(store)))
    for p in (0, 1):
        keep = report.keep_from[p]
        assert keep > 0 and keep in _keyframes(store, p), (keep, _keyframes(store, p))
        assert ledger.list_versions(store, p)[0] == keep
    assert verify_run(store) == []


class _Meeting(StoreWrapper):
    """Records how many gets were in flight at once: the first get waits (up to a generous
    ceiling, an event and not a fixed sleep) until a second one is in flight, so concurrent
    reads meet and sequential ones would show a maximum of 1."""

    def __init__(self, inner, *, concurrent: bool = True):
        super().__init__(inner)
        self.concurrent_reads = concurrent
        self.lock, self.met = threading.Lock(), threading.Event()
        self.in_flight = self.most = self.gets = 0

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        with self.lock:
            self.in_flight += 1
            self.gets += 1
            self.most = max(self.most, self.in_flight)
            if self.in_flight >= 2:
                self.met.set()
        try:
            if self.concurrent_reads:
                self.met.wait(timeout=30)
            return self.inner.get(key, max_bytes=max_bytes)
        finally:
            with self.lock:
                self.in_flight -= 1


def test_a_cold_read_fetches_its_chain_concurrently_with_the_same_result(tmp_path):
    """A reader with no value at hand walks back to a keyframe and applies the deltas after it:
    its manifests and payloads are fetched several at a time (a distant bucket then costs a
    round trip per batch), and the value, the bytes counted and the errors are those of one read
    at a time (a store with ``concurrent_reads = False``, like the simulation's)."""
    store = open_store(str(tmp_path / "run"))
    _sized_run(store, rounds=10)
    run = ledger.read_run(store)
    plan = ledger.read_plan(store, run_id=run["run_id"])
    for p in (0, 1):
        keyframes = _keyframes(store, p)  # the version furthest from its keyframe: a chain of deltas to walk
        latest = max(range(1, ledger.latest_version(store, p) + 1), key=lambda v: v - max(k for k in keyframes if k <= v))
        assert latest not in keyframes and latest - 1 not in keyframes
        got = {}
        for concurrent in (False, True):
            wrapped = _Meeting(store, concurrent=concurrent)
            reader = FragmentReader(wrapped, run_id=run["run_id"], plan=plan, fragment=p)
            got[concurrent] = (reader.read(latest), reader.bytes_down, wrapped.most)
        (seq, seq_bytes, seq_most), (con, con_bytes, con_most) = got[False], got[True]
        assert seq_most == 1 and con_most >= 2
        assert con_bytes == seq_bytes and con.keys() == seq.keys()
        assert all(torch.equal(con[k], seq[k]) for k in seq)
    # a delta payload gone from the chain (fragment 1's): the same error either way, naming it
    m = ledger.read_manifest(store, 1, latest)
    (delta,) = [e for e in m["payloads"] if e["kind"] == "delta"]
    store.delete(delta["key"])
    for concurrent in (False, True):
        reader = FragmentReader(_Meeting(store, concurrent=concurrent), run_id=run["run_id"], plan=plan, fragment=1)
        with pytest.raises(InvalidPayloadError, match=f"{delta['key']}: payload of version {m['version']} is missing"):
            reader.read(m["version"])
