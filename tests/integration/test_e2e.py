"""End to end with real processes on real stores (local directory and S3 via moto):
one syncer and three learners; kill -9 a learner and restart it; kill -9 the
syncer and start another; corrupted contributions; export and evaluate."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from ddiloco_cli.numerics import codec
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.store import open_store
from ddiloco_cli.tasks import evaluate, load_task

from support.built_run import invoke
from support.procs import Procs, all_manifests, learner_heartbeat, terminate, versions, wait_for

# Every wait below is for an event; its ceiling only bounds a broken run. The test's own timeout covers
# the sum of those ceilings on a loaded machine (idle, the whole test takes about a minute).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
WAIT_S = 240
POLL_S = 1.0  # the test's own reads share the one-request-at-a-time S3 server with the run

P = 2
# s3:// runs require signatures by default (tests/integration/test_signed_run.py covers them); this test is about faults.
# H = 12 (a contribution every 6 steps per learner): with H = 6 three tiny-model learners wrote a contribution
# every 3 steps each, more than a syncer sharing two loaded cores with them could download and decode, so it
# fell further behind with every merge (and the single-threaded moto server spent half the test serving
# them). Lease and heartbeat are the product defaults (10 s, 2 s): a takeover waits at most one lease.
# Learners poll for a new version at most once a second: polls of latest.json were the largest share of
# the learners' S3 requests (count them: DDILOCO_TEST_MOTO_LOG, tests/support/moto_proc.py).
INIT = ["--task", "ddiloco_cli.tasks.gpt:tiny", "-P", str(P), "-H", "12", "--overlap-steps", "1", "-K", "1",
        "--codec", "int4", "--inner-lr", "2e-3", "--warmup-steps", "0", "--lr-schedule", "constant",
        "--total-steps", "0", "--batch-size", "8", "--checkpoint-every", "4",
        "--max-staleness", "1000", "--no-require-signatures"]
LEARN = ["--threads", "1", "--poll", "1.0"]


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def run_url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "bucket"), None
    b = request.getfixturevalue("s3_url")
    return b.url, b.env


def _bad_contributions(url: str, run_id: str) -> list[str]:
    """Write three bad contributions from learner-0's name: flipped bytes, NaN, wrong shape."""
    store = open_store(url)
    plan = ledger.read_plan(store, run_id=run_id)
    shapes = {s.key: (s.row_end - s.row_start, *s.shape[1:]) if s.shape else () for s in plan.fragments[0]}
    seq = int(time.time() * 1e6) * 10  # far above any session base: never merged by accident
    keys = []

    def header(seq: int) -> dict:
        return records.make("contribution", run_id=run_id, fragment=0, learner_id="learner-0", seq=seq, base_version=0,
                            c_tokens=64, c_steps=1, step=1, nonce=records.new_nonce())

    good = {k: torch.zeros(s) for k, s in shapes.items()}
    data = bytearray(codec.encode_tensors(good, codec="int4", metadata=header(seq)))
    data[-5] ^= 0xFF
    nan = {k: torch.full(s, float("nan")) for k, s in shapes.items()}
    wrong = {k: torch.zeros(3, 5) for k in shapes}
    for i, payload in enumerate([bytes(data), codec.encode_tensors(nan, codec="none", metadata=header(seq + 1)),
                                 codec.encode_tensors(wrong, codec="int4", metadata=header(seq + 2))]):
        key = layout.contribution_key(0, "learner-0", seq + i)
        store.put_if_absent(key, payload)
        keys.append(key)
    return keys


def test_survives_kill9_of_learner_and_syncer(run_url, tmp_path):
    url, env = run_url
    procs = Procs(tmp_path, env=env)
    try:
        r = invoke("init", url, *INIT)  # the admin's commands (init, export) in this process: no process starts
        assert r.exit_code == 0, r.output
        store = open_store(url)
        run = ledger.read_run(store)
        task = load_task(run["task"])
        model = task.build_model()
        initial_loss = evaluate(task, model, batch_size=16, max_batches=4)

        procs.start("syncer-1", "sync", url, "--poll", "0.2", "--no-gc")
        learners = {lid: procs.start(lid, "learn", url, "--learner-id", lid, *LEARN)
                    for lid in ("learner-0", "learner-1", "learner-2")}
        wait_for(lambda: min(versions(url, P)) >= 3, timeout_s=WAIT_S, what="3 versions of every fragment",
                 procs=procs, poll_s=POLL_S)
        wait_for(lambda: all((learner_heartbeat(url, lid) or {}).get("num_contributions", 0) >= 2 for lid in learners),
                 timeout_s=WAIT_S, what="every learner contributing", procs=procs, poll_s=POLL_S)

        # kill -9 a learner (its uploads may be in flight): versions keep advancing without it
        learners["learner-2"].send_signal(signal.SIGKILL)
        learners["learner-2"].wait()
        before = versions(url, P)
        wait_for(lambda: min(v - b for v, b in zip(versions(url, P), before)) >= 2, timeout_s=WAIT_S,
                 what="versions advancing while learner-2 is gone", procs=procs, poll_s=POLL_S)
        first_session = learner_heartbeat(url, "learner-2")["session"]
        learners["learner-2"] = procs.start("learner-2b", "learn", url, "--learner-id", "learner-2", *LEARN)

        seen_versions = versions(url, P)  # only manifests committed after the restart can hold its contributions

        def rejoined() -> bool:
            hb = learner_heartbeat(url, "learner-2")
            if hb is None or hb["session"] == first_session:
                return False
            for p in range(P):
                latest = ledger.latest_version(store, p) or 0
                for v in range(seen_versions[p] + 1, latest + 1):
                    m = ledger.read_manifest(store, p, v)
                    if any(c["learner_id"] == "learner-2" and c["seq"] > hb["session"] and c["used"]
                           for c in m["contributions"]):
                        return True
                seen_versions[p] = latest
            return False

        wait_for(rejoined, timeout_s=WAIT_S, what="learner-2 contributing again after its restart", procs=procs,
                 poll_s=POLL_S)

        # corrupted contributions are quarantined, never merged; training goes on
        bad_keys = _bad_contributions(url, run["run_id"])
        wait_for(lambda: all(any(i.key == layout.quarantine_key(k) for i in store.list("quarantine/")) for k in bad_keys),
                 timeout_s=WAIT_S, what="quarantine reports for the 3 bad contributions", procs=procs, poll_s=POLL_S)

        # kill -9 the syncer, start another: it takes over after the lease
        procs.procs[0].send_signal(signal.SIGKILL)
        procs.procs[0].wait()
        killed_at = versions(url, P)
        procs.start("syncer-2", "sync", url, "--poll", "0.2", "--no-gc")
        wait_for(lambda: min(v - k for v, k in zip(versions(url, P), killed_at)) >= 2, timeout_s=WAIT_S,
                 what="the second syncer committing", procs=procs, poll_s=POLL_S)

        for proc in learners.values():  # all at once: each sends what it has not sent [L7] and leaves
            proc.send_signal(signal.SIGTERM)
        for lid, proc in learners.items():
            assert proc.wait(timeout=60) == 0, procs.log(lid)
            assert learner_heartbeat(url, lid)["state"] == "left"
        assert terminate(procs.procs[-1]) == 0

        # the ledger: contiguous versions, nothing applied twice, nothing lost, bad ones never used
        manifests = all_manifests(url)
        used: dict[tuple[str, int], int] = {}
        for p, ms in manifests.items():
            assert [m["version"] for m in ms] == list(range(len(ms)))
            epochs = [m["epoch"] for m in ms]
            assert epochs == sorted(epochs) and {1, 2} <= set(epochs)
            for m in ms:
                for c in m["contributions"]:
                    assert c["key"] not in bad_keys
                    if c["used"]:
                        used[(c["key"], p)] = used.get((c["key"], p), 0) + 1
        assert used and max(used.values()) == 1, "a contribution was applied twice"
        recorded = {c["key"] for ms in manifests.values() for m in ms for c in m["contributions"]}
        quarantined = {i.key[len("quarantine/"):-len(".json")] for i in store.list("quarantine/")}
        for p, ms in manifests.items():
            high_water = ms[-1]["high_water"]
            for info in store.list(layout.contribution_prefix(p)):
                _, lid, seq = layout.parse_contribution_key(info.key)
                if seq <= high_water.get(lid, -1):
                    assert info.key in recorded or info.key in quarantined, f"{info.key} was lost"

        # the exported model is better than the initial one
        out = tmp_path / "model.safetensors"
        r = invoke("export", url, str(out))
        assert r.exit_code == 0, r.output
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(out)), strict=True)
        final_loss = evaluate(task, model, batch_size=16, max_batches=4)
        assert final_loss < initial_loss - 0.3, (initial_loss, final_loss)
    finally:
        procs.close()
