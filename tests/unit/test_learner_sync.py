"""DiLoCoSync and the learn loop in one process (memory store): data resume, fp32
deltas of bf16 models, lock-step without keep-overlap, tasks loaded from the
learner's own code, the training features of `learn`."""

from __future__ import annotations

import functools
import os
import threading
import time
import uuid
from collections import Counter

import pytest
import torch

from ddiloco_cli import DiLoCoSync
from ddiloco_cli.errors import UsageError
from ddiloco_cli.learner import Learner, LearnerOptions
from ddiloco_cli.learner.island import move_model
from ddiloco_cli.learner.receiver import Receiver
from ddiloco_cli.learner.session import SessionWriter, heartbeat_bytes
from ddiloco_cli.learner.stats import LearnerStats
from ddiloco_cli.numerics import codec
from ddiloco_cli.ops.runinit import RunSpec, init_run
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.protocol.published import FragmentReader
from ddiloco_cli.protocol.runconfig import read_run_config
from ddiloco_cli.store import open_store
from ddiloco_cli.store.base import StoreWrapper
from ddiloco_cli.tasks import load_run_task, load_task

from support.runs import commit_by_hand

TINY = "ddiloco_cli.tasks.gpt:tiny"


def _run(**spec) -> object:
    store = open_store(f"memory://sync-{uuid.uuid4().hex}")
    init_run(store, RunSpec(**{"task": TINY, "num_fragments": 2, "sync_every": 4, "overlap_steps": 1, "codec": "none",
                               "total_steps": 0, "warmup_steps": 0, "batch_size": 4, **spec}))
    return store


def _record_first_batch(learner: Learner, seen: list) -> None:
    original = learner.task.batches

    @functools.wraps(original)  # keeps the signature: the loop looks for start_step in it
    def batches(**kwargs):
        stream = original(**kwargs)
        first = next(stream)
        seen.append(first)
        yield first
        yield from stream

    learner.task.batches = batches


def test_a_restarted_learner_continues_its_data_stream():
    store = _run()
    firsts: list = []
    for _ in range(2):
        learner = Learner(store, options=LearnerOptions(learner_id="a", steps=3))
        _record_first_batch(learner, firsts)
        assert learner.train() == "steps"
    state = records.loads(store.get(layout.learner_state_key("a")), "learner_state", where="state")
    assert state["data"] == {"start_step": 6}
    assert not torch.equal(firsts[0][0], firsts[1][0]), "the second session replayed the first one's data"
    seed = __import__("zlib").crc32(b"a")
    stream = load_task(TINY).batches(shard=0, num_shards=1, seed=seed, batch_size=4)
    expected = [next(stream) for _ in range(4)][3]
    assert torch.equal(firsts[1][0], expected[0]), "the second session must start at batch 3 of the stream"


def test_bf16_model_sends_fp32_delta_against_the_fp32_base():
    store = _run(num_fragments=1, sync_every=2, overlap_steps=0)
    model = load_task(TINY).build_model().to(torch.bfloat16)
    with DiLoCoSync(store, model, learner_id="b") as sync:
        base = {k: v.clone() for k, v in sync.base[0][1].items()}
        assert all(v.dtype == torch.float32 for v in base.values())
        with torch.no_grad():
            for t in model.parameters():
                t.add_(0.25)  # stands in for training
        theta = {s.key: s.view_of(dict(model.named_parameters())[s.name]).float() for s in sync.plan.fragments[0]}
        sync.step(num_tokens=1)
        sync.step(num_tokens=1)  # fragment 0 is due after step 2
    (info,) = store.list(layout.contribution_prefix(0))
    delta, _ = codec.decode_tensors(store.get(info.key), max_numel=10**7)
    for k, d in delta.items():
        assert torch.equal(d, base[k] - theta[k]), k
    # against the bf16-rounded base the delta would lose the published value's low bits
    rounded = {k: base[k].bfloat16().float() - theta[k] for k in theta}
    assert any(not torch.equal(delta[k], rounded[k]) for k in delta)


def test_lockstep_never_keeps_overlap_progress():
    with pytest.raises(UsageError, match="keep-overlap-progress: true: a lockstep run always uses false"):
        _run(mode="lockstep", keep_overlap_progress=True, overlap_steps=2)
    store = _run(mode="lockstep", overlap_steps=2)
    assert read_run_config(store).keep_overlap_progress is False
    model = load_task(TINY).build_model()
    with DiLoCoSync(store, model, learner_id="c") as sync:
        assert not sync.keep_progress
    store = _run(keep_overlap_progress=True, overlap_steps=2)
    with DiLoCoSync(store, model, learner_id="c") as sync:
        assert sync.keep_progress


def test_alpha_defaults_by_mode_and_lockstep_may_change_it():
    """Decoupled runs mix 0.3 of the learner's own fragment into a received version (alpha 0.3,
    docs/results.md "Outer loop"); lockstep defaults to overwrite (alpha 0, torchft's) but, unlike
    the merge or the receive rule, may be given another alpha (Streaming DiLoCo's)."""
    assert read_run_config(_run(overlap_steps=2)).alpha == 0.3
    assert read_run_config(_run(mode="lockstep", overlap_steps=2)).alpha == 0.0
    assert read_run_config(_run(mode="lockstep", overlap_steps=2, alpha=0.3)).alpha == 0.3
    assert read_run_config(_run(overlap_steps=2, alpha=0.0)).alpha == 0.0
    config = read_run_config(_run(overlap_steps=2, alpha=0.25))
    assert config.with_mode("lockstep").alpha == 0.25 and config.with_mode("lockstep").merge == "mean"


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.8])
def test_in_place_receive_is_the_receive_rule_with_alpha(alpha):
    """The learner's in-place receive, theta += (1 - alpha) * (Theta_new - theta_at_send), is
    receive_rule(alpha, keep_progress) up to float rounding."""
    from ddiloco_cli.learner.receiver import receive_rule

    store = _run(overlap_steps=2, alpha=alpha)
    model = load_task(TINY).build_model()
    with DiLoCoSync(store, model, learner_id="c") as sync:
        assert sync._in_place and sync.alpha == alpha
        p = 0
        keys = [s.key for s in sync.plan.fragments[p]]
        at_send = {k: t.clone() for k, t in sync.island.gather(sync.plan, p, sync.params).items()}
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():  # progress after the send
            for t in model.parameters():
                t.add_(torch.randn(t.shape, generator=gen) * 0.01)
        local = {k: t.clone() for k, t in sync.island.gather(sync.plan, p, sync.params).items()}
        new_global = {k: at_send[k] + torch.randn(at_send[k].shape, generator=gen) * 0.1 for k in keys}
        sync._add_to_params(p, {k: new_global[k] - at_send[k] for k in keys}, alpha)
        got = sync.island.gather(sync.plan, p, sync.params)
        want = receive_rule(local, new_global, at_send, alpha=alpha, keep_progress=True)
        for k in keys:
            torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)
            if alpha:  # the learner keeps alpha of the gap between its own fragment and the new one
                assert not torch.allclose(got[k], new_global[k] + local[k] - at_send[k])


@pytest.mark.parametrize("computed_with", ["this send", "the send before"])
def test_a_version_downloaded_across_the_next_send_is_received_against_the_newest_send(computed_with):
    """On a thin link a download can outlast a cycle: the receiver computed the increment
    against the fragment at the send before, and the learner has sent the fragment again since.
    The receive then re-bases against the newest send (receive_rule), not the stale increment."""
    from ddiloco_cli.learner.receiver import InFlight, Ready, receive_rule

    store = _run(overlap_steps=2, alpha=0.3)
    model = load_task(TINY).build_model()
    with DiLoCoSync(store, model, learner_id="c") as sync:
        assert sync._in_place
        p, gen = 0, torch.Generator().manual_seed(5)
        keys = [s.key for s in sync.plan.fragments[p]]
        fragment = lambda: {k: t.clone() for k, t in sync.island.gather(sync.plan, p, sync.params).items()}  # noqa: E731

        def train_a_little():
            with torch.no_grad():
                for t in model.parameters():
                    t.add_(torch.randn(t.shape, generator=gen) * 0.01)

        at_first_send = fragment()
        train_a_little()
        at_next_send = fragment()
        train_a_little()
        local = fragment()
        new_global = {k: at_first_send[k] + torch.randn(at_first_send[k].shape, generator=gen) * 0.1 for k in keys}
        subtracted = at_next_send if computed_with == "this send" else at_first_send
        flight = InFlight(receive_step=0, seq=7, theta=at_next_send, counters=(0, 0))
        sync._receiver.ready[p] = Ready(1, new_global, {"high_water": {"c": 7}}, [],
                                        {k: new_global[k] - subtracted[k] for k in keys}, subtracted)
        assert sync._receive(p, flight)
        got = fragment()
        want = receive_rule(local, new_global, at_next_send, alpha=sync.alpha, keep_progress=True)
        for k in keys:
            torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)
        assert sync.base[p][0] == 1


def test_task_comes_from_the_learners_own_code(tmp_path):
    task_file = tmp_path / "task_here.py"
    task_file.write_text(open("examples/my_task.py").read())
    store = _run(task=f"{task_file}:task")
    run = ledger.read_run(store)
    assert len(run["task_sha256"]) == 64
    with pytest.raises(UsageError, match="file path"):
        load_run_task(run)  # a path from the bucket is never imported
    assert load_run_task(run, override=f"{task_file}:task") is not None
    task_file.write_text(task_file.read_text() + "\n# changed\n")
    with pytest.raises(UsageError, match="differs from the run's"):
        load_run_task(run, override=f"{task_file}:task")
    builtin = ledger.read_run(_run())
    assert load_run_task(builtin) is not None  # an importable module from run.json is fine
    with pytest.raises(UsageError, match="differs from the run's"):
        load_run_task({**builtin, "task_sha256": "0" * 64})


def test_learn_features_bf16_autocast_and_grad_accum():
    store = _run(total_steps=4)
    seen: list = []
    learner = Learner(store, options=LearnerOptions(learner_id="d", precision="bf16", grad_accum=2))
    _record_first_batch(learner, seen)
    assert learner.train() == "finished"
    hb = records.loads(store.get(layout.learner_heartbeat_key("d")), "learner_heartbeat", where="hb")
    assert hb["state"] == "finished" and hb["step"] == 4
    assert hb["tokens"] == 4 * 2 * 4 * 64  # two micro-batches of 4 windows of 64 tokens per step
    state = records.loads(store.get(layout.learner_state_key("d")), "learner_state", where="state")
    assert state["data"] == {"start_step": 8}
    assert all(t.dtype == torch.float32 for t in learner.model.parameters())


@pytest.mark.parametrize("bad", [dict(precision="fp8"), dict(grad_accum=0), dict(parallel="tp")])
def test_bad_learn_options_are_usage_errors(bad):
    with pytest.raises(UsageError):
        LearnerOptions(learner_id="e", **bad).check()


def test_moving_the_model_to_a_device_keeps_tied_weights_tied():
    """Module.to() onto a device whose tensors cannot take CPU storage in place (XLA; the
    meta device behaves the same way) gives each module its own Parameter: GPT's tied
    wte/lm_head weight would split in two and no longer match the run's plan."""
    task = load_task(TINY)
    assert len(list(task.build_model().to("meta").parameters())) == 16  # the failure move_model prevents
    model = move_model(task.build_model(), torch.device("meta"))
    assert model.lm_head.weight is model.transformer.wte.weight
    assert len(list(model.parameters())) == 15
    assert all(t.device.type == "meta" for t in model.parameters())


def test_a_compiled_model_is_attached_by_its_original_parameters():
    """torch.compile's wrapper prefixes parameter names with _orig_mod.; the wrapper peels it off,
    so a compiled model trains and sends like the plain one (inductor itself is exercised by
    `learn --compile` on accelerators; the eager backend keeps this test fast)."""
    store = _run(num_fragments=1, sync_every=2, overlap_steps=0)
    task = load_task(TINY)
    model = task.build_model()
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = task.batches(shard=0, num_shards=1, seed=0, batch_size=2)
    with DiLoCoSync(store, compiled, learner_id="f") as sync:
        assert sync.model is model
        for _ in range(2):
            task.loss(compiled, next(batches)).backward()
            opt.step()
            opt.zero_grad()
            sync.step(num_tokens=128)
    assert len(store.list(layout.contribution_prefix(0))) == 1


def test_a_refused_contribution_is_logged_and_the_fragment_re_based(caplog):
    """PROTOCOL.md, ledger entries: a learner that finds its contribution refused in a new
    manifest logs the reason and re-bases the fragment on that version."""
    import time

    from ddiloco_cli.protocol.published import FragmentReader, encode_version, upload_payloads

    store = _run(num_fragments=1, sync_every=2, overlap_steps=0)
    run = ledger.read_run(store)
    plan = ledger.read_plan(store, run_id=run["run_id"])
    v0 = FragmentReader(store, run_id=run["run_id"], plan=plan, fragment=0).read(0)
    encoded = encode_version(fragment=0, version=1, new_value={k: v + 0.5 for k, v in v0.items()}, prev_published=v0,
                             publish_codec="none", block_size=64, keyframe=False)
    upload_payloads(store, encoded)
    refused = {"learner_id": "g", "seq": 7, "key": layout.contribution_key(0, "g", 7), "size": 10, "used": False,
               "status": "refused", "reason": "stale: base 0 is 9 cycles behind (max_staleness 8)"}
    model = load_task(TINY).build_model()
    with caplog.at_level("WARNING"), DiLoCoSync(store, model, learner_id="g") as sync:
        assert ledger.commit_manifest(store, records.make(
            "manifest", run_id=run["run_id"], fragment=0, version=1, epoch=1, syncer_id="s", nonce=records.new_nonce(),
            numel=plan.fragment_numel(0), payloads=[e for _, _, e in encoded.payloads], contributions=[refused],
            quorum_size=0, outer_steps=1, high_water={"g": 7}))
        deadline = time.monotonic() + 60
        while sync.stats.versions[0] < 1 and time.monotonic() < deadline:
            sync.step(num_tokens=1)
            time.sleep(0.01)
        assert sync.base[0][0] == 1 and sync.stats.num_refused == 1
        beat = records.validate(sync._heartbeat_record(), "learner_heartbeat", where="heartbeat")
        assert beat["refused"] == 1  # `status` notes it, with the reason
        assert beat["last_refusal"] == "fragment 0 seq 7: stale: base 0 is 9 cycles behind (max_staleness 8)"
    assert "contribution seq 7 was refused by the syncer (stale: base 0 is 9 cycles behind" in caplog.text
    assert "its progress is not in version 1; re-basing on it" in caplog.text


def test_receiver_is_idle_until_one_step_before_the_overlap_window_ends():
    """The receiver polls only for fragments the loop registered, from step t + tau - 1 on
    (t: the send), so its download overlaps the window's last step; before that it sleeps."""
    store = _run(num_fragments=1, sync_every=4, overlap_steps=2)
    model = load_task(TINY).build_model()
    with DiLoCoSync(store, model, learner_id="h") as sync:
        for _ in range(4):  # the send happens after step 4: receive_step = 6
            sync.step(num_tokens=1)
        assert sync.in_flight[0].receive_step == 6 and not sync._receiver.wanted
        assert sync._receiver.num_polls == 0
        sync.step(num_tokens=1)  # step 5 = t + tau - 1
        assert set(sync._receiver.wanted) == {0}


class _Counting(StoreWrapper):
    """Counts the GETs, PUTs and LISTs that reach the store, by key (prefix for LISTs)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.calls: Counter = Counter()
        self.lock = threading.Lock()

    def _count(self, op: str, key: str) -> None:
        with self.lock:
            self.calls[(op, key)] += 1

    def get(self, key, *, max_bytes=None):
        self._count("get", key)
        return self.inner.get(key, max_bytes=max_bytes)

    def put(self, key, data):
        self._count("put", key)
        self.inner.put(key, data)

    def list(self, prefix=""):
        self._count("list", prefix)
        return self.inner.list(prefix)


def test_heartbeat_rereads_the_id_only_when_a_newer_session_may_have_started():
    """[L2] one PUT per heartbeat; the GET that looks for a newer session only on the first
    write, during the first lease (a start race), once the last look is lease/2 old (after
    a pause such as SIGSTOP at once) and on the final write; the data state at most once
    per lease/2, and on close."""
    store = _Counting(open_store(f"memory://hb-{uuid.uuid4().hex}"))
    key, state_key = layout.learner_heartbeat_key("a"), layout.learner_state_key("a")
    now = [0.0]

    def record(session: int = 5) -> dict:
        return records.make("learner_heartbeat", learner_id="a", state="running", step=1, tokens=0, session=session)

    writer = SessionWriter(store, learner_id="a", session=5, make_record=record, run_id="r", lease_s=10.0, every_s=2.0,
                           clock=lambda: now[0])

    def beat_at(t: float, step: int) -> None:
        now[0] = t
        writer.save_state({"start_step": step})
        writer.write_state()
        writer.beat()

    for t in (0, 2, 4, 6, 8):  # the first lease: every write looks first
        beat_at(t, step=t)
    assert store.calls[("get", key)] == 5 and store.calls[("put", key)] == 5
    for t in (10, 12, 14, 16, 18, 20):  # then every lease/2: last look at 8, so at 14 and 20
        beat_at(t, step=t)
    assert store.calls[("get", key)] == 7 and store.calls[("put", key)] == 11
    assert store.calls[("put", state_key)] == 4  # at 0, 6, 12 and 18 (lease/2 apart), not at all 11 beats

    store.inner.put(key, heartbeat_bytes(record(session=6)))  # a newer session, while this one was paused
    beat_at(26, step=26)  # the first write after the pause looks first, sees it and stops
    assert writer.taken_over_by is not None and writer.taken_over_by.record["session"] == 6
    assert store.calls[("put", key)] == 11
    writer.close(final_beat=True)
    assert records.loads(store.get(key), "learner_heartbeat", where=key)["session"] == 6
    assert store.calls[("put", key)] == 11, "a session that lost the id never writes its heartbeat again"


def test_receiver_polls_the_oldest_wanted_fragment_at_step_pace_the_others_less_often():
    """Versions come in the order of the sends: the oldest wanted fragment is polled every
    step time, younger ones 4x less often, and up to 8x less often again while their polls
    find nothing (one that finds a version brings them back); a fragment registered with
    nothing older waiting is polled at once (one GET: of the manifest after the version it holds), else when due; the
    line is the order of the sends (``order``), and one the loop blocks on (lock-step) goes
    first."""
    store = _run(num_fragments=3)
    counting = _Counting(store)
    with DiLoCoSync(store, load_task(TINY).build_model(), learner_id="r") as sync:
        readers = {p: FragmentReader(counting, run_id=sync.run_id, plan=sync.plan, fragment=p) for p in sync.readers}
    step_s = 1.0
    receiver = Receiver(counting, readers, learner_id="r", min_poll_s=0.0, stats=LearnerStats(), pace_s=lambda: step_s)
    receiver.start()
    try:
        receiver.want(0, (0, {}), order=10)  # nothing older: polled at once, by the thread
        deadline = time.monotonic() + 60
        while counting.calls[("get", layout.manifest_key(0, 1))] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert counting.calls[("get", layout.manifest_key(0, 1))] == 1
        assert not any(key == layout.latest_hint_key(0) for _, key in counting.calls)  # the hint is not read
    finally:
        receiver.close()
    # the schedule itself, on a clock of our own (the thread is stopped)
    assert receiver.backoff == 1, "a poll of the oldest fragment leaves the younger ones' pace alone"
    t0 = receiver.polled_t[0]
    receiver.want(2, (0, {}), order=12)
    receiver.want(1, (0, {}), order=11)  # registered after 2, sent before it: 1 is ahead of 2
    t1, t2 = receiver.polled_t[1], receiver.polled_t[2]
    assert t1 >= t2 >= t0  # not at once: 0 is older and still waiting
    assert receiver._waiting() == [0, 1, 2]
    time.sleep(0.01)
    receiver.want(1, (0, {}), order=11)  # wanted again before its poll came due (steps shorter than
    assert receiver.polled_t[1] == t1  # the poll interval): its clock runs on, else it never comes due

    def due(at: float) -> list[int]:
        got = receiver._due(at)[0]
        assert all(younger == (p != receiver._waiting()[0]) for p, _, younger in got)
        return [p for p, _, _ in got]

    assert due(t0 + 0.5 * step_s) == []
    assert due(t0 + 1.0 * step_s) == [0]  # the oldest, every step
    assert due(t0 + 2.0 * step_s) == [0]
    assert due(t1 + 4.0 * step_s) == [0, 1, 2]  # the younger ones, every 4 steps
    receiver._polled(True, False)  # 1's poll found nothing: every 8 steps
    receiver._polled(True, False)  # 2's neither: every 16
    assert receiver.backoff == 4
    assert due(t1 + 12.0 * step_s) == [0]
    assert due(t1 + 20.0 * step_s) == [0, 1, 2]
    for _ in range(5):
        receiver._polled(True, False)
    assert receiver.backoff == Receiver.MAX_BACKOFF  # at most 32 steps
    receiver._polled(False, False)  # the oldest's polls do not count
    assert receiver.backoff == Receiver.MAX_BACKOFF
    assert due(t1 + 51.0 * step_s) == [0]
    assert due(t1 + 52.0 * step_s) == [0, 1, 2]
    receiver._polled(True, True)  # a younger one had a version: back to every 4 steps
    assert receiver.backoff == 1
    receiver.ready[0] = None  # 0's version came: 1 is the oldest waiting now, polled every step
    assert due(t1 + 53.0 * step_s) == [1]
    assert due(t1 + 54.0 * step_s) == [1]
    assert due(t1 + 56.0 * step_s) == [1, 2]
    receiver.want(2, (1, {}), blocking=True)  # lock-step: the loop waits for 2, so it goes first, at once
    assert due(t1 + 56.5 * step_s) == [2]
    assert due(t1 + 57.5 * step_s) == [2]  # 1 is younger now: every 4 steps
    assert receiver.has_ready(0) and not receiver.has_ready(1)


def test_a_crashed_session_of_this_host_frees_its_id_at_once_a_live_one_does_not():
    """[L2] unit level (the process test is tests/integration/test_learner_processes.py): a running
    heartbeat of this host whose process is gone is a crash; one that stops beating
    frees the id after a lease; one that keeps beating is a live twin."""
    import os
    import socket
    import subprocess
    import sys
    import threading

    from ddiloco_cli.learner.session import check_id_free, heartbeat_bytes

    store = open_store(f"memory://ids-{uuid.uuid4().hex}")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def running(pid: int) -> None:
        store.put(layout.learner_heartbeat_key("i"), heartbeat_bytes(records.make(
            "learner_heartbeat", learner_id="i", state="running", step=3, tokens=9, session=1,
            host=socket.gethostname(), pid=pid)))

    running(dead.pid)
    assert check_id_free(store, "i", lease_s=3600.0).record["step"] == 3  # no wait: would take an hour
    running(os.getppid())  # a live process that no longer beats: free after one lease
    assert check_id_free(store, "i", lease_s=0.3) is not None

    stop = threading.Event()

    def twin() -> None:  # keeps beating
        while not stop.wait(0.05):
            running(os.getppid())

    running(os.getppid())
    beating = threading.Thread(target=twin)
    beating.start()
    try:
        with pytest.raises(UsageError, match=r"learner id 'i' is live: session 1 on host .* \(pid \d+\)"):
            check_id_free(store, "i", lease_s=0.3)
    finally:
        stop.set()
        beating.join()


def test_lockstep_learner_warns_while_it_waits_for_a_merge_that_does_not_come(caplog):
    """No syncer: the lock-step learner blocks at its first send and says so (after the
    10 s floor of the alert period), naming the syncer's state."""
    import threading
    import time

    store = _run(mode="lockstep", num_fragments=1, sync_every=2, overlap_steps=0)
    model = load_task(TINY).build_model()
    with caplog.at_level("WARNING"), DiLoCoSync(store, model, learner_id="j") as sync:
        stepping = threading.Thread(target=lambda: [sync.step(num_tokens=1) for _ in range(2)])
        stepping.start()
        deadline = time.monotonic() + 60
        while "that merges this learner's contribution" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.1)
        sync.stop_reason = "left"  # what SIGTERM does: the wait ends
        stepping.join(timeout=30)
    assert "at step 2 for the version of fragment 0 that merges this learner's contribution" in caplog.text
    assert "no syncer heartbeat is live" in caplog.text


def _contributions(store, p: int) -> list[dict]:
    """Headers of fragment p's contributions, oldest first."""
    infos = sorted(store.list(layout.contribution_prefix(p)), key=lambda i: i.key)
    return [codec.decode_tensors(store.get(i.key), max_numel=10**7)[1] for i in infos]


def test_a_stopping_learner_sends_the_progress_it_has_not_sent_L7():
    """[L7] P = 2, H = 4: after 3 steps fragment 1 went up at step 2 and fragment 0 never did; on
    close both go up with every step since their base, so no trained step is lost."""
    store = _run()
    model = load_task(TINY).build_model()
    with DiLoCoSync(store, model, learner_id="f") as sync:
        for _ in range(3):
            sync.step(num_tokens=5)
    assert [h["c_steps"] for h in _contributions(store, 0)] == [3]
    sent = [(h["c_steps"], h["c_tokens"]) for h in _contributions(store, 1)]
    # the step-2 contribution, unless the flush replaced it in the upload queue (same base: it carries it)
    assert sent[-1] == (3, 15) and sent[:-1] in ([], [(2, 10)])
    # lock-step sends only whole cycles (a partial contribution would be a merge of its own)
    store = _run(mode="lockstep", overlap_steps=2)  # fragment 1 is received at step 4: no wait for a syncer
    with DiLoCoSync(store, model, learner_id="g") as sync:
        for _ in range(3):
            sync.step(num_tokens=5)
    assert _contributions(store, 0) == [] and len(_contributions(store, 1)) == 1


def test_error_feedback_adds_what_the_codec_dropped_to_the_next_delta_L6():
    """[L6] int4: the second contribution of a fragment is Q(delta_2 + r_1), r_1 = delta_1 -
    decode(Q(delta_1)); without error feedback it would be Q(delta_2)."""
    from ddiloco_cli.numerics.codec import encode_with_residual

    store = _run(num_fragments=1, sync_every=2, overlap_steps=0, codec="int4")
    model = load_task(TINY).build_model()
    with DiLoCoSync(store, model, learner_id="e") as sync:
        assert sync.error_feedback
        base = {k: v.clone() for k, v in sync.base[0][1].items()}
        thetas = []
        for i in range(2):
            with torch.no_grad():
                for t in model.parameters():
                    t.add_(torch.randn_like(t) * 0.01)  # stands in for training
            thetas.append({s.key: s.view_of(dict(model.named_parameters())[s.name]).float().clone()
                           for s in sync.plan.fragments[0]})
            sync.step(num_tokens=1)
            sync.step(num_tokens=1)  # fragment 0 is due every 2 steps
            while sync.stats.num_contributions < i + 1:  # uploaded (and its residual kept) before the next send
                time.sleep(0.01)
    infos = sorted(store.list(layout.contribution_prefix(0)), key=lambda i: i.key)[:2]
    got = [codec.decode_tensors(store.get(i.key), max_numel=10**7)[0] for i in infos]
    run = ledger.read_run(store)
    block, qmax = run["codec_block"], run["codec_qmax"]  # the run's block and bound, as the learner uses
    d1 = {k: base[k] - thetas[0][k] for k in base}
    _, r1 = encode_with_residual(d1, codec="int4", block_size=block, qmax=qmax)
    assert any(float(r.abs().max()) > 0 for r in r1.values())
    d2 = {k: base[k] - thetas[1][k] for k in base}
    with_feedback = codec.decode_tensors(encode_with_residual({k: d2[k] + r1[k] for k in d2}, codec="int4",
                                                              block_size=block, qmax=qmax)[0], max_numel=10**7)[0]
    without = codec.decode_tensors(codec.encode_tensors(d2, codec="int4", block_size=block, qmax=qmax),
                                   max_numel=10**7)[0]
    assert all(torch.equal(got[1][k], with_feedback[k]) for k in d2)
    assert any(not torch.equal(got[1][k], without[k]) for k in d2)
    store = _run(codec="int4", error_feedback=False)
    with DiLoCoSync(store, model, learner_id="n") as sync:
        assert not sync.error_feedback


def _publish(store, *, version: int, prev: dict, high_water: dict) -> dict:
    """Commit version ``version`` of fragment 0 by hand (prev + 0.5, no contributions, the
    given high-water marks), as a syncer merging other learners would; returns its value."""
    value = {k: v + 0.5 for k, v in prev.items()}
    commit_by_hand(store, version=version, value=value, prev=prev, high_water=high_water)
    return value


def _until_ready(sync, version: int) -> None:
    """Wait (no step: the step count is what the test is about) until the receiver holds
    ``version`` of fragment 0 ready, with a generous ceiling."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = sync._receiver.ready.get(0)
        if got is not None and got.version >= version:
            return
        time.sleep(0.01)
    raise AssertionError(f"version {version} never became ready")


@pytest.mark.parametrize("own_comes", [True, False])
def test_a_decoupled_learner_takes_the_version_that_merged_its_contribution_L8(own_comes):
    """[L8] from t + tau a decoupled learner holds back a version merged without its
    contribution and takes the first one that accounts for it; if none comes, it takes the
    newest it has at the step before the fragment's next send (t + H - 1). It never waits."""
    store = _run(num_fragments=1, sync_every=8, overlap_steps=1)
    model = load_task(TINY).build_model()
    with DiLoCoSync(store, model, learner_id="w") as sync:
        for _ in range(8):  # fragment 0 is sent after step 8: receive_step 9, the next send after step 16
            sync.step(num_tokens=1)
        seq = sync.in_flight[0].seq
        v1 = _publish(store, version=1, prev=sync.base[0][1], high_water={"other": 3})
        _until_ready(sync, 1)
        assert sync.step(num_tokens=1) == []  # step 9: version 1 lacks our contribution, held back
        assert sync.base[0][0] == 0 and sync.in_flight[0].held.version == 1
        if own_comes:
            _publish(store, version=2, prev=v1, high_water={"other": 3, "w": seq})
            _until_ready(sync, 2)
            assert sync.step(num_tokens=1) == [0]  # step 10
            assert sync.base[0][0] == 2
        else:
            for step in range(10, 15):
                assert sync.step(num_tokens=1) == [], step
            assert sync.step(num_tokens=1) == [0]  # step 15 = t + H - 1
            assert sync.base[0][0] == 1 and 0 not in sync.in_flight


@pytest.mark.parametrize("held_alpha", [None, 0.8])
def test_a_held_version_is_mixed_in_with_held_alpha_and_the_own_one_with_alpha(held_alpha):
    """A version taken without the learner's contribution in flight ([L8]: held back, taken at the
    step before the next send) is folded in with ``held_alpha`` (unset: 0.5); one that merged
    it with alpha. No training between: theta <- a * theta + (1 - a) * new, each published
    version 0.5 above the one before."""
    store = _run(num_fragments=1, sync_every=8, overlap_steps=1, alpha=0.3, held_alpha=held_alpha)
    model = load_task(TINY).build_model()
    with DiLoCoSync(store, model, learner_id="w") as sync:
        for _ in range(8):
            sync.step(num_tokens=1)
        start = {k: t.clone() for k, t in sync.island.gather(sync.plan, 0, sync.params).items()}
        v1 = _publish(store, version=1, prev=sync.base[0][1], high_water={"other": 3})
        _until_ready(sync, 1)
        for step in range(9, 15):
            assert sync.step(num_tokens=1) == [], step
        assert sync.step(num_tokens=1) == [0] and sync.base[0][0] == 1  # step 15: the held version
        a = 0.5 if held_alpha is None else held_alpha
        for k, t in sync.island.gather(sync.plan, 0, sync.params).items():
            torch.testing.assert_close(t, start[k] + 0.5 * (1 - a))
        sync.step(num_tokens=1)  # step 16: the next send; then a version that merged it
        seq = sync.in_flight[0].seq
        mid = {k: t.clone() for k, t in sync.island.gather(sync.plan, 0, sync.params).items()}
        _publish(store, version=2, prev=v1, high_water={"other": 3, "w": seq})
        _until_ready(sync, 2)
        assert sync.step(num_tokens=1) == [0] and sync.base[0][0] == 2  # step 17: its own, with alpha
        for k, t in sync.island.gather(sync.plan, 0, sync.params).items():
            torch.testing.assert_close(t, 0.3 * mid[k] + 0.7 * (v1[k] + 0.5))
        beat = records.validate(sync._heartbeat_record(), "learner_heartbeat", where="heartbeat")
        assert (beat["receives"], beat["held_receives"], beat["uploads_failed"]) == (2, 1, 0)


def test_the_base_is_updated_in_its_own_tensors_on_every_receive():
    """A received version is copied into the base's tensors, which live for the session (kept as
    the base, the receiver's new blocks fragmented its heap: docs/results.md, "Learner
    overhead"); the values are the version's, bit for bit."""
    store = _run(num_fragments=1, sync_every=8, overlap_steps=1)
    model = load_task(TINY).build_model()
    with DiLoCoSync(store, model, learner_id="r") as sync:
        storage = {k: v.data_ptr() for k, v in sync.base[0][1].items()}
        value = sync.base[0][1]
        for _ in range(8):  # fragment 0 is sent at step 8; its version is taken at step 9
            sync.step(num_tokens=1)
        for version in (1, 2):
            value = _publish(store, version=version, prev=value, high_water={"r": sync.in_flight[0].seq})
            _until_ready(sync, version)
            assert sync.step(num_tokens=1) == [0]
            got_version, got = sync.base[0]
            assert got_version == version
            assert {k: v.data_ptr() for k, v in got.items()} == storage
            assert all(torch.equal(got[k], value[k]) for k in value)
            for _ in range(7):  # steps 10-16: the next send at step 16, taken at 17
                sync.step(num_tokens=1)


class _Later(StoreWrapper):
    """The store's clock ``by_s`` ahead: every object it holds looks that much older."""

    def __init__(self, inner, *, by_s: float):
        super().__init__(inner)
        self.by_s = by_s

    def now(self) -> float:
        return self.inner.now() + self.by_s


def _running_beat(store, learner_id: str, *, step: int, step_time_s: float, **fields) -> None:
    run = ledger.read_run(store)
    rec = records.make("learner_heartbeat", run_id=run["run_id"], learner_id=learner_id, state="running", step=step,
                       tokens=step, step_time_s=step_time_s, **fields)
    store.put(layout.learner_heartbeat_key(learner_id), records.dumps(rec))


def test_a_decoupled_learner_starts_its_send_schedule_in_phase_with_the_running_ones_L9():
    """Three learners run in phase 7 of H = 8 (at step 13 with an offset of 2, at step 15, at step
    8 with an offset of 7); a learner starting at step 0 shifts its schedule by 7 so that it
    sends each fragment when they do, and says so in its heartbeat. A learner that has left is
    not followed, nor one whose heartbeat is too many of its steps old to tell its phase;
    lock-step learners keep the common schedule."""
    store = _run(num_fragments=2, sync_every=8, overlap_steps=1)
    _running_beat(store, "a", step=13, step_time_s=30.0, schedule_offset=2)
    _running_beat(store, "b", step=15, step_time_s=30.0)
    _running_beat(store, "c", step=8, step_time_s=30.0, schedule_offset=7)
    run = ledger.read_run(store)
    gone = records.make("learner_heartbeat", run_id=run["run_id"], learner_id="d", state="left", step=2, tokens=2,
                        step_time_s=30.0)
    store.put(layout.learner_heartbeat_key("d"), records.dumps(gone))
    model = load_task(TINY).build_model()
    with DiLoCoSync(store, model, learner_id="n") as sync:
        # a, b and c are in phase (7 = 13 + 2 - 8 = 15 - 8 = 8 + 7 - 8); d has left
        assert sync.schedule_offset == 7
        due = []
        for _ in range(8):
            due.append(sync.step(num_tokens=1) or [p for p in sync.in_flight])
            sync.in_flight.clear()
        # P = 2 of H = 8: fragment 0 at schedule step 0, fragment 1 at 4; shifted by 7: steps 1 and 5
        assert [i + 1 for i, d in enumerate(due) if d] == [1, 5]
        assert sync._heartbeat_record()["schedule_offset"] == 7
    store2 = _Later(_run(num_fragments=2, sync_every=8, overlap_steps=1), by_s=10.0)
    _running_beat(store2, "a", step=13, step_time_s=1.0)  # 10 s old: 10 steps > H / 2, no phase to go by
    with DiLoCoSync(store2, model, learner_id="n") as sync:
        assert sync.schedule_offset == 0
    store3 = _run(num_fragments=2, sync_every=8, overlap_steps=1, mode="lockstep")
    _running_beat(store3, "a", step=13, step_time_s=30.0)
    with DiLoCoSync(store3, model, learner_id="n") as sync:
        assert sync.schedule_offset == 0


@pytest.mark.parametrize("min_interval_s, expected", [(0.0, [8, 16, 24, 32]), (1e9, [8])])
def test_stall_alerts_come_every_2h_quiet_steps_at_most_every_min_interval(monkeypatch, min_interval_s, expected):
    """No syncer: the decoupled learner's first stall alert comes after 2*H quiet steps; later ones
    every 2*H steps, but never more often than the time floor (a learner at 12 ms steps and H = 4
    alerted every 100 ms, each alert reading the syncers' heartbeats)."""
    from ddiloco_cli.learner import receivepath as sync_module  # where alert_every_s reads it

    monkeypatch.setattr(sync_module, "ALERT_MIN_INTERVAL_S", min_interval_s)
    store = _run(num_fragments=2, sync_every=4, overlap_steps=1)
    model = load_task(TINY).build_model()
    with DiLoCoSync(store, model, learner_id="s") as sync:
        alerts: list[int] = []
        sync._writer.alert_stalled = lambda *, step, since_step: alerts.append(step - since_step)
        for _ in range(35):
            assert sync.step(num_tokens=1) == []
    assert alerts == expected


def test_a_learner_reports_its_send_to_receive_lag_and_warns_once_when_tau_cannot_cover_it(caplog):
    """Every receive keeps its lag (steps from the send to the fold-in); the heartbeat carries
    the median and p95; a full window whose median is over tau gives one warning a session."""
    from ddiloco_cli.learner.receivepath import LAG_WARN_AFTER

    store = _run(overlap_steps=1)
    with DiLoCoSync(store, load_task(TINY).build_model(), learner_id="lag") as sync:
        assert "lag_p50" not in sync._heartbeat_record()
        sync._note_lag(1)
        record = sync._heartbeat_record()
        assert (record["lag_p50"], record["lag_p95"]) == (1, 1)
        records.validate(record, "learner_heartbeat", where="heartbeat")
        with caplog.at_level("WARNING", logger="ddiloco_cli.learner.sync"):
            for _ in range(2 * LAG_WARN_AFTER):
                sync._note_lag(9)
        warnings = [r for r in caplog.records if "over the overlap window" in r.getMessage()]
        assert len(warnings) == 1 and "median 9 steps" in warnings[0].getMessage()
        assert sync.stats.lag_quantiles() == (9, 9)



@pytest.mark.parametrize("error_feedback", [True, False])
def test_lockstep_int4_error_feedback_carries_what_rounds_to_zero_L6(error_feedback):
    """[L6] in lock-step mode (issue 24, finding 7): int4 at qmax 3 rounds every |x| < absmax/6
    of a block to zero. A learner whose progress per cycle alternates A and a = A/10 along
    the parameters sends a = 0 every cycle without error feedback, so the merged global never
    moves there; with it the residual carries a over until it is sent, and after N cycles the
    global (outer lr 1, no momentum: it moves by the decoded contribution) has moved there by
    N*a within one quantisation step (A/3). No flush on close: lock-step sends whole cycles,
    the last residual leaves with the learner."""
    from ddiloco_cli.learner import SyncOptions
    from ddiloco_cli.syncer.core import Syncer, SyncerOptions

    cycles, A = 10, 1e-3
    store = _run(mode="lockstep", num_fragments=1, sync_every=1, overlap_steps=0, codec="int4", quorum=1,
                 outer_lr=1.0, outer_momentum=0.0, error_feedback=error_feedback)
    assert read_run_config(store).codec_qmax == 3
    model = load_task(TINY).build_model()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    steps = {k: torch.where(torch.arange(v.numel()) % 2 == 0, A, A / 10).view(v.shape) for k, v in start.items()}
    stop = threading.Event()
    syncer = Syncer(store, options=SyncerOptions(poll_s=0.005, gc=False))
    thread = threading.Thread(target=syncer.serve, kwargs={"stop": stop.is_set}, daemon=True)
    thread.start()
    try:
        with DiLoCoSync(store, model, learner_id="ls", options=SyncOptions(min_poll_s=0.005)) as sync:
            assert sync.error_feedback is error_feedback
            for _ in range(cycles):
                with torch.no_grad():
                    for k, t in model.named_parameters():
                        t.sub_(steps[k])  # stands in for a cycle of training: theta = base - step
                sync.step(num_tokens=1)  # H = 1: sent, then (tau = 0) the merged version received
    finally:
        stop.set()
        thread.join(timeout=30)
    assert syncer.states[0].version == cycles and len(_contributions(store, 0)) == cycles  # nothing flushed
    moved = {k: start[k] - v.detach() for k, v in model.named_parameters()}  # the merged global's move
    small = torch.cat([moved[k].flatten()[1::2] for k in moved])  # the coordinates of progress a per cycle
    big = torch.cat([moved[k].flatten()[0::2] for k in moved])
    if error_feedback:  # every coordinate within one quantisation step (A/3) of the learner's progress
        assert float((big - cycles * A).abs().max()) <= A / 3
        assert float((small - cycles * A / 10).abs().max()) <= A / 3
        assert abs(float(small.median()) - cycles * A / 10) <= A / 6
    else:  # A sent whole every cycle, up to the bf16 block scale's rounding; a never (the median:
        # a tensor whose last block holds one value sends that one exactly)
        assert torch.allclose(big, torch.full_like(big, cycles * A), rtol=4e-3)
        assert float(small.median()) == 0.0
