"""One bad learner (or one bad object) cannot hurt the run (issue 25): signatures are
checked before decoding and quarantine reports survive a restart [A2]."""

from __future__ import annotations

import pytest
import torch

from ddiloco_cli import codec, layout, ledger, records, signing
from ddiloco_cli.published import expected_shapes
from ddiloco_cli.runinit import RunSpec, init_run
from ddiloco_cli.store import open_store
from ddiloco_cli.syncer import Syncer, SyncerOptions

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


def _payload(store, run, learner_id: str, seq: int, signer: signing.Signer | None) -> tuple[str, bytes]:
    plan = ledger.read_plan(store, run_id=run["run_id"])
    g = torch.Generator().manual_seed(seq)
    tensors = {k: 0.01 * torch.randn(s, generator=g) for k, s in expected_shapes(plan, 0).items()}
    header = records.make("contribution", run_id=run["run_id"], fragment=0, learner_id=learner_id, seq=seq,
                          base_version=0, c_tokens=64, c_steps=2, nonce=records.new_nonce())
    data = codec.encode_tensors(tensors, codec="none", metadata=header)
    key = layout.contribution_key(0, learner_id, seq)
    if signer is not None:
        data = signing.sign_payload(data, kind="contribution", run_id=run["run_id"], key=key, signer=signer)
    return key, data


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
    good_key, good = _payload(store, run, "a", 1, keys["a"])
    store.put_if_absent(good_key, good)
    junk = []
    for i in range(12):  # unsigned payloads under fake ids, and one of a's signed by another key
        key, data = _payload(store, run, f"fake{i}", 1, None)
        store.put_if_absent(key, data)
        junk.append(key)
    key, data = _payload(store, run, "a", 2, keys["syncer"])
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
    good_key, good = _payload(store, run, "a", 1, keys["a"])
    store.put_if_absent(good_key, good)
    fake = records.make("quarantine", key=good_key, reason="junk", size=len(good))  # unsigned: anyone could write it
    store.put_if_absent(layout.quarantine_key(good_key), records.dumps(fake))
    s = _syncer(store, keys, "s")
    s.poll_contributions()
    assert s.intake.reports_believed == 0 and good_key not in s.intake.bad_keys
    assert [c.key for cs in s.states[0].pending.values() for c in cs] == [good_key]
