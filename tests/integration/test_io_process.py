"""The learner's io helper process (``SyncOptions(io_process=True)``, ``ddiloco learn
--io-process``): the same contributions and the same model, bit for bit, as the worker threads;
the receive rules of [L8]; a helper that dies is an error that names it, a learner that dies
takes its helper with it and leaves no shared memory behind."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from ddiloco_cli import DiLoCoSync, SyncOptions
from ddiloco_cli.errors import DdilocoError, UsageError
from ddiloco_cli.numerics import codec
from ddiloco_cli.ops.runinit import RunSpec, init_run
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.protocol.fragments import gather_fragment
from ddiloco_cli.protocol.published import FragmentReader
from ddiloco_cli.store import open_store
from ddiloco_cli.tasks import load_task

from support.built_run import invoke
from support.procs import Procs, learner_heartbeat, wait_for
from support.runs import commit_by_hand

TINY = "ddiloco_cli.tasks.gpt:tiny"
OPTS = dict(handle_sigterm=False, align_schedule=False, stall_alert=False, min_poll_s=0.02)


def _run(url: str, **spec) -> None:
    init_run(open_store(url), RunSpec(**{"task": TINY, "num_fragments": 1, "sync_every": 8, "overlap_steps": 1,
                                         "codec": "int4", "total_steps": 0, "warmup_steps": 0, "batch_size": 4,
                                         **spec}))


def _value(store, version: int, fragment: int = 0) -> dict[str, torch.Tensor]:
    run = ledger.read_run(store)
    plan = ledger.read_plan(store, run_id=run["run_id"])
    return FragmentReader(store, run_id=run["run_id"], plan=plan, fragment=fragment).read(version)


def _publish(store, *, version: int, high_water: dict, seed: int) -> None:
    """Commit version ``version`` of fragment 0 by hand: the previous version plus seeded noise."""
    prev = _value(store, version - 1)
    gen = torch.Generator().manual_seed(seed)
    value = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in prev.items()}
    commit_by_hand(store, version=version, value=value, prev=prev, high_water=high_water)


def _pump(sync: DiLoCoSync, s: float = 0.02) -> None:
    if sync._io is not None:
        sync._io.flush()  # the messages of sends whose copies have landed since the step (staged)
        sync._io.pump(s)
    else:
        time.sleep(s)


def _until_ready(sync: DiLoCoSync, version: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        got = sync._receiver.ready.get(0)
        if got is not None and got.version >= version:
            return
        _pump(sync)
    raise AssertionError(f"version {version} never became ready")


def _until_uploaded(sync: DiLoCoSync, n: int) -> None:
    deadline = time.monotonic() + 120
    while sync.stats.num_contributions < n:
        assert time.monotonic() < deadline, f"{sync.stats.num_contributions} of {n} contributions uploaded"
        _pump(sync)


class _SlowEvent:
    """A copy's event that lands at its ``lands_at``-th look (``query``), or when waited for."""

    def __init__(self, seen: dict[str, int], lands_at: int = 3):
        self.looks, self.seen, self.lands_at = 0, seen, lands_at

    def query(self) -> bool:
        self.looks += 1
        self.seen["not yet"] += self.looks < self.lands_at
        return self.looks >= self.lands_at

    def synchronize(self) -> None:
        self.looks = self.lands_at
        self.seen["waited"] = self.seen.get("waited", 0) + 1


def _stage_slowly(sync: DiLoCoSync, seen: dict[str, int], lands_at: int = 3,
                  kept: list | None = None) -> None:
    """The io helper's CUDA way on the CPU: each send's copy staged, landing steps later (its
    message and those behind it wait), each ready increment copied out of its block. ``kept``:
    (fragment, the values staged) of each send, in order."""
    def stage(p, params):
        seen["staged"] += 1
        out = gather_fragment(sync.plan, p, params)
        out.event = _SlowEvent(seen, lands_at)
        if kept is not None:
            kept.append((p, {k: t.clone() for k, t in out.items()}))
        return out

    sync._io.stage = stage  # and so the increments copied out of their blocks (not pinned: no CUDA)


def _scenario(url: str, io_process: bool, staged: dict[str, int] | None = None, device: str = "cpu"
              ) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]], dict]:
    """A scripted session: seeded training, versions published by hand (one held back [L8], then
    the learner's own), each waited for before the step that takes it. Returns the model, the
    contributions' decoded tensors in seq order and the final heartbeat. ``staged``: the sends'
    copies staged as on CUDA (``_stage_slowly``), counted in it. ``device``: the model's."""
    store = open_store(url)
    model = load_task(TINY).build_model().to(device)
    gen = torch.Generator().manual_seed(11)
    sync = DiLoCoSync(url, model, learner_id="w", options=SyncOptions(io_process=io_process, **OPTS))
    with sync:
        assert (sync._io is not None) == io_process
        if staged is not None:
            _stage_slowly(sync, staged)

        def steps(n: int, expect: list | None = None) -> None:
            for _ in range(n):
                with torch.no_grad():
                    for t in model.parameters():
                        t.add_(0.01 * torch.randn(t.shape, generator=gen).to(device))
                got = sync.step(num_tokens=4)
                if expect is not None:
                    assert got == expect.pop(0), (sync.stats.step, got)

        version, sent = 0, 0
        steps(8)  # fragment 0 is sent at steps 8, 16, 24 and 32: received from the step after
        for cycle in range(3):
            sent += 1
            seq = sync.in_flight[0].seq
            _until_uploaded(sync, sent)  # the error-feedback residual of this upload is in before the next
            version += 1
            _publish(store, version=version, high_water={"other": 3 + cycle}, seed=100 + version)
            _until_ready(sync, version)
            steps(1, [[]])  # not ours: held back
            version += 1
            _publish(store, version=version, high_water={"other": 3 + cycle, "w": seq}, seed=100 + version)
            _until_ready(sync, version)
            steps(1, [[0]])  # ours: taken with alpha
            assert sync.base[0][0] == version
            steps(6)
        assert sync.stats.num_receives == 3 and sync.stats.num_held == 0
        final = {k: t.detach().cpu().clone() for k, t in model.state_dict().items()}
    beat = records.validate(sync._heartbeat_record(), "learner_heartbeat", where="heartbeat")  # after the uploads
    infos = sorted(store.list(layout.contribution_prefix(0)), key=lambda i: int(i.key.rsplit("/", 1)[1].split(".")[0]))
    contributions = [codec.decode_tensors(store.get(i.key), max_numel=10**7)[0] for i in infos]
    return final, contributions, beat


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def root(request, tmp_path) -> str:
    """Where the runs go: a local directory, or a bucket on the moto server (the helper opens
    it the way the learner did)."""
    return str(tmp_path) if request.param == "local" else request.getfixturevalue("s3_url").url


def _same_session(threads, helper) -> None:
    assert len(threads[1]) == len(helper[1]) == 4  # at steps 8, 16, 24 and 32 (nothing left to flush)
    for a, b in zip(threads[1], helper[1]):  # int4 with error feedback: the residuals carried alike
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(threads[0][k], helper[0][k]) for k in threads[0])
    for field in ("receives", "held_receives", "num_contributions", "uploads_failed", "versions"):
        assert threads[2][field] == helper[2][field], field
    # the headers' times and nonces are as long as they come out in JSON
    assert abs(threads[2]["bytes_up"] - helper[2]["bytes_up"]) < 64 * 4 and helper[2]["bytes_down"] > 0


def test_the_io_helper_makes_the_same_contributions_and_model_as_the_worker_threads(root):
    urls = {}
    for io_process in (False, True):
        urls[io_process] = f"{root}/io-{io_process}"
        _run(urls[io_process])
    _same_session(_scenario(urls[False], io_process=False), _scenario(urls[True], io_process=True))


def test_staged_copies_as_on_cuda_give_the_same_session(tmp_path):
    """The CUDA way (sends staged, their messages held until the copies land, increments copied
    out of their blocks), run on the CPU with copies that land late: the same contributions and
    model as the worker threads."""
    for name in ("threads", "staged"):
        _run(str(tmp_path / name))
    seen = {"staged": 0, "not yet": 0}
    threads = _scenario(str(tmp_path / "threads"), io_process=False)
    _same_session(threads, _scenario(str(tmp_path / "staged"), io_process=True, staged=seen))
    assert seen["staged"] == 4 and seen["not yet"] >= 4  # every send staged, each looked at before it landed


def test_staged_copies_that_never_land_by_themselves_go_at_the_waits_and_the_close(tmp_path):
    """Copies whose events only pass when waited for: the upload bound's wait and the close send
    every staged contribution, in order, each with the values staged at its send (codec none:
    the contribution is version 0 less them exactly), the unsent progress at the close included."""
    url = str(tmp_path / "bucket")
    _run(url, codec="none", num_fragments=4, sync_every=8)
    store = open_store(url)
    model = load_task(TINY).build_model()
    gen = torch.Generator().manual_seed(5)
    seen, kept = {"staged": 0, "not yet": 0}, []
    opts = {**OPTS, "upload_queue": 1, "upload_workers": 1}
    with DiLoCoSync(url, model, learner_id="n", options=SyncOptions(io_process=True, **opts)) as sync:
        _stage_slowly(sync, seen, lands_at=10**9, kept=kept)
        for _ in range(21):  # a send every 2 steps: 10, then the close's flush of all 4 fragments
            with torch.no_grad():
                for t in model.parameters():
                    t.add_(0.01 * torch.randn(t.shape, generator=gen))
            sync.step(num_tokens=4)
    assert seen["staged"] == len(kept) == 14 and seen["waited"] == 14  # none landed but by a wait
    base = {p: _value(store, 0, p) for p in range(4)}
    by_fragment: dict[int, int] = {}
    for p, theta in kept:
        by_fragment[p] = by_fragment.get(p, 0) + 1
        infos = sorted(store.list(layout.contribution_prefix(p)), key=lambda i: int(i.key.rsplit("/", 1)[1].split(".")[0]))
        got = codec.decode_tensors(store.get(infos[by_fragment[p] - 1].key), max_numel=10**7)[0]
        assert got.keys() == theta.keys()
        for k, v in got.items():
            assert torch.equal(v, base[p][k] - theta[k]), (p, k)
    assert sum(len(store.list(layout.contribution_prefix(p))) for p in range(4)) == 14


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_model_gives_the_same_session_with_the_helper_as_with_the_threads(tmp_path):
    """On a CUDA device (scripts/check_gpu.sh): sends staged in pinned memory and posted once
    landed, increments copied out pinned; the same contributions and model as the threads."""
    for name in ("threads", "helper"):
        _run(str(tmp_path / name))
    _same_session(_scenario(str(tmp_path / "threads"), io_process=False, device="cuda"),
                  _scenario(str(tmp_path / "helper"), io_process=True, device="cuda"))


@pytest.mark.parametrize("own_comes", [True, False])
def test_a_held_version_then_the_own_or_the_held_one_L8(tmp_path, own_comes):
    """[L8] through the helper: a version without the learner's contribution is held back; the
    own one is taken with alpha when it comes, else the held one at the step before the next send
    with held_alpha (0.5), each applied exactly (no training in between)."""
    url = str(tmp_path / "bucket")
    _run(url, alpha=0.3, codec="none")
    store = open_store(url)
    model = load_task(TINY).build_model()
    with DiLoCoSync(url, model, learner_id="w", options=SyncOptions(io_process=True, **OPTS)) as sync:
        for _ in range(8):
            sync.step(num_tokens=1)
        seq = sync.in_flight[0].seq
        start = {k: t.clone() for k, t in sync.island.gather(sync.plan, 0, sync.params).items()}
        _publish(store, version=1, high_water={"other": 3}, seed=1)
        _until_ready(sync, 1)
        assert sync.step(num_tokens=1) == [] and sync.base[0][0] == 0  # step 9: held
        if own_comes:
            _publish(store, version=2, high_water={"other": 3, "w": seq}, seed=2)
            _until_ready(sync, 2)
            assert sync.step(num_tokens=1) == [0] and sync.base[0][0] == 2
            new, a = _value(store, 2), 0.3
        else:
            for step in range(10, 15):
                assert sync.step(num_tokens=1) == [], step
            assert sync.step(num_tokens=1) == [0] and sync.base[0][0] == 1  # step 15 = t + H - 1
            new, a = _value(store, 1), 0.5
        for k, t in sync.island.gather(sync.plan, 0, sync.params).items():
            torch.testing.assert_close(t, a * start[k] + (1 - a) * new[k], rtol=0, atol=1e-6)
        assert (sync.stats.num_receives, sync.stats.num_held) == (1, 0 if own_comes else 1)
        # the contribution the helper made: base (version 0) minus the fragment at the send (codec none)
        _until_uploaded(sync, 1)
    contribution = codec.decode_tensors(store.get(layout.contribution_key(0, "w", seq)), max_numel=10**7)[0]
    base = _value(store, 0)
    for k, v in contribution.items():
        assert torch.equal(v, base[k] - start[k]), k


def test_a_helper_that_dies_is_an_error_that_names_it(tmp_path):
    url = str(tmp_path / "bucket")
    _run(url)
    model = load_task(TINY).build_model()
    sync = DiLoCoSync(url, model, learner_id="k", options=SyncOptions(io_process=True, **OPTS))
    sync.start()
    try:
        os.kill(sync._io.pid, signal.SIGKILL)
        sync._io.proc.wait(timeout=60)
        with pytest.raises(DdilocoError, match="io helper process"):
            for _ in range(1000):
                sync.step(num_tokens=1)  # sends every few steps: a write to the dead helper is the same error
                _pump(sync, 0.01)
        sync._io.conn.post(("took", 0, 0))
        with pytest.raises(DdilocoError, match="io helper process ended"):  # not a bare BrokenPipeError
            sync._io.flush()
    finally:
        sync._started = False  # nothing to close: the helper is gone
        sync._writer.close(final_beat=False)
        sync._io.abort()


@pytest.mark.parametrize("spec, why", [({"mode": "lockstep"}, "lock-step"), ({"alpha": 1.0}, "in-place"),
                                      ({}, "in-memory")])
def test_the_io_helper_refuses_what_it_does_not_cover(tmp_path, spec, why):
    url = "memory://io-refused" if why == "in-memory" else str(tmp_path / "bucket")
    _run(url, **spec)
    model = load_task(TINY).build_model()
    with pytest.raises(UsageError, match=why):
        with DiLoCoSync(url, model, learner_id="r", options=SyncOptions(io_process=True, **OPTS)):
            pass


@pytest.mark.slow
def test_a_killed_learner_takes_its_helper_along_and_leaves_no_shared_memory(tmp_path):
    """`ddiloco learn --io-process` with a syncer: contributions are merged; SIGKILL the learner
    and its helper process goes too, and its shared blocks with them."""
    url = str(tmp_path / "bucket")
    procs = Procs(tmp_path)
    try:
        learner, helper = _learning_with_a_helper(procs, url, receives=4)
        shm = [f for f in os.listdir("/dev/shm") if f.startswith(f"ddiloco-{learner.pid}-")] \
            if os.path.isdir("/dev/shm") else []
        assert shm == [], shm  # unlinked once mapped
        learner.send_signal(signal.SIGKILL)
        learner.wait(timeout=60)
        wait_for(lambda: not os.path.exists(f"/proc/{helper}"), timeout_s=60, what="the helper to exit")
        beat = learner_heartbeat(url, "a")
        assert beat["num_contributions"] >= 4 and beat["uploads_failed"] == 0
    finally:
        procs.close()


@pytest.mark.slow
def test_a_sigterm_to_the_learner_and_its_helper_leaves_cleanly_with_every_contribution(tmp_path):
    """A SIGTERM to the whole group (systemd, a spot VM's shutdown) reaches the helper too: it
    ignores it, so the learner's clean exit (the flush of unsent progress [L7]) still goes
    through it, and every contribution it counted is in the bucket."""
    url = str(tmp_path / "bucket")
    procs = Procs(tmp_path)
    try:
        learner, helper = _learning_with_a_helper(procs, url, receives=2, syncer_args=("--no-gc",))
        os.kill(helper, signal.SIGTERM)
        learner.send_signal(signal.SIGTERM)
        assert learner.wait(timeout=120) == 0, procs.log("learner")
        assert "sent the unsent progress" in procs.log("learner")
        beat = learner_heartbeat(url, "a")
        store = open_store(url)
        created = sum(len(store.list(layout.contribution_prefix(p))) for p in range(2))
        assert beat["state"] == "left" and beat["uploads_failed"] == 0
        assert created == beat["num_contributions"] > 0
        wait_for(lambda: not os.path.exists(f"/proc/{helper}"), timeout_s=60, what="the helper to exit")
    finally:
        procs.close()


def _learning_with_a_helper(procs: Procs, url: str, *, receives: int, syncer_args: tuple = ()) -> tuple:
    """A run with a syncer and `ddiloco learn --io-process`, once the learner has received
    ``receives`` versions: (the learner's process, its helper's pid)."""
    r = invoke("init", url, "--task", TINY, "-P", "2", "-H", "4", "--overlap-steps", "1", "--total-steps", "0",
               "--warmup-steps", "0", "--batch-size", "4", "--lease", "2", "--heartbeat", "0.4")
    assert r.exit_code == 0, r.output
    procs.start("syncer", "sync", url, "--poll", "0.1", *syncer_args)
    learner = procs.start("learner", "learn", url, "--learner-id", "a", "--threads", "1", "--poll", "0.1",
                          "--io-process")
    wait_for(lambda: (learner_heartbeat(url, "a") or {}).get("receives", 0) >= receives, timeout_s=240,
             what="the learner receiving versions through its helper", procs=procs)
    helpers = _children(learner.pid)
    assert len(helpers) == 1, helpers
    return learner, helpers[0]


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out
