"""A run that requires signatures, end to end ([A2], [A3], [A5]; PROTOCOL.md, "Signatures").

In process: an admitted learner's contribution is merged; unsigned, forged,
replayed and unadmitted ones are quarantined with their reason; fake heartbeats
move neither liveness nor the outer lr; an unsigned epoch fences nobody; manifests
are signed and readers refuse altered ones. With real processes (slow): learners
with admitted keys train and are merged, a learner whose key is not admitted
refuses to start, and a revoked learner's later contributions are quarantined.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from ddiloco_cli.errors import FencedError, UsageError
from ddiloco_cli.ops.observe import inspect_run
from ddiloco_cli.ops.runinit import RunSpec, init_run
from ddiloco_cli.protocol import layout, ledger, records, signing
from ddiloco_cli.protocol.published import expected_shapes
from ddiloco_cli.protocol.signing import SignatureError
from ddiloco_cli.store import open_store
from ddiloco_cli.syncer.core import Syncer, SyncerOptions

from support.built_run import invoke
from support.procs import Procs, all_manifests, terminate, wait_for
from support.runs import fragment0_contribution

TASK = "ddiloco_cli.tasks.gpt:tiny"


@pytest.fixture
def keys(tmp_path):
    return {name: signing.new_key(tmp_path / f"{name}.pem") for name in ("admin", "a", "b", "syncer")}




def _beat(store, run, learner_id: str, *, signer: signing.Signer | None) -> None:
    rec = records.make("learner_heartbeat", run_id=run["run_id"], learner_id=learner_id, state="running", step=1,
                       tokens=1, step_time_s=0.01)
    key = layout.learner_heartbeat_key(learner_id)
    if signer is not None:
        rec = signing.sign_record(rec, run_id=run["run_id"], key=key, signer=signer)
    store.put(key, records.dumps(rec))


def test_signed_run_merges_admitted_and_quarantines_the_rest_A2_A3_A5(keys, tmp_path):
    store = open_store(str(tmp_path / "run"))
    run = init_run(store, RunSpec(task=TASK, num_fragments=2, sync_every=4, codec="none", publish_codec="none",
                                  lease_s=60.0, heartbeat_s=1.0, outer_lr=0.7, outer_lr_scaling="participation",
                                  ), admin=keys["admin"])
    for member, role in (("a", "learner"), ("s", "syncer")):
        signing.admit(store, run=run, member_id=member, public_key=keys["syncer" if role == "syncer" else member].public_key,
                      role=role, admin=keys["admin"])
    _beat(store, run, "a", signer=keys["a"])
    _beat(store, run, "b", signer=keys["b"])  # b signs, but b was never admitted
    for i in range(50):  # the fake learners that used to cut the outer lr 50-fold
        _beat(store, run, f"fake-{i}", signer=None)

    good_key, good = fragment0_contribution(store, run, "a", 10, signer=keys["a"])
    store.put_if_absent(good_key, good)
    forged_key, forged = fragment0_contribution(store, run, "a", 11, signer=keys["a"])
    store.put_if_absent(forged_key, forged[:-4] + bytes(b ^ 0x40 for b in forged[-4:]))  # altered after signing
    replayed_key = layout.contribution_key(0, "a", 12)
    store.put_if_absent(replayed_key, good)  # a's signed bytes under another seq
    unsigned_key, unsigned = fragment0_contribution(store, run, "c", 10, signer=None)
    store.put_if_absent(unsigned_key, unsigned)
    _beat(store, run, "c", signer=None)
    stranger_key, stranger = fragment0_contribution(store, run, "b", 10, signer=keys["b"])
    store.put_if_absent(stranger_key, stranger)
    impostor_key, impostor = fragment0_contribution(store, run, "a", 13, signer=keys["b"])  # b's key, a's name
    store.put_if_absent(impostor_key, impostor)

    with pytest.raises(UsageError, match="is not admitted as a syncer key"):
        Syncer(store, options=SyncerOptions(syncer_id="s", key_path=str(tmp_path / "a.pem"), gc=False))
    syncer = Syncer(store, options=SyncerOptions(syncer_id="s", key_path=str(tmp_path / "syncer.pem"), gc=False,
                                                 poll_s=0.01))
    assert syncer.acquire()
    syncer.check_fence()
    syncer.restore()
    syncer._refresh_learners()
    assert syncer.live_learners == {"a"}  # [A3]: unsigned and unadmitted heartbeats are not learners
    syncer.poll_contributions()
    assert syncer.maybe_merge(syncer.states[0])

    manifest = ledger.read_manifest(store, 0, 1, trust=signing.Trust(store, run=run))
    assert [(c["learner_id"], c["seq"], c["used"]) for c in manifest["contributions"]] == [("a", 10, True)]
    assert manifest["outer_lr"] == pytest.approx(0.7)  # one of one live learner: no 51-fold cut
    signing.verify_record(manifest, run_id=run["run_id"], key=layout.manifest_key(0, 1),
                          allowed={keys["syncer"].public_key})
    epoch_key = layout.epoch_key(syncer.epoch.epoch)
    signing.verify_record(json.loads(store.get(epoch_key)), run_id=run["run_id"], key=epoch_key,
                          allowed={keys["syncer"].public_key})

    reasons = {q["key"]: q["reason"] for q in inspect_run(store)["quarantined"]}
    assert "forged" in reasons[forged_key] and "forged" in reasons[replayed_key]
    assert "'c' is not admitted to this run" in reasons[unsigned_key]  # an unadmitted id's object: not even read
    assert "not admitted to this run" in reasons[stranger_key]
    assert "not the key admitted" in reasons[impostor_key]
    assert good_key not in reasons

    # [A5] an unsigned epoch fences nobody; one signed by an admitted syncer key does
    fake = records.make("epoch", run_id=run["run_id"], epoch=90, syncer_id="x", fragments=[0, 1], nonce="n")
    store.put_if_absent(layout.epoch_key(90), records.dumps(fake))
    syncer.check_fence()
    real = signing.sign_record({**fake, "epoch": 91}, run_id=run["run_id"], key=layout.epoch_key(91),
                               signer=keys["syncer"])
    store.put_if_absent(layout.epoch_key(91), records.dumps(real))
    with pytest.raises(FencedError):
        syncer.check_fence()

    # [A5] readers refuse an altered manifest; version 0 is signed by the admin key
    ledger.read_manifest(store, 1, 0, trust=signing.Trust(store, run=run))
    store.put(layout.manifest_key(0, 1), records.dumps({**manifest, "outer_steps": 7}))
    with pytest.raises(SignatureError, match="forged"):
        ledger.read_manifest(store, 0, 1, trust=signing.Trust(store, run=run))


def test_learner_signs_what_it_writes_and_refuses_an_unadmitted_key_A1_A2_A3(keys, tmp_path):
    from ddiloco_cli.learner.session import heartbeat_bytes
    from ddiloco_cli.learner.sync import DiLoCoSync, SyncOptions
    from ddiloco_cli.learner.uploader import contribution_bytes
    from ddiloco_cli.tasks import load_task

    store = open_store(str(tmp_path / "run"))
    run = init_run(store, RunSpec(task=TASK, num_fragments=2, sync_every=4), admin=keys["admin"])
    signing.admit(store, run=run, member_id="a", public_key=keys["a"].public_key, role="learner", admin=keys["admin"])
    key, _ = fragment0_contribution(store, run, "a", 5, signer=None)
    header = records.make("contribution", run_id=run["run_id"], fragment=0, learner_id="a", seq=5, base_version=0,
                          c_tokens=1, c_steps=1, nonce="n")
    plan = ledger.read_plan(store, run_id=run["run_id"])
    delta = {k: torch.zeros(s) for k, s in expected_shapes(plan, 0).items()}
    data = contribution_bytes(delta, header, codec_name="int4", block_size=64, key=key, signer=keys["a"])
    trust = signing.Trust(store, run=run)
    trust.check_payload(data, kind="contribution", key=key, member_id="a")
    beat = records.make("learner_heartbeat", run_id=run["run_id"], learner_id="a", state="running", step=1, tokens=1)
    trust.check_record(json.loads(heartbeat_bytes(beat, signer=keys["a"])), key=layout.learner_heartbeat_key("a"),
                       role="learner", member_id="a")

    model = load_task(TASK).build_model()
    for key_path, match in ((None, "requires signatures: pass --key"), (tmp_path / "b.pem", "has key .* admitted")):
        sync = DiLoCoSync(store, model, learner_id="a", options=SyncOptions(key_path=key_path, handle_sigterm=False))
        with pytest.raises(UsageError, match=match):
            sync.start()


def _admit(url: str, member: str, pub: str, admin_key, *extra: str) -> None:
    r = invoke("admit", url, member, pub, "--admin-key", str(admin_key), *extra)
    assert r.exit_code == 0, r.output


@pytest.mark.slow
def test_signed_run_with_real_processes_A1_A2(tmp_path):
    # the admin's commands (keys, init, admit, inspect) run in this process, as in
    # tests/unit/test_signing.py: each would be a process start (a torch import) that the
    # run's processes wait for; the learners and the syncer, the subject here, are real processes
    url = str(tmp_path / "bucket")
    procs = Procs(tmp_path)
    pubs = {}
    for name in ("a", "b", "rogue", "syncer"):
        r = invoke("keys", "new", str(tmp_path / f"{name}.pem"))
        assert r.exit_code == 0, r.output
        pubs[name] = r.stdout.strip().splitlines()[-1]
    admin_key = tmp_path / "admin.pem"
    try:
        r = invoke("init", url, "--task", TASK, "-P", "2", "-H", "4", "--overlap-steps", "1", "--total-steps", "0",
                   "--batch-size", "4", "--lease", "4", "--heartbeat", "1", "--require-signatures",
                   "--admin-key", str(admin_key))
        assert r.exit_code == 0, r.output
        _admit(url, "a", pubs["a"], admin_key)
        _admit(url, "b", pubs["b"], admin_key)
        _admit(url, "syncer-1", pubs["syncer"], admin_key, "--role", "syncer")

        # the two refusals as real processes, side by side: [A1] a learner whose key is not admitted
        # is refused at start; a syncer without a key in a run that requires signatures
        rogue = procs.spawn("rogue", [sys.executable, "-m", "ddiloco_cli", "learn", url, "--learner-id", "rogue",
                                      "--key", str(tmp_path / "rogue.pem"), "--steps", "4"])
        keyless = procs.spawn("keyless", [sys.executable, "-m", "ddiloco_cli", "sync", url, "--max-runtime", "1"])
        assert rogue.wait(timeout=120) == 2 and "has no key admitted" in procs.log("rogue"), procs.log("rogue")
        assert keyless.wait(timeout=120) == 2 and "requires signatures: pass --key" in procs.log("keyless"), \
            procs.log("keyless")

        procs.start("syncer", "sync", url, "--poll", "0.2", "--no-gc", "--key", str(tmp_path / "syncer.pem"))
        procs.start("a", "learn", url, "--learner-id", "a", "--key", str(tmp_path / "a.pem"), "--threads", "1")
        procs.start("b", "learn", url, "--learner-id", "b", "--key", str(tmp_path / "b.pem"), "--threads", "1")

        def used() -> set[str]:
            return {c["learner_id"] for ms in all_manifests(url).values() for m in ms for c in m["contributions"]
                    if c["used"]}

        wait_for(lambda: used() >= {"a", "b"}, timeout_s=180, what="merges of a and b", procs=procs)
        # revoke b by re-admitting its id with another key: b's later contributions are refused
        _admit(url, "b", pubs["rogue"], admin_key)
        store = open_store(url)
        wait_for(lambda: any(q["key"].startswith("contributions/") and "/b/" in q["key"]
                             and "not the key admitted" in q["reason"] for q in inspect_run(store)["quarantined"]),
                 timeout_s=120, what="b's contributions quarantined after its key was revoked", procs=procs)
        before = {p: len(ms) for p, ms in all_manifests(url).items()}
        wait_for(lambda: all(len(ms) > before[p] + 1 for p, ms in all_manifests(url).items()), timeout_s=120,
                 what="a's merges continuing", procs=procs)
        r = invoke("inspect", url, "--json")
        assert r.exit_code == 0 and "not the key admitted" in r.stdout
    finally:
        for p in procs.procs:
            if p.poll() is None:
                terminate(p)
        procs.close()

