"""One test per MUST of protocol/PROTOCOL.md; each names its requirement id ([W3], [M1], ...).
The store's own requirements ([S1]-[S6]), which also run on S3, are in
tests/integration/test_protocol_stores.py.

Runs use the tiny three-tensor task of ``support.runs``, so every syncer step takes
milliseconds. Syncers are driven in-process: either through ``Syncer.serve``
with limits, or step by step (``poll_contributions`` / ``maybe_merge``) where a
test needs to act between two steps.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from typing import Any

import pytest
import torch

from ddiloco_cli.errors import FencedError, InvalidPayloadError, ProtocolError, UsageError
from ddiloco_cli.learner import LearnerStats, Uploader
from ddiloco_cli.numerics import codec
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.protocol.published import FragmentReader, expected_shapes
from ddiloco_cli.store import open_store
from ddiloco_cli.syncer.audit import audit_ledger
from ddiloco_cli.syncer.core import Syncer, SyncerOptions
from ddiloco_cli.syncer.gc import collect_garbage

from support import REPO
from support.runs import (
    LOCAL_BACKENDS,
    RecordingStore,
    assert_same_state,
    beat,
    contribution,
    delta_for,
    drive,
    live_syncer,
    make_run,
    manifests,
    restored,
    step,
)


@pytest.fixture(params=LOCAL_BACKENDS)
def run_store(request, store_url):
    store = open_store(store_url(request.param))
    make_run(store)
    return store


@pytest.fixture(params=LOCAL_BACKENDS)
def gc_store(request, store_url):
    """A run whose syncer accepts bases at most two cycles old (drive's lagging learner is 1.25
    behind), so GC can collect early versions."""
    store = open_store(store_url(request.param))
    make_run(store, max_staleness=2)
    return store


# =========================================================== run creation (init)
@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_init_writes_plan_first_run_json_last_W6(store_url, backend):
    """[W6] init creates plan.json first, run.json last (the commit point), every version-0
    manifest after its payloads; a second init changes nothing."""
    rec = RecordingStore(open_store(store_url(backend)))
    make_run(rec)
    writes = [k for op, k in rec.log if op in ("create", "put")]
    assert writes[0] == layout.PLAN and writes[-1] == layout.RUN_CONFIG
    assert all(op == "create" for op, k in rec.log if k in (layout.PLAN, layout.RUN_CONFIG))
    for p in (0, 1):
        m = ledger.read_manifest(rec, p, 0)
        assert m["epoch"] == 0 and m["contributions"] == [] and any(e["kind"] == "full" for e in m["payloads"])
        at = writes.index(layout.manifest_key(p, 0))
        assert all(writes.index(e["key"]) < at for e in m["payloads"])
    rec.log.clear()
    assert make_run(rec)["run_id"] == ledger.read_run(rec)["run_id"]  # an identical init joins the run
    with pytest.raises(UsageError, match="already exists .*--outer-lr"):
        make_run(rec, outer_lr=0.5)  # another config is refused
    assert not [op for op, _ in rec.log if op != "get"]


# ======================================================== committing a version
def test_manifest_created_after_its_payloads_W2(run_store):
    """[W2][W7] payloads are created (create-only) before the manifest that names them; the manifest
    records each payload's key, size and sha256, and readers check them [R4]."""
    beat(run_store, "a")
    rec = RecordingStore(run_store)
    s = live_syncer(rec)
    contribution(run_store, 0, "a", 5)
    assert step(s, 0)
    creates = [k for op, k in rec.log if op == "create"]
    m = ledger.read_manifest(run_store, 0, 1)
    at = creates.index(layout.manifest_key(0, 1))
    for e in m["payloads"]:
        assert creates.index(e["key"]) < at
        data = run_store.get(e["key"])
        assert (len(data), records.sha256_hex(data)) == (e["size"], e["sha256"])
    assert ("put", layout.manifest_key(0, 1)) not in rec.log  # never overwritten


def test_commit_conflict_rereads_never_overwrites_W3(run_store):
    """[W3] a syncer whose next version was committed by someone else keeps that version,
    re-reads, and commits its pending contribution as the following version."""
    beat(run_store, "a")
    s = live_syncer(run_store)
    v0 = ledger.read_manifest(run_store, 0, 0)
    theirs = {**v0, "version": 1, "epoch": s.epoch.epoch, "syncer_id": "other", "nonce": "theirs", "outer_steps": 0}
    assert ledger.commit_manifest(run_store, theirs)
    key, _, _ = contribution(run_store, 0, "a", 5)
    step(s, 0)  # loses the race for version 1
    assert ledger.read_manifest(run_store, 0, 1)["nonce"] == "theirs"
    assert s.states[0].version == 1
    step(s, 0)
    assert ledger.list_versions(run_store, 0) == [0, 1, 2]
    assert [c["key"] for c in ledger.read_manifest(run_store, 0, 2)["contributions"]] == [key]


def test_versions_are_contiguous_and_epochs_monotone_W5(run_store):
    """[W5] committed versions are 0..n without gaps; each names its epoch, never below its
    predecessor's."""
    beat(run_store, "a")
    beat(run_store, "b")
    s = live_syncer(run_store)
    drive(run_store, s, rounds=3)
    for p in (0, 1):
        ms = manifests(run_store, p)
        assert [m["version"] for m in ms] == [0, 1, 2, 3]
        assert [m["epoch"] for m in ms] == [0] + [s.epoch.epoch] * 3


def test_latest_hint_is_not_trusted_R3(run_store):
    """[R3] the latest hint is only a hint: a wrong or missing one changes nothing."""
    run_store.put(layout.latest_hint_key(0), records.dumps(records.make("latest", fragment=0, version=99)))
    run_store.delete(layout.latest_hint_key(1))
    assert ledger.latest_version(run_store, 0) == 0
    assert ledger.latest_version(run_store, 1) == 0
    s = restored(run_store)
    assert s.states[0].version == 0 and s.states[1].version == 0


# ==================================================================== JSON data
def test_every_object_is_versioned_json_or_safetensors_W1(run_store):
    """[W1] every JSON object carries format + protocol_version, is canonical and has no NaN;
    every tensor object is a ddiloco safetensors payload whose header carries them too [W10]."""
    beat(run_store, "a")
    beat(run_store, "b")
    s = live_syncer(run_store)
    drive(run_store, s, rounds=2)
    kinds = {"run.json": "run", "plan.json": "plan", "manifests": "manifest", "epochs": "epoch",
             "syncers/heartbeats": "syncer_heartbeat", "heartbeat.json": "learner_heartbeat"}
    seen = set()
    for info in run_store.list(""):
        data = run_store.get(info.key)
        if info.key.endswith(".json"):
            kind = next(v for k, v in kinds.items() if k in info.key)
            rec = records.loads(data, kind, where=info.key)
            assert rec["format"] == f"ddiloco.{kind}" and rec["protocol_version"] == records.PROTOCOL_VERSION
            assert data == records.dumps(rec)
            seen.add(kind)
        else:
            assert info.key.endswith(".safetensors")
            meta = codec.payload_codec(data, where=info.key)
            assert meta["format"] == codec.FORMAT_VERSION
            if info.key.startswith(("contributions/", "checkpoints/")):
                kind = "contribution" if info.key.startswith("contributions/") else "checkpoint"
                records.validate(meta["metadata"], kind, where=info.key)
                seen.add(kind)
    assert seen == set(kinds.values()) | {"contribution", "checkpoint"}


def test_no_code_path_unpickles_bucket_data_R5():
    """[R5] no module of ddiloco_cli calls pickle, torch.load or numpy.load(allow_pickle)."""
    root = str(REPO / "ddiloco_cli")
    offenders = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(dirpath, name)).read()
                if re.search(r"\bimport pickle\b|torch\.load\(|pickle\.loads?\(|allow_pickle=True", text):
                    offenders.append(name)
    assert offenders == []


# ============================================================ protocol evolution
def _rewrite(store, key: str, **changes: Any) -> None:
    rec = json.loads(store.get(key))
    rec.update(changes)
    store.put(key, records.dumps(rec))


def test_newer_major_version_is_refused_with_upgrade_E2(run_store):
    """[E2] run.json, a manifest or a contribution header of a newer protocol major version is
    refused with a message that says to upgrade."""
    _rewrite(run_store, layout.manifest_key(0, 0), protocol_version=records.PROTOCOL_VERSION + 1)
    plan = ledger.read_plan(run_store, run_id=ledger.read_run(run_store)["run_id"])
    reader = FragmentReader(run_store, run_id=ledger.read_run(run_store)["run_id"], plan=plan, fragment=0)
    with pytest.raises(ProtocolError, match="upgrade"):
        reader.read(0)
    _rewrite(run_store, layout.RUN_CONFIG, protocol_version=records.PROTOCOL_VERSION + 1)
    with pytest.raises(ProtocolError, match="upgrade"):
        ledger.read_run(run_store)
    with pytest.raises(ProtocolError, match="upgrade"):
        Syncer(run_store, options=SyncerOptions())


def test_unknown_required_feature_is_refused_E3(run_store):
    """[E3] a run.json that lists a feature this reader does not implement is refused ("upgrade")."""
    _rewrite(run_store, layout.RUN_CONFIG, features=["some-future-feature"])
    with pytest.raises(ProtocolError, match="upgrade"):
        ledger.read_run(run_store)


def test_newer_payload_format_is_refused_E2():
    """[E2] a tensor payload whose header format is newer than this reader's is refused."""
    data = codec.encode_tensors({"x": torch.ones(3)}, codec="none")
    newer = data.replace(b'\\"format\\":1', b'\\"format\\":2')
    assert newer != data
    with pytest.raises(InvalidPayloadError, match="upgrade"):
        codec.decode_tensors(newer, expected={"x": (3,)})


def test_unknown_fields_are_ignored_E1(run_store):
    """[E1] readers ignore fields they do not know, in every record and header."""
    extra = {"x_future": {"anything": [1, 2]}}
    for key in (layout.RUN_CONFIG, layout.PLAN, layout.manifest_key(0, 0), layout.manifest_key(1, 0)):
        _rewrite(run_store, key, **extra)
    beat(run_store, "a")
    s = live_syncer(run_store)
    key, _, _ = contribution(run_store, 0, "a", 5, header=extra)
    assert step(s, 0)
    assert [c["key"] for c in ledger.read_manifest(run_store, 0, 1)["contributions"]] == [key]
    assert s.num_quarantined == 0


# ===================================================== validation and quarantine
def _bad_contributions(store) -> dict[str, tuple[str, str]]:
    """name -> (key, expected words in the reason) for every kind of bad input."""
    p = 0
    shapes = expected_shapes(ledger.read_plan(store, run_id=ledger.read_run(store)["run_id"]), p)
    out: dict[str, tuple[str, str]] = {}
    out["wrong_run"] = (contribution(store, p, "a", 1, header={"run_id": "0" * 32})[0], "belongs to run")
    out["wrong_fragment"] = (contribution(store, p, "a", 2, header={"fragment": 1})[0], "header names fragment")
    out["wrong_seq"] = (contribution(store, p, "a", 3, header={"seq": 99})[0], "header names")
    nan = delta_for(store, p, 4)
    next(iter(nan.values()))[0] = float("nan")
    out["nan"] = (contribution(store, p, "a", 4, tensors=nan)[0], "non-finite")
    wrong_shape = {k: torch.zeros(*s, 2) for k, s in shapes.items()}
    out["wrong_shape"] = (contribution(store, p, "a", 5, tensors=wrong_shape)[0], "shape")
    missing = dict(list(delta_for(store, p, 6).items())[1:])
    out["missing_tensor"] = (contribution(store, p, "a", 6, tensors=missing)[0], "keys differ")
    _, good, _ = contribution(store, p, "a", 7, key="tmp/x/7.safetensors")
    key = layout.contribution_key(p, "a", 8)
    store.put_if_absent(key, good[: len(good) // 2])
    out["truncated"] = (key, "")
    key = layout.contribution_key(p, "a", 9)
    flipped = bytearray(good)
    flipped[-5] ^= 0xFF  # inside the last zstd frame (its checksum)
    store.put_if_absent(key, bytes(flipped))
    out["flipped_bytes"] = (key, "zstd")
    key = layout.contribution_key(p, "a", 10)
    store.put_if_absent(key, b"\x80\x04\x95" + b"\x00" * 64)  # a pickle stream
    out["pickle"] = (key, "")
    out["wrong_codec"] = (contribution(store, p, "a", 11, codec_name="bf16")[0], "run's codec")
    out["zero_steps"] = (contribution(store, p, "a", 12, c_steps=0)[0], "c_steps")
    out["newer_protocol"] = (contribution(store, p, "a", 13, header={"protocol_version": 99})[0], "upgrade")
    out["unknown_learner"] = (contribution(store, p, "ghost", 14)[0], "unknown learner")
    key = f"{layout.contribution_prefix(p)}a/not-a-number.safetensors"
    store.put_if_absent(key, good)
    out["bad_name"] = (key, "name")
    return out


def test_bad_contributions_are_quarantined_never_applied_V1(run_store):
    """[V1][V2] every invalid contribution (wrong run, fragment or seq in its header, NaN, wrong
    shape, missing tensor, truncated, flipped bytes, a pickle, a base from the future, zero
    steps, newer protocol, unknown learner, bad name) is quarantined with a report and never
    merged; the global state is unaffected and a later valid contribution merges normally."""
    beat(run_store, "a")
    s = live_syncer(run_store)
    before = {k: v.clone() for k, v in s.states[0].value.items()}
    bad = _bad_contributions(run_store)
    assert not step(s, 0)
    assert ledger.list_versions(run_store, 0) == [0]
    for name, (key, words) in bad.items():
        rec = records.loads(run_store.get(layout.quarantine_key(key)), "quarantine", where=name)
        assert rec["key"] == key and rec["epoch"] == s.epoch.epoch, name
        assert words.lower() in rec["reason"].lower(), (name, rec["reason"])
    assert s.num_quarantined == len(bad)
    for k, v in before.items():
        assert torch.equal(s.states[0].value[k], v)
    # the syncer goes on: a valid contribution is merged, alone
    good, _, delta = contribution(run_store, 0, "a", 50)
    assert step(s, 0)
    m = ledger.read_manifest(run_store, 0, 1)
    lr, mom = 0.7, 0.9
    value = FragmentReader(run_store, run_id=s.run_id, plan=s.plan, fragment=0).read(1)
    for k in before:  # one contribution, first Nesterov step: v1 = v0 - lr * (1 + momentum) * delta
        assert torch.allclose(value[k], before[k] - lr * (1 + mom) * delta[k], atol=1e-7)
    # invalid inputs get no ledger entry (their seq is untrusted: it must not move a high-water
    # mark); the quarantine report is their record, and the audit counts them
    assert [c["key"] for c in m["contributions"]] == [good] and m["high_water"] == {"a": 50}
    audit = audit_ledger(run_store, run_id=s.run_id, fragments=[0])
    assert audit.problems == [] and audit.counts["quarantined"] == len(bad) - 1  # the bad name is no contribution
    # quarantine reports are advisory: a restarted syncer validates what the ledger's marks have
    # not passed again (and quarantines it again)
    r = restored(run_store)
    r.poll_contributions()
    assert r.states[0].pending == {} and bad["unknown_learner"][0] in r.bad_keys


def test_serving_syncer_quarantines_and_commits_nothing_V1(run_store):
    """[V1] through Syncer.serve: a NaN contribution is quarantined and no version is committed."""
    beat(run_store, "a")
    nan = delta_for(run_store, 1, 3)
    next(iter(nan.values())).fill_(float("inf"))
    key, _, _ = contribution(run_store, 1, "a", 3, tensors=nan)
    # it serves until the quarantine (an event; a fixed --max-runtime can end before the first poll on a
    # loaded machine); the loop that quarantined it also decided whether to merge
    s = Syncer(run_store, options=SyncerOptions(poll_s=0.01, gc=False, max_runtime_s=120))
    assert s.serve(stop=lambda: s.num_quarantined >= 1) == "stopped"
    assert s.num_quarantined == 1 and s.num_merges == 0
    assert ledger.list_versions(run_store, 1) == [0]
    assert records.loads(run_store.get(layout.quarantine_key(key)), "quarantine", where="q")["key"] == key


def test_stale_contribution_is_refused_in_the_ledger_V2(run_store):
    """[V2] a contribution whose base is more than max_staleness cycles of the other learners'
    work old is refused: a ledger entry with the reason (no quarantine: it is valid, only too
    old); one within the bound but past two cycles is merged with a staleness discount
    recorded in its entry."""
    beat(run_store, "a")
    beat(run_store, "b")
    s = live_syncer(run_store)
    # max_staleness is 4 cycles; each version advances the clock 1 cycle (b's 3 steps count as
    # H = 2), half of it each learner's
    drive(run_store, s, rounds=10)
    stale, _, _ = contribution(run_store, 0, "a", 10_000, base_version=0)  # b merged 5 cycles since
    late, _, _ = contribution(run_store, 0, "b", 10_001, base_version=2)  # a merged 4 cycles since
    contribution(run_store, 0, "a", 10_002, base_version=10)  # every live learner reported: no grace wait
    assert step(s, 0)
    m = ledger.read_manifest(run_store, 0, 11)
    by_key = {c["key"]: c for c in m["contributions"]}
    assert by_key[stale]["status"] == "refused" and "stale" in by_key[stale]["reason"]
    assert not by_key[stale]["used"]
    assert by_key[late]["status"] == "used" and by_key[late]["staleness"] == pytest.approx(0.5 * (10 - 2))
    assert by_key[late]["discount"] == pytest.approx(2 / by_key[late]["staleness"])
    assert m["high_water"]["a"] == 10_002
    assert not any(i.key == layout.quarantine_key(stale) for i in run_store.list("quarantine/"))


def test_base_from_the_future_is_a_fence_check_not_a_quarantine_V2(run_store):
    """[V2] a base version above the syncer's own means someone else committed: the syncer
    checks the fence, re-reads the fragment and merges the contribution against that base."""
    beat(run_store, "a")
    s = live_syncer(run_store)
    # a stale syncer of a lower epoch that commits in the fencing window (see Known limitations)
    other = Syncer(run_store, options=SyncerOptions(syncer_id="stale", gc=False))
    other.lease.epoch = ledger.Epoch(0, "stale", frozenset({0, 1}), {})
    other.restore()
    other.lease.last_fence_check_t = time.monotonic()  # its last check passed just before the takeover
    contribution(run_store, 0, "a", 5)
    assert step(other, 0)  # version 1 committed behind s's back
    key, _, _ = contribution(run_store, 0, "a", 6, base_version=1)
    assert step(s, 0)
    assert s.states[0].version == 2 and key not in s.bad_keys
    assert [c["key"] for c in ledger.read_manifest(run_store, 0, 2)["contributions"]] == [key]
    bogus, _, _ = contribution(run_store, 0, "a", 7, base_version=99)
    contribution(run_store, 0, "a", 8, base_version=2)
    assert step(s, 0)
    entry = {c["key"]: c for c in ledger.read_manifest(run_store, 0, 3)["contributions"]}[bogus]
    assert entry["status"] == "refused" and "does not exist" in entry["reason"]


def test_corrupt_checkpoint_is_skipped_R4(run_store):
    """[R4] a checkpoint whose tensors do not match the plan is not loaded; restore falls back to
    an older checkpoint (or version 0) plus ledger replay and reaches the same state."""
    beat(run_store, "a")
    beat(run_store, "b")
    s = live_syncer(run_store)
    drive(run_store, s, rounds=3)
    header = records.make("checkpoint", run_id=s.run_id, fragment=0, version=3, epoch=s.epoch.epoch,
                          outer_steps=3, nonce="bad")
    bad = codec.encode_tensors({"junk": torch.ones(2)}, codec="none", metadata=header)
    run_store.put_if_absent(layout.checkpoint_key(0, 3, "bad"), bad)
    assert_same_state(s, restored(run_store))


# ========================================================= idempotent retries
def test_contribution_upload_retry_is_idempotent_W8(run_store):
    """[W8] a contribution is named by (fragment, learner, seq) and created once: a retried upload
    finds it there and succeeds; another writer's object under that name is never replaced."""
    run = ledger.read_run(run_store)
    delta = delta_for(run_store, 0, 1)
    header = records.make("contribution", run_id=run["run_id"], fragment=0, learner_id="a", seq=42, base_version=0,
                          c_tokens=8, c_steps=1, nonce=records.new_nonce())
    up = Uploader(run_store, codec_name="int8", block_size=256, maxsize=1, stats=LearnerStats())
    key = layout.contribution_key(0, "a", 42)
    up._upload(key, delta, header)
    first = run_store.get(key)
    up._upload(key, delta, header)  # the retry after a lost response
    assert run_store.get(key) == first and up.stats.num_contributions == 2 and up.stats.uploads_failed == 0
    other = {**header, "nonce": records.new_nonce()}
    up._upload(key, delta, other)  # same name, different writer: dropped
    assert run_store.get(key) == first
    assert [i.key for i in run_store.list(layout.contribution_prefix(0))] == [key]


def test_high_water_marks_and_superseded_contributions_W9(run_store):
    """[W9] of two pending contributions from one learner the newer is merged and the older is
    recorded as superseded (used=false); high_water covers both; a contribution at or below a
    learner's high-water mark is never merged later."""
    beat(run_store, "a")
    s = live_syncer(run_store)
    old, _, _ = contribution(run_store, 0, "a", 5)
    new, _, _ = contribution(run_store, 0, "a", 7)
    assert step(s, 0)
    m = ledger.read_manifest(run_store, 0, 1)
    by_key = {c["key"]: c for c in m["contributions"]}
    assert by_key[new]["used"] and not by_key[old]["used"] and by_key[old]["reason"] == "superseded"
    assert m["high_water"] == {"a": 7} and m["quorum_size"] == 1
    late, _, _ = contribution(run_store, 0, "a", 6)  # arrives late, below the mark: refused, never merged
    assert not step(s, 0)
    assert s.states[0].pending == {} and [e.key for e in s.states[0].closed] == [late]
    contribution(run_store, 0, "a", 8)
    assert step(s, 0)
    m = ledger.read_manifest(run_store, 0, 2)
    by_key = {c["key"]: c for c in m["contributions"]}
    assert not by_key[late]["used"] and by_key[late]["reason"].startswith("arrived late: seq 6 is at or below")
    assert m["high_water"] == {"a": 8}
    assert audit_ledger(run_store, run_id=s.run_id, fragments=[0]).problems == []
    # the poll after a merge counts the keys it moved below the mark as activity once (the syncer
    # keeps polling at poll_s a round longer, as it always has), then nothing is new
    assert s.poll_contributions() == 4 and s.poll_contributions() == 0
    r = restored(run_store)  # a restarted syncer takes the marks from the ledger
    r.poll_contributions()
    assert r.states[0].pending == {} and r.states[0].closed == []  # the keys below them are in its ledger
    step(s, 0)  # a listed key the first syncer has handled is not refused twice
    assert s.states[0].closed == []


def test_a_key_lost_before_a_restart_is_refused_as_late_W9(run_store, monkeypatch):
    """[W9] a contribution at or below its learner's mark that no manifest names (it arrived late
    while no syncer was listing: its syncer stopped after the merge that passed it) is refused as
    late by the next syncer, with the reason, and never merged; the keys the ledger names, also
    those older than the manifests the restore reads (at or below their marks), are not."""
    from ddiloco_cli.syncer import restore

    monkeypatch.setattr(restore, "TIP_WINDOW", 2)  # a restore reads the two newest manifests
    beat(run_store, "a")
    s = live_syncer(run_store, syncer_id="first")
    for seq in (3, 5, 7):  # versions 1, 2, 3; key 3 is named only by version 1, older than the window
        contribution(run_store, 0, "a", seq)
        assert step(s, 0)
    lost, _, _ = contribution(run_store, 0, "a", 6)  # below the mark 7, and "first" never lists again
    s.heartbeat(force=True, state="stopped")
    problems = audit_ledger(run_store, run_id=s.run_id, fragments=[0]).problems
    assert len(problems) == 1 and problems[0].startswith(f"{lost}: lost")
    nxt = Syncer(run_store, options=SyncerOptions(syncer_id="next", poll_s=0.01, gc=False))
    assert nxt.acquire(stop=lambda: False)
    nxt.restore()
    window = nxt.states[0].ledger_window
    assert dict(window.floor) == {"a": 5} and layout.contribution_key(0, "a", 3) not in window.named
    nxt.poll_contributions()
    assert nxt.states[0].pending == {} and [e.key for e in nxt.states[0].closed] == [lost]  # only the lost one
    contribution(run_store, 0, "a", 8)
    assert step(nxt, 0)
    by_key = {c["key"]: c for c in ledger.read_manifest(run_store, 0, 4)["contributions"]}
    assert not by_key[lost]["used"] and by_key[lost]["reason"].startswith("arrived late: seq 6 is at or below")
    assert audit_ledger(run_store, run_id=s.run_id, fragments=[0]).problems == []
    again = restored(run_store)  # a later restart refuses nothing twice
    again.poll_contributions()
    assert again.states[0].pending == {} and again.states[0].closed == []


def test_a_restore_that_reads_the_whole_ledger_has_no_floor_W9(run_store):
    """[W9] when the restore's walk reaches version 1 it has read every entry: a key below the
    first merge's mark that no manifest names is refused as late, not taken as recorded."""
    beat(run_store, "a")
    s = live_syncer(run_store, syncer_id="first")
    contribution(run_store, 0, "a", 7)
    assert step(s, 0)
    lost, _, _ = contribution(run_store, 0, "a", 6)
    r = restored(run_store)
    assert dict(r.states[0].ledger_window.floor) == {}
    r.poll_contributions()
    assert [e.key for e in r.states[0].closed] == [lost]


# ======================================================== fencing and leases
def test_higher_overlapping_epoch_fences_F1(run_store):
    """[F1][F3] a syncer that sees a higher epoch overlapping its fragments raises FencedError and
    commits nothing, also when the fence check is the one right before a commit."""
    beat(run_store, "a")
    s = live_syncer(run_store)
    contribution(run_store, 0, "a", 5)
    ledger.claim_epoch(run_store, run_id=s.run_id, syncer_id="usurper", fragments=[0], created_s=time.time())
    s.lease.last_fence_check_t = -1e9  # as after a long pause (SIGSTOP, GC, preemption)
    with pytest.raises(FencedError, match="took over"):
        step(s, 0)
    assert ledger.list_versions(run_store, 0) == [0]
    with pytest.raises(FencedError):
        s.check_fence()


def test_disjoint_epochs_do_not_fence_F1(run_store):
    """[F1] sharded syncers: a higher epoch for other fragments does not fence."""
    beat(run_store, "a")
    s1 = live_syncer(run_store, syncer_id="one", fragments=[1])
    s0 = live_syncer(run_store, syncer_id="zero", fragments=[0])
    assert s0.epoch.epoch > s1.epoch.epoch
    s1.check_fence()
    contribution(run_store, 1, "a", 5)
    assert step(s1, 1)
    assert ledger.read_manifest(run_store, 1, 1)["epoch"] == s1.epoch.epoch


def test_standby_waits_for_lease_by_store_clock_F2(run_store):
    """[F2] a standby does not claim while the owner's heartbeat is fresh by the store's clock; it
    claims the next epoch once the lease has expired by that clock (local clocks play no part),
    and the old owner is then fenced [F1]."""
    owner = live_syncer(run_store, syncer_id="owner")
    polls = iter(range(3))
    standby = Syncer(run_store, options=SyncerOptions(syncer_id="standby", gc=False))
    assert not standby.acquire(stop=lambda: next(polls, None) is None)  # looks three times, then gives up
    assert [e.epoch for e in ledger.list_epochs(run_store, run_id=owner.run_id)] == [owner.epoch.epoch]
    # the same moment seen by a store whose clock is a lease later: the lease has expired
    late = RecordingStore(run_store, clock_shift_s=owner.config.lease_s + 1.0)
    standby = Syncer(late, options=SyncerOptions(syncer_id="standby", gc=False))
    assert standby.acquire()
    assert standby.epoch.epoch == owner.epoch.epoch + 1
    with pytest.raises(FencedError):
        owner.check_fence()


def test_stopped_owner_releases_lease_F2(run_store):
    """[F2] an owner whose last heartbeat says "stopped" no longer holds the lease."""
    owner = live_syncer(run_store, syncer_id="owner")
    owner.heartbeat(force=True, state="stopped")
    nxt = Syncer(run_store, options=SyncerOptions(syncer_id="next", gc=False))
    assert nxt.acquire(stop=lambda: False)
    assert nxt.epoch.epoch == owner.epoch.epoch + 1


def test_epoch_claims_are_create_only_F4(run_store):
    """[F4] epoch numbers are claimed create-only: racing claimers get distinct epochs."""
    run_id = ledger.read_run(run_store)["run_id"]
    got = []

    def claim(i: int) -> None:
        got.append(ledger.claim_epoch(run_store, run_id=run_id, syncer_id=f"s{i}", fragments=[0, 1],
                                      created_s=0.0).epoch)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == [1, 2, 3]
    assert [e.syncer_id for e in ledger.list_epochs(run_store, run_id=run_id)] == \
        [json.loads(run_store.get(layout.epoch_key(n)))["syncer_id"] for n in (1, 2, 3)]


# ============================================================ merge semantics
def test_merge_follows_token_weighted_rda_and_nesterov_M1(run_store):
    """[M1][M2][M3] version 1 = v0 - lr * (g + momentum * g), g = RDA of the contributions with
    weights c_tokens^2 / c_steps (the weighted mean for 1-d tensors), computed here
    independently in fp64 from the ledger."""
    beat(run_store, "a")
    beat(run_store, "b")
    s = live_syncer(run_store)
    v0 = {k: t.clone() for k, t in s.states[0].value.items()}
    _, _, da = contribution(run_store, 0, "a", 5, c_tokens=64, c_steps=2)
    _, _, db = contribution(run_store, 0, "b", 6, c_tokens=30, c_steps=2)  # H steps each: one whole cycle
    assert step(s, 0)
    m = ledger.read_manifest(run_store, 0, 1)
    weights = {c["learner_id"]: c["weight"] for c in m["contributions"]}
    assert weights == {"a": 64 * 64 / 2, "b": 30 * 30 / 2} and m["cycle_advance"] == 1.0
    value = FragmentReader(run_store, run_id=s.run_id, plan=s.plan, fragment=0).read(1)
    wa, wb = weights["a"], weights["b"]
    for k in v0:
        a, b = da[k].double(), db[k].double()
        radial = (wa * a.norm() + wb * b.norm()) / (wa + wb)
        direction = (wa * a / a.norm() + wb * b / b.norm()) / (wa + wb)
        g = radial * direction / direction.norm() if a.dim() > 1 else (wa * a + wb * b) / (wa + wb)  # 1-d: mean
        expected = v0[k].double() - 0.7 * (g + 0.9 * g)
        assert torch.allclose(value[k].double(), expected, rtol=1e-5, atol=1e-7), k


def test_ledger_replay_reproduces_outer_state_M4(run_store):
    """[M4] restore = newest checkpoint + replay of the manifests after it: the outer momentum,
    step count, value and high-water marks equal the live syncer's, bit for bit, including
    contributions computed against older bases."""
    beat(run_store, "a")
    beat(run_store, "b")
    s = live_syncer(run_store)
    drive(run_store, s, rounds=3)  # checkpoints at version 2; versions 3 replayed
    assert any(layout.parse_num(i.key) == 2 for i in run_store.list(layout.checkpoint_prefix(0)))
    assert any(c["base_version"] < m["version"] - 1 for m in manifests(run_store, 0) for c in m["contributions"])
    assert_same_state(s, restored(run_store))


def test_replay_without_checkpoints_from_version_zero_M4(run_store):
    """[M4] with no checkpoint at all the ledger is replayed from version 0."""
    beat(run_store, "a")
    beat(run_store, "b")
    s = live_syncer(run_store)
    drive(run_store, s, rounds=3)
    for p in (0, 1):
        for info in run_store.list(layout.checkpoint_prefix(p)):
            run_store.delete(info.key)
    assert_same_state(s, restored(run_store))


# ========================================================= garbage collection
def test_gc_keeps_newest_checkpoint_and_everything_after_G1(gc_store):
    """[G1][G2][G4] GC keeps the newest checkpoint and every manifest, payload and contribution a
    restart from it needs; after GC a restore still equals the live syncer and readers still
    read the latest version."""
    beat(gc_store, "a")
    beat(gc_store, "b")
    s = live_syncer(gc_store)
    # checkpoints at 2 and 4; 1.25 cycles per version: version 4 (cycle 5.0) is the oldest within
    # max_staleness = 2 cycles of version 5 (6.25), but a replay from checkpoint 4 measures b's
    # contribution in version 5 against its base, version 3 [M6]: keep from min(5 - 1 + 1, 4, 4, 3) = 3
    # (every version is a full payload here: publish codec none)
    drive(gc_store, s, rounds=5)
    m4 = ledger.read_manifest(gc_store, 0, 4)
    after = [c["key"] for c in ledger.read_manifest(gc_store, 0, 5)["contributions"]]
    time.sleep(0.01)  # gc_grace_s is 1 ms (init refuses 0): everything written so far is old enough
    report = collect_garbage(gc_store, config=s.config)
    assert report.keep_from == {0: 3, 1: 3}
    for p in (0, 1):
        assert ledger.list_versions(gc_store, p) == [3, 4, 5]
        ckpts = [layout.parse_num(i.key) for i in gc_store.list(layout.checkpoint_prefix(p))]
        assert ckpts == [4]
        named = {e["key"] for v in (3, 4, 5) for e in ledger.read_manifest(gc_store, p, v)["payloads"]}
        assert {i.key for i in gc_store.list(layout.payload_prefix(p))} == named
    left = {i.key for i in gc_store.list(layout.contribution_prefix(0))}
    assert set(after) <= left
    assert all(layout.parse_contribution_key(k)[2] > m4["high_water"][layout.parse_contribution_key(k)[1]] for k in left)
    assert_same_state(s, restored(gc_store))
    value = FragmentReader(gc_store, run_id=s.run_id, plan=s.plan, fragment=0).read(5)
    assert all(torch.equal(value[k], s.states[0].value[k]) for k in value)


def test_gc_spares_orphans_younger_than_grace_G3(store_url):
    """[G3] objects no manifest names (an in-flight writer's payload, old checkpoints, quarantined
    inputs) are deleted only once older than gc_grace_s."""
    store = open_store(store_url("memory"))
    make_run(store, gc_grace_s=3600.0)
    beat(store, "a")
    orphan = layout.payload_key(0, 1, "full", "inflight")
    store.put_if_absent(orphan, b"partial")
    bad, _, _ = contribution(store, 0, "a", 3, header={"run_id": "x"})
    s = live_syncer(store)
    assert not step(s, 0)
    report = collect_garbage(store, config=s.config)
    assert report.deleted == []
    assert store.get(orphan) == b"partial" and store.get(bad)
    late = RecordingStore(store, clock_shift_s=7200.0)
    report = collect_garbage(late, config=s.config)
    assert orphan in report.deleted and bad in report.deleted
    assert ledger.list_versions(store, 0) == [0]  # version 0 (with its payload) is never collected
    FragmentReader(store, run_id=s.run_id, plan=s.plan, fragment=0).read(0)


def test_manifests_deleted_before_their_payloads_G4(gc_store):
    """[G4] GC deletes a version's manifest before its payloads, so no remaining manifest ever
    names a missing payload."""
    beat(gc_store, "a")
    beat(gc_store, "b")
    s = live_syncer(gc_store)
    drive(gc_store, s, rounds=5)
    time.sleep(0.01)
    rec = RecordingStore(gc_store)
    collect_garbage(rec, config=s.config)
    deleted = [k for op, k in rec.log if op == "delete"]
    assert layout.manifest_key(0, 0) in deleted and layout.manifest_key(1, 2) in deleted
    for p in (0, 1):
        for v in range(3):
            mkey = layout.manifest_key(p, v)
            for k in deleted:
                if k.startswith(layout.payload_prefix(p)) and layout.parse_num(k) == v:
                    assert deleted.index(mkey) < deleted.index(k)
