"""A fenced syncer writes nothing (issue 9, finding 5; PROTOCOL.md [F5], "Known limitations").

* ``FencedStore`` checks the fence before every write of any kind, at most every
  ``interval_s`` and always before a manifest create; once fenced, for good.
* The window (a pause between the last check and the manifest create) is not
  closable with create-only writes; the test shows what it costs: at most one
  version under the old epoch, on the one linear history, nothing lost or applied twice.
* With real processes: a syncer frozen past its lease (SIGSTOP) while a standby
  takes over and learners keep sending, then thawed (SIGCONT), writes nothing and
  exits with the fenced error.
"""

from __future__ import annotations

import math
import signal

import pytest

from ddiloco_cli.errors import FencedError
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.store import open_store
from ddiloco_cli.syncer.core import Syncer, SyncerOptions
from ddiloco_cli.syncer.fence import FencedStore

from support.built_run import invoke
from support.procs import Procs, wait_for
from support.runs import RecordingStore, beat, contribution, live_syncer, make_run, manifests, restored, step


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def run_store(request, store_url):
    store = open_store(store_url(request.param))
    make_run(store)
    return store


def _claim(store, syncer_id: str, fragments: list[int]) -> ledger.Epoch:
    run_id = ledger.read_run(store)["run_id"]
    return ledger.claim_epoch(store, run_id=run_id, syncer_id=syncer_id, fragments=fragments, created_s=0.0)


def _fenced_store(store, epoch: ledger.Epoch, *, interval_s: float) -> tuple[FencedStore, RecordingStore]:
    recording = RecordingStore(store)
    return FencedStore(recording, run_id=ledger.read_run(store)["run_id"], epoch=epoch, interval_s=interval_s), recording


def test_every_kind_of_write_is_fenced_for_good_F5(run_store):
    """[F5] once an overlapping epoch above ours exists: put, put_if_absent, delete and the
    temp-file sweep raise FencedError and reach no store; the fence is sticky."""
    mine = _claim(run_store, "old", [0, 1])
    fenced, recording = _fenced_store(run_store, mine, interval_s=0.0)
    fenced.put(layout.syncer_heartbeat_key(mine.epoch), b"{}")
    _claim(run_store, "new", [1])
    writes = [lambda: fenced.put(layout.syncer_heartbeat_key(mine.epoch), b"{}"),
              lambda: fenced.put_if_absent(layout.quarantine_key("contributions/p00000/a/x"), b"{}"),
              lambda: fenced.delete(layout.contribution_key(0, "a", 1)),
              lambda: fenced.put_if_absent(layout.manifest_key(0, 1), b"{}"),
              lambda: fenced.remove_stale_temp(older_than_s=0.0)]
    for write in writes:
        with pytest.raises(FencedError, match=r"epoch 2 \(new\) took over fragments \[1\]"):
            write()
    assert recording.log == [("put", layout.syncer_heartbeat_key(mine.epoch))]
    assert fenced.fenced


def test_manifest_creates_always_check_other_writes_are_rate_limited_F5(run_store):
    """[F5] within the interval a heartbeat goes through unchecked, but a manifest create
    checks the fence every time."""
    mine = _claim(run_store, "old", [0])
    fenced, recording = _fenced_store(run_store, mine, interval_s=math.inf)
    fenced.put(layout.syncer_heartbeat_key(mine.epoch), b"{}")  # the first write checks
    _claim(run_store, "new", [0])
    fenced.put(layout.syncer_heartbeat_key(mine.epoch), b"{}")  # inside the interval: not checked
    with pytest.raises(FencedError):
        fenced.put_if_absent(layout.manifest_key(0, 1), b"{}")
    assert [k for _, k in recording.log] == [layout.syncer_heartbeat_key(mine.epoch)] * 2


def test_only_valid_overlapping_or_newer_epochs_fence_F5(run_store):
    """[F5] disjoint, invalid and foreign claims above ours do not fence (and are read once);
    a newer protocol's claim does, with the upgrade message."""
    mine = _claim(run_store, "old", [0])
    fenced, _ = _fenced_store(run_store, mine, interval_s=0.0)
    _claim(run_store, "shard", [1])
    run_store.put_if_absent(layout.epoch_key(3), b"junk")
    foreign = records.make("epoch", run_id="other", epoch=4, syncer_id="x", fragments=[0], nonce="n")
    run_store.put_if_absent(layout.epoch_key(4), records.dumps(foreign))
    fenced.put(layout.syncer_heartbeat_key(mine.epoch), b"{}")
    newer = {**records.make("epoch", run_id=ledger.read_run(run_store)["run_id"], epoch=5, syncer_id="v2",
                            fragments=[7], nonce="n"), "protocol_version": records.PROTOCOL_VERSION + 1}
    run_store.put_if_absent(layout.epoch_key(5), records.dumps(newer))
    with pytest.raises(FencedError, match="upgrade ddiloco"):
        fenced.put(layout.syncer_heartbeat_key(mine.epoch), b"{}")


def test_base_newer_than_known_checks_the_fence_before_quarantine_F5(run_store):
    """[F5] a contribution based on a version this syncer never committed means another
    syncer commits: it checks the fence at once (whatever its interval) and stops,
    instead of quarantining valid work."""
    beat(run_store, "a")
    a = live_syncer(run_store, syncer_id="A")
    a.store.interval_s = math.inf  # no write would check the fence on its own
    b = Syncer(RecordingStore(run_store, clock_shift_s=1000.0), options=SyncerOptions(syncer_id="B", gc=False))
    assert b.acquire()
    b.check_fence()
    b.restore()
    contribution(run_store, 0, "a", 1)
    assert step(b, 0)
    contribution(run_store, 0, "a", 2, base_version=1)
    with pytest.raises(FencedError, match=r"epoch 2 \(B\) took over"):
        a.poll_contributions()
    assert run_store.list(layout.QUARANTINE_PREFIX) == []


class _TakeoverBeforeManifest:
    """Runs ``takeover`` once, just before the first manifest create reaches the store:
    a pause after the fence check let a standby claim and restore (the known window)."""

    def __init__(self, inner, takeover):
        self.inner, self.url, self.takeover = inner, inner.url, takeover

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if self.takeover is not None and (layout.key_kind(key) or ("",))[0] == "manifests":
            takeover, self.takeover = self.takeover, None
            takeover()
        return self.inner.put_if_absent(key, data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_commit_in_the_window_keeps_one_linear_history_F5_W3(store_url):
    """[F5][W3] a syncer paused between its fence check and its manifest create commits that
    one version under its old epoch after the takeover. The history stays linear: the new
    owner's create of the same version fails, it re-reads, and commits the next one; the
    old syncer's next write is fenced. Every contribution is applied exactly once, and a
    replay of the ledger reproduces the new owner's state bit for bit."""
    store = open_store(store_url("local"))
    make_run(store)
    beat(store, "a")
    standby: dict[str, Syncer] = {}

    def takeover() -> None:  # B sees A's lease as expired (its clock runs 1000 s ahead)
        b = Syncer(RecordingStore(store, clock_shift_s=1000.0), options=SyncerOptions(syncer_id="B", gc=False))
        assert b.acquire()
        b.check_fence()
        b.restore()
        standby["B"] = b

    a = live_syncer(_TakeoverBeforeManifest(store, takeover), syncer_id="A")
    contribution(store, 0, "a", 1)
    assert step(a, 0)  # commits version 1 under epoch 1, after epoch 2 was claimed
    b = standby["B"]
    assert (a.epoch.epoch, b.epoch.epoch) == (1, 2)

    beat(store, "b")
    contribution(store, 0, "b", 2)
    b._refresh_learners()
    assert not step(b, 0)  # its version 1 lost the create: it re-reads (a's contribution is merged there)
    beat(store, "a", state="left")  # only b is live now: b's pending contribution is all there is
    b._refresh_learners()
    assert step(b, 0)  # version 2 from b's contribution, on top of A's version 1
    contribution(store, 1, "a", 3)
    beat(store, "a")  # a is the only live learner and has reported: A merges at once, no grace window
    beat(store, "b", state="left")  # (which a fast merge, a short sync_time, would otherwise open)
    a._refresh_learners()
    a.poll_contributions()
    with pytest.raises(FencedError, match=r"epoch 2 \(B\) took over"):
        a.maybe_merge(a.states[1])
    with pytest.raises(FencedError):
        a.heartbeat(force=True)

    history = manifests(store, 0)
    assert [m["version"] for m in history] == [0, 1, 2]
    assert [m["epoch"] for m in history] == [0, 1, 2]
    used = [c["key"] for m in history for c in m["contributions"] if c["used"]]
    assert used == [layout.contribution_key(0, "a", 1), layout.contribution_key(0, "b", 2)]
    assert ledger.list_versions(store, 1) == [0]  # A committed nothing after it was fenced
    replayed = restored(store)
    assert replayed.states[0].version == 2
    assert replayed.states[0].outer.num_steps == b.states[0].outer.num_steps == 2
    for k, v in b.states[0].value.items():
        assert v.equal(replayed.states[0].value[k]), k
    for k, v in b.states[0].outer.state_tensors().items():
        assert v.equal(replayed.states[0].outer.state_tensors()[k]), k


@pytest.mark.slow
def test_thawed_syncer_writes_nothing_and_exits_F5(tmp_path):
    """[F5] real processes: A serves, B stands by, a learner trains. A is frozen (SIGSTOP)
    past its lease; B claims epoch 2 and commits versions whose bases A never saw. Thawed
    (SIGCONT), A writes nothing — no quarantine report, manifest or heartbeat — and exits
    with the fenced error."""
    url = str(tmp_path / "run")
    procs = Procs(tmp_path)
    try:
        init = invoke("init", url, "--task", "ddiloco_cli.tasks.gpt:tiny", "-P", "2", "-H", "4", "--lease", "2",
                      "--heartbeat", "0.5", "--codec", "bf16", "--total-steps", "0", "--batch-size", "4",
                      "--checkpoint-every", "1000")  # in this process: no process start
        assert init.exit_code == 0, init.output
        store = open_store(url)
        a = procs.start("A", "sync", url, "--syncer-id", "A", "--no-gc", "--poll", "0.05")
        wait_for(lambda: store.list(layout.epoch_key(1)), timeout_s=120, what="A to claim epoch 1", procs=procs)
        procs.start("B", "sync", url, "--syncer-id", "B", "--no-gc", "--poll", "0.05")
        procs.start("learner", "learn", url, "--learner-id", "l1", "--threads", "1")
        wait_for(lambda: any(m["epoch"] == 1 and m["version"] > 0 for p in (0, 1) for m in manifests(store, p)),
                 timeout_s=180, what="A to commit", procs=procs)

        a.send_signal(signal.SIGSTOP)
        wait_for(lambda: store.list(layout.epoch_key(2)), timeout_s=120, what="B to claim epoch 2", procs=procs)
        frozen_versions = {p: ledger.latest_version(store, p) for p in (0, 1)}
        # B commits at least two versions per fragment: contributions based on them are newer than A knows
        wait_for(lambda: all(ledger.latest_version(store, p) >= frozen_versions[p] + 2 for p in (0, 1)),
                 timeout_s=180, what="B to commit two versions of each fragment", procs=procs)
        a_heartbeat = layout.syncer_heartbeat_key(1)
        before = (store.get(a_heartbeat), [i.mtime_s for i in store.list(a_heartbeat)])
        epoch1_manifests = sum(m["epoch"] == 1 for p in (0, 1) for m in manifests(store, p))

        a.send_signal(signal.SIGCONT)
        assert a.wait(timeout=120) == FencedError.exit_code, procs.log("A")
        assert "epoch 2 (B) took over" in procs.log("A")
        assert store.list(layout.QUARANTINE_PREFIX) == []
        assert (store.get(a_heartbeat), [i.mtime_s for i in store.list(a_heartbeat)]) == before
        assert sum(m["epoch"] == 1 for p in (0, 1) for m in manifests(store, p)) == epoch1_manifests
    finally:
        procs.close()
    for p in (0, 1):  # one linear history, epochs never go back
        history = manifests(store, p)
        assert [m["version"] for m in history] == list(range(len(history)))
        assert [m["epoch"] for m in history] == sorted(m["epoch"] for m in history)
