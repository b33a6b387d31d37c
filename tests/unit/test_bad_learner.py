"""One bad learner (or one bad object) cannot hurt the run (issue 25): signatures checked
before decoding, quarantine reports that survive a restart [A2]; bounded norms, shares and counters that survive
restarts; heartbeats from the future; status alerts on a learner that keeps being cut."""

from __future__ import annotations

import pytest
import torch

from ddiloco_cli import codec, layout, ledger, records, signing
from ddiloco_cli.runinit import RunSpec, init_run
from ddiloco_cli.store import open_store
from ddiloco_cli.syncer import Syncer, SyncerOptions
from support.runs import fragment0_contribution

TASK = "ddiloco_cli.tasks.gpt:tiny"


@pytest.fixture
def keys(tmp_path):
    return {name: signing.new_key(tmp_path / f"{name}.pem") for name in ("admin", "a", "syncer")}


def _signed_run(tmp_path, keys):
    store = open_store(str(tmp_path / "run"))
    run = init_run(store, RunSpec(task=TASK, num_fragments=2, sync_every=4, codec="none", publish_codec="none",
                                  lease_s=60.0, heartbeat_s=1.0, outer_lr=0.7), admin=keys["admin"])
    signing.admit(store, run=run, member_id="a", public_key=keys["a"].public_key, role="learner", admin=keys["admin"])
    signing.admit(store, run=run, member_id="s", public_key=keys["syncer"].public_key, role="syncer",
                  admin=keys["admin"])
    rec = records.make("learner_heartbeat", run_id=run["run_id"], learner_id="a", state="running", step=1, tokens=1,
                       step_time_s=0.01)
    hb = layout.learner_heartbeat_key("a")
    store.put(hb, records.dumps(signing.sign_record(rec, run_id=run["run_id"], key=hb, signer=keys["a"])))
    return store, run




def _syncer(store, keys, name: str) -> Syncer:
    s = Syncer(store, options=SyncerOptions(syncer_id=name, poll_s=0.01, gc=False, decode_threads=1,
                                            key_path=str(keys["syncer"].path)))
    assert s.acquire()
    s.check_fence()
    s.restore()
    return s


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


def test_junk_is_refused_before_decoding_and_costs_each_syncer_once_A2(tmp_path, keys, monkeypatch):
    store, run = _signed_run(tmp_path, keys)
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


def test_a_forged_or_resized_quarantine_report_is_not_believed_A2(tmp_path, keys, monkeypatch):
    store, run = _signed_run(tmp_path, keys)
    good_key, good = fragment0_contribution(store, run, "a", 1, signer=keys["a"])
    store.put_if_absent(good_key, good)
    fake = records.make("quarantine", key=good_key, reason="junk", size=len(good))  # unsigned: anyone could write it
    store.put_if_absent(layout.quarantine_key(good_key), records.dumps(fake))
    s = _syncer(store, keys, "s")
    s.poll_contributions()
    assert s.intake.reports_believed == 0 and good_key not in s.intake.bad_keys
    assert [c.key for cs in s.states[0].pending.values() for c in cs] == [good_key]


def test_an_honest_merge_is_not_queued_behind_a_junk_flood_and_junk_is_judged_once_across_a_restart_A2(
        tmp_path, keys, monkeypatch):
    from ddiloco_cli.poll import UNKNOWN_PER_POLL

    store, run = _signed_run(tmp_path, keys)
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


# ------------------------------------------------------------ bounded influence
def test_one_learners_share_of_a_merge_is_capped_and_replayed(tmp_path):
    from support.runs import beat, contribution, live_syncer, make_run, restored, step

    from ddiloco_cli.decide import MAX_SHARE

    store = open_store(str(tmp_path / "run"))
    make_run(store, quorum=3)
    for lid in "abc":
        beat(store, lid)
    s = live_syncer(store, fragments=[0])
    contribution(store, 0, "a", 1, c_tokens=64, c_steps=2)
    contribution(store, 0, "b", 1, c_tokens=48, c_steps=2)
    contribution(store, 0, "c", 1, c_tokens=2**40, c_steps=2)  # counters that would swamp the merge
    assert step(s, 0)
    used = {e["learner_id"]: e for e in ledger.read_manifest(store, 0, 1)["contributions"]}
    eff = {lid: e["weight"] * e.get("discount", 1.0) * e.get("share_cap", 1.0) for lid, e in used.items()}
    assert "share_cap" not in used["a"] and "share_cap" not in used["b"]
    assert MAX_SHARE == 0.5 and eff["c"] == pytest.approx(eff["a"] + eff["b"])  # half the merge's weight
    r = restored(store)
    assert all(torch.equal(t, r.states[0].current.raw[k]) for k, t in s.states[0].current.raw.items())


def test_a_merge_of_weight_zero_takes_no_outer_step_momentum_included(tmp_path):
    from support.runs import beat, contribution, live_syncer, make_run, restored, step

    store = open_store(str(tmp_path / "run"))
    make_run(store, outer_momentum=0.9)
    beat(store, "a")
    s = live_syncer(store, fragments=[0])
    contribution(store, 0, "a", 1)
    assert step(s, 0)  # momentum is not zero now
    before = {k: t.clone() for k, t in s.states[0].current.raw.items()}
    contribution(store, 0, "a", 2, base_version=1, c_tokens=0, c_steps=2)  # claims no work: weight 0
    assert step(s, 0)
    m = ledger.read_manifest(store, 0, 2)
    assert m["outer_steps"] == 1 and m["contributions"][0]["weight"] == 0
    assert all(torch.equal(t, s.states[0].current.raw[k]) for k, t in before.items())
    r = restored(store)
    assert r.states[0].outer.num_steps == 1
    assert all(torch.equal(t, r.states[0].current.raw[k]) for k, t in before.items())


# ------------------------------------------------------ counters a learner cannot inflate
def test_counted_tokens_and_steps_are_bounded_by_the_run_and_the_clock(tmp_path):
    import time

    from support.runs import beat, contribution, live_syncer, make_run, step

    from ddiloco_cli.decide import STEP_SLACK, TOKEN_SLACK

    store = open_store(str(tmp_path / "run"))
    t0 = time.time()
    make_run(store, max_tokens_per_step=32, sync_every=2)
    assert ledger.read_run(store)["max_tokens_per_step"] == 32
    beat(store, "a")
    s = live_syncer(store, fragments=[0])
    contribution(store, 0, "a", 1, c_tokens=64, c_steps=2)  # honest: 32 tokens a step
    assert step(s, 0)
    contribution(store, 0, "a", 2, base_version=1, c_tokens=2**40, c_steps=2)  # tokens inflated
    assert step(s, 0)
    contribution(store, 0, "a", 3, base_version=2, c_tokens=2**45, c_steps=2**40)  # steps and tokens inflated
    assert step(s, 0)
    w = [ledger.read_manifest(store, 0, v)["contributions"][0]["weight"] for v in (1, 2, 3)]
    assert w[0] == 64 * 64 / 2  # within the bound: unchanged
    assert w[1] == (TOKEN_SLACK * 32 * 2) ** 2 / 2
    max_steps = 2 + STEP_SLACK * (time.time() - t0) / 0.01  # the live learners' step time: 0.01 s
    assert w[2] <= (TOKEN_SLACK * 32) ** 2 * max_steps < 1e-6 * 2**90 / 2**40


# ---------------------------------------------------------------------- clocks
def test_a_heartbeat_dated_in_the_future_is_invalid_not_live(tmp_path):
    import os
    import time

    from support.runs import beat, live_syncer, make_run

    from ddiloco_cli.learner.session import check_id_free
    from ddiloco_cli.observe import run_status

    store = open_store(str(tmp_path / "run"))
    make_run(store, lease_s=2.0)
    beat(store, "m")
    beat(store, "a")
    path = tmp_path / "run" / layout.learner_heartbeat_key("m")
    future = time.time() + 3 * 3600  # three hours ahead: a clock gone wrong
    os.utime(path, (future, future))
    s = live_syncer(store)
    s.learners.refresh()
    assert s.live_learners == {"a"}  # m is not live (and does not scale the outer lr)
    held = check_id_free(store, "m", lease_s=2.0, sleep=lambda _: pytest.fail("waited on an invalid heartbeat"))
    assert held is not None  # the id is free: a new session may take it
    status = run_status(store)
    assert {r["learner_id"]: r["alive"] for r in status["learners"]} == {"a": True}
    assert any(layout.learner_heartbeat_key("m") in e and "future" in e for e in status["errors"])


# ------------------------------------------------------------------- visibility
def test_status_alerts_on_a_learner_whose_contributions_keep_being_clipped(tmp_path):
    from support.runs import beat, contribution, live_syncer, make_run, step

    from ddiloco_cli.observe import run_status
    from ddiloco_cli.syncstate import SUSPECT_AFTER

    store = open_store(str(tmp_path / "run"))
    make_run(store)
    beat(store, "a")
    s = live_syncer(store, fragments=[0])
    for seq in range(1, 9):  # eight honest norms: the bound is on
        contribution(store, 0, "a", seq, base_version=s.states[0].version)
        assert step(s, 0)
    beat(store, "a", state="left")
    beat(store, "m")
    s.learners.refresh()
    for i in range(SUSPECT_AFTER):
        v = s.states[0].version
        big = {k: 500 * t for k, t in contribution(store, 0, "a", 100 + i, key=f"tmp/{i}")[2].items()}
        contribution(store, 0, "m", 10 + i, base_version=v, tensors=big)
        assert step(s, 0)
        assert not any("learner m" in a for a in s.alerts()) or i == SUSPECT_AFTER - 1
    assert any("learner m" in a and "norm clipped" in a for a in s.alerts())
    s.heartbeat(force=True)
    assert any("learner m" in a and "revoke" in a for a in run_status(store)["alerts"])
    contribution(store, 0, "m", 20, base_version=s.states[0].version)  # an honest one clears it
    assert step(s, 0)
    assert not any("learner m" in a for a in s.alerts())
