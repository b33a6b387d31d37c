"""`ddiloco inspect` and `inspect --verify` on real local-directory runs
(``support.built_run``: real merges by the ``Syncer``, in-process)."""

from __future__ import annotations

import json
import os
import uuid

import pytest
import torch

from ddiloco_cli.numerics import codec
from ddiloco_cli.ops.observe import inspect_run, verify_run
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.protocol.published import FragmentReader
from ddiloco_cli.protocol.runconfig import RunConfig
from ddiloco_cli.store import open_store
from ddiloco_cli.store.base import Store
from ddiloco_cli.syncer.replay import replay_check

from support.built_run import LEARNER, BuiltRun, build_run, copy_run, invoke, latest_values, write_contribution
from support.runs import beat, drive, live_syncer, make_run


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> BuiltRun:
    return build_run(str(tmp_path_factory.mktemp("template") / "run"), rounds=3)


@pytest.fixture
def built(template, tmp_path) -> BuiltRun:
    return copy_run(template, str(tmp_path / "run"))


# ------------------------------------------------------------------------ verify
def test_consistent_run_verifies_clean(built):
    assert verify_run(built.store) == []
    result = invoke("inspect", built.url, "--verify")
    assert result.exit_code == 0, result.output
    assert "consistent" in result.output


def _payload_keys(store: Store, fragment: int, version: int) -> dict[str, str]:
    m = ledger.read_manifest(store, fragment, version)
    return {e["kind"]: e["key"] for e in m["payloads"]}


def test_verify_catches_flipped_byte(built):
    key = _payload_keys(built.store, 1, 3)["delta"]
    path = os.path.join(built.url, key)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 10)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    problems = verify_run(built.store)
    assert any(key in p and "sha256" in p for p in problems), problems
    result = invoke("inspect", built.url, "--verify")
    assert result.exit_code == 1
    assert key in result.output and "sha256" in result.output


def test_verify_catches_missing_payload(built):
    key = _payload_keys(built.store, 0, 2)["full"]
    os.remove(os.path.join(built.url, key))
    problems = verify_run(built.store)
    assert any(key in p and "missing" in p for p in problems), problems
    result = invoke("inspect", built.url, "--verify")
    assert result.exit_code == 1
    assert key in result.output


def test_verify_catches_version_gap(built):
    gap = layout.manifest_key(0, 2)
    os.remove(os.path.join(built.url, gap))
    problems = verify_run(built.store)
    assert any(gap in p and "gap" in p for p in problems), problems
    result = invoke("inspect", built.url, "--verify", "--json")
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert any(gap in p for p in report["problems"])


def test_verify_catches_bad_manifest_and_wrong_name(built):
    key = layout.manifest_key(1, 1)
    good = ledger.read_manifest(built.store, 1, 1)
    os.remove(os.path.join(built.url, key))
    built.store.put(key, records.dumps({**good, "version": 7}))  # valid schema, wrong name
    bad_key = layout.manifest_key(0, 3)
    built.store.put(bad_key, b"{not json")
    problems = verify_run(built.store)
    assert any(key in p and "claims fragment 1 version 7" in p for p in problems), problems
    assert any(bad_key in p and "not valid JSON" in p for p in problems), problems


def test_verify_catches_delta_that_disagrees_with_keyframe(built):
    # version 2 has a delta and a keyframe; a valid delta of other values must be flagged
    entries = ledger.read_manifest(built.store, 0, 2)["payloads"]
    m = ledger.read_manifest(built.store, 0, 2)
    prev = FragmentReader(built.store, run_id=built.run["run_id"], plan=built.plan, fragment=0).read(1)
    wrong = {k: v + 1.0 for k, v in prev.items()}
    data, _ = codec.encode_published_delta(prev, wrong, codec="int8", block_size=256)
    key = layout.payload_key(0, 2, "delta", "badbadbadbad")
    built.store.put(key, data)
    m["payloads"] = [e if e["kind"] != "delta" else {**e, "key": key, "size": len(data),
                                                     "sha256": records.sha256_hex(data)} for e in entries]
    built.store.put(layout.manifest_key(0, 2), records.dumps(m))
    problems = verify_run(built.store)
    assert any(key in p and "does not reproduce" in p for p in problems), problems


def test_verify_reports_missing_run(tmp_path):
    store = open_store(str(tmp_path / "empty"))
    assert any("run.json" in p and "missing" in p for p in verify_run(store))


# ----------------------------------------------------------------------- inspect
def test_inspect_json_has_sections(built):
    pending_key = write_contribution(built.store, built.run, built.plan, fragment=0, seq=99, base_version=3)
    foreign = "stray/notes.txt"
    built.store.put(foreign, b"hello")
    orphan = layout.payload_key(1, 9, "full", "0123456789ab")
    built.store.put(orphan, b"x" * 10)
    result = invoke("inspect", built.url, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    for section in ("run", "fragments", "epochs", "syncers", "learners", "quarantined", "objects", "orphans", "errors"):
        assert section in report, section
    assert report["run"]["run_id"] == built.run["run_id"]
    f0, f1 = report["fragments"]
    assert (f0["oldest_version"], f0["newest_version"], f0["num_versions"]) == (0, 3, 4)
    assert f0["newest_keyframe"] == 2  # keyframe_every 2: a reader without a value starts there
    assert f0["latest"]["quorum_size"] == 1 and f0["latest"]["epoch"] == built.syncer.epoch.epoch
    assert f0["num_pending"] == 1 and f0["pending"] == {LEARNER: 1}, pending_key
    assert f0["num_merged_uncollected"] == 3 and f1["num_pending"] == 0
    assert [e["epoch"] for e in report["epochs"]] == [built.syncer.epoch.epoch]
    assert report["syncers"][0]["syncer_id"] == "test-syncer"
    assert report["learners"][0]["learner_id"] == LEARNER
    objects = report["objects"]
    assert objects["manifests"]["count"] == 8 and objects["contributions"]["count"] == 7
    assert objects["checkpoints"]["count"] == 2  # version 3 of each fragment
    assert objects["total"]["count"] == sum(v["count"] for k, v in objects.items() if k != "total")
    orphans = {o["key"]: o["reason"] for o in report["orphans"]}
    assert set(orphans) == {foreign, orphan}
    assert "top-level" in orphans[foreign]
    assert report["errors"] == []


def test_inspect_reports_bad_content_without_crashing(built):
    built.store.put(layout.learner_heartbeat_key("bob"), b"[1, 2")
    built.store.put(layout.epoch_key(9), records.dumps({"format": "ddiloco.epoch"}))
    built.store.put(layout.quarantine_key(layout.contribution_key(0, "bob", 1)),
                    records.dumps(records.make("quarantine", key="x", reason="non-finite values")))
    built.store.put(layout.RUN_CONFIG, b"{}")
    report = inspect_run(built.store)
    assert report["run"] is None
    errors = "\n".join(report["errors"])
    assert "run.json" in errors and layout.learner_heartbeat_key("bob") in errors
    assert layout.epoch_key(9) in errors
    assert report["quarantined"][0]["reason"] == "non-finite values"
    assert len(report["fragments"]) == 2  # still shown, from the keys
    result = invoke("inspect", built.url)
    assert result.exit_code == 0, result.output


def test_verify_catches_missing_contribution_that_replay_needs(tmp_path):
    """No checkpoint yet (checkpoint_every 10), so a restarted syncer replays every merge
    from version 0 and needs every used contribution: one deleted is a problem."""
    built = build_run(str(tmp_path / "run"), rounds=2, checkpoint_every=10)
    used = ledger.read_manifest(built.store, 0, 1, run_id=built.run["run_id"])["contributions"][0]["key"]
    built.store.delete(used)
    assert any(used in problem for problem in verify_run(built.store))


def test_syncer_republishes_a_deleted_payload_from_the_ledger_M4(tmp_path):
    """[M4] the payloads of the latest version are deleted (by hand, a faulty tool): every
    reader of that version fails and `inspect --verify` says so. A syncer restoring the
    fragment replays the ledger, proves the re-encoded payloads are the manifest's (sha256)
    and puts them back: readers get the same value, and verify is clean again."""
    built = build_run(str(tmp_path / "run"), rounds=3, checkpoint_every=2)  # a checkpoint at the latest version
    before = latest_values(built)
    latest = ledger.latest_version(built.store, 0)
    payloads = [e["key"] for e in ledger.read_manifest(built.store, 0, latest, run_id=built.run["run_id"])["payloads"]]
    for key in payloads:
        built.store.delete(key)
    assert any(payloads[0] in problem for problem in verify_run(built.store))
    built.syncer.restore()
    for key in payloads:
        assert any(info.key == key for info in built.store.list(key)), key
    after = latest_values(built)
    assert all(torch.equal(before[p][k], after[p][k]) for p in before for k in before[p])
    assert verify_run(built.store) == []


# ------------------------------------------------------------------ --verify replays the ledger
def test_verify_replays_the_ledger_through_apply_decision_and_names_a_decision_that_does_not_reproduce():
    """`inspect --verify` replays each fragment from its newest checkpoint with the function a
    commit ran (apply_decision): a clean run verifies; a manifest whose recorded decision was
    edited (its outer lr) while its payloads stayed intact decodes fine, but the replay names it."""
    store = open_store(f"memory://verify-replay-{uuid.uuid4().hex}")
    make_run(store, publish_codec="int4", checkpoint_every=100, retain_versions=100)  # replays from version 0
    beat(store, "a")
    beat(store, "b")
    drive(store, live_syncer(store), rounds=3)
    assert verify_run(store) == []
    run = ledger.read_run(store)
    config = RunConfig.from_record(run)
    plan = ledger.read_plan(store, run_id=run["run_id"])
    reader = FragmentReader(store, run_id=run["run_id"], plan=plan, fragment=0)
    assert replay_check(store, config=config, plan=plan, fragment=0, reader=reader, latest=3) == 0

    key = layout.manifest_key(0, 2)
    m = records.loads(store.get(key), "manifest", where=key)
    store.put(key, records.dumps({**m, "outer_lr": m["outer_lr"] * 0.5}))
    problems = verify_run(store)
    assert len(problems) == 1, problems
    assert problems[0].startswith("fragment 0: the ledger does not replay to version 3") and "version 2" in problems[0]
