"""The syncer's outer loop is lossless and faithful: error feedback on publish, replay
that reproduces commits byte for byte, supersede only on an unchanged base, the ledger
audit, and a schedule simulation of out-of-phase learners where nothing is lost."""

from __future__ import annotations

import heapq
import json
import shutil
import statistics
import uuid

import pytest
import torch

from ddiloco_cli.clock import VirtualClock
from ddiloco_cli.numerics.outer import OuterOptimizer
from ddiloco_cli.protocol import layout, ledger
from ddiloco_cli.store import open_store
from ddiloco_cli.syncer.audit import audit_ledger
from ddiloco_cli.syncer.core import Syncer, SyncerOptions
from ddiloco_cli.syncer.intake import Contribution, add_pending
from ddiloco_cli.syncer.judge import NORM_BOUND_FACTOR
from ddiloco_cli.syncer.update import FragmentValue, outer_update

from support.runs import assert_same_state, beat, contribution, drive, live_syncer, make_run, restored, step

QMAX = {"int8": 127, "int4": 7}
BLOCK = 64


@pytest.fixture
def run_store():
    store = open_store(f"memory://syncer-{uuid.uuid4().hex}")
    make_run(store)
    return store


def _update(value: FragmentValue, grad: dict, publish_codec: str) -> FragmentValue:
    new, _ = outer_update(value, fragment=0, grads=[grad], weights=[1.0], lr=0.7, method="rda",
                          publish_codec=publish_codec, block_size=BLOCK, keyframe=False, cycle=0.0)
    return new


@pytest.mark.parametrize("publish_codec", ["int4", "int8"])
def test_error_feedback_keeps_every_coordinate_within_one_step_of_exact(publish_codec):
    """40 versions of a constant outer gradient with one large coordinate per 64-block: every
    coordinate of the published value stays within one quantisation step of the exact
    (unquantised) trajectory. Without error feedback the small coordinates never moved."""
    n = 4 * BLOCK
    grad = torch.full((n,), 0.01)
    grad[::BLOCK] = 1.0  # one outlier per block: alone it sets the block's scale
    start = {"w": torch.zeros(n)}
    exact = FragmentValue(0, start, start, OuterOptimizer(lr=0.7, momentum=0.9))
    fed = FragmentValue(0, start, start, OuterOptimizer(lr=0.7, momentum=0.9))
    for _ in range(40):
        prev = fed.published["w"]
        exact = _update(exact, {"w": grad}, "none")
        fed = _update(fed, {"w": grad}, publish_codec)
        assert torch.equal(fed.raw["w"], exact.published["w"])  # the raw value follows the exact trajectory
        # one step of the last delta's quantiser, per block (scale = absmax / qmax rounded up to bf16)
        last_delta = (exact.published["w"] - prev).reshape(-1, BLOCK)
        q_step = last_delta.abs().amax(dim=1, keepdim=True) / QMAX[publish_codec] * (1 + 2 ** -7)
        err = (fed.published["w"] - exact.published["w"]).reshape(-1, BLOCK).abs()
        assert bool((err <= q_step).all()), float((err - q_step).max())
    small = torch.ones(n, dtype=torch.bool)
    small[::BLOCK] = False
    # the small coordinates moved with the exact ones (-2.24); absorbing the error instead left them at 0
    assert float(fed.published["w"][small].max()) < -2.0


def test_replay_after_a_kill_reproduces_raw_value_and_bytes(tmp_path):
    """A syncer restarted from checkpoint + ledger holds the same raw value (residual), momentum
    and published value as the one that died; its next commit has the same payload bytes."""
    root = tmp_path / "run"
    store = open_store(str(root))
    make_run(store, publish_codec="int4", checkpoint_every=3, keyframe_every=4)
    beat(store, "a")
    beat(store, "b")
    live = live_syncer(store)
    drive(store, live, rounds=5)  # checkpoint at 3, versions 4 and 5 replayed
    for p in live.fragments:
        assert any(not torch.equal(live.states[p].current.raw[k], live.states[p].value[k]) for k in live.states[p].value)
    shutil.copytree(root, tmp_path / "copy")
    other = open_store(str(tmp_path / "copy"))
    again = live_syncer(other, syncer_id="again")  # the dead syncer's successor (a higher epoch in its copy)
    assert_same_state(live, again)
    for store_, s in ((store, live), (other, again)):
        for lid in ("a", "b"):  # both see the same live learners (the participation lr depends on them)
            beat(store_, lid)
        s._refresh_learners()
        contribution(store_, 0, "a", 900, base_version=5)
        contribution(store_, 0, "b", 901, base_version=4)
        assert step(s, 0)
    payloads = [{e["kind"]: st.get(e["key"]) for e in ledger.read_manifest(st, 0, 6)["payloads"]} for st in (store, other)]
    assert payloads[0] == payloads[1]


def _c(seq: int, base: int) -> Contribution:
    return Contribution("a", seq, f"k{seq}", "0" * 64, 1, base, 10, 1, {})


def test_supersede_only_when_the_base_is_unchanged():
    pending: list[Contribution] = []
    assert add_pending(pending, _c(1, 0)) == []
    assert add_pending(pending, _c(2, 1)) == []  # re-based in between: both stay
    gone = add_pending(pending, _c(3, 1))  # same base as seq 2: seq 3 carries it
    assert [(e.seq, e.status, e.carried_by) for e in gone] == [(2, "superseded", 3)]
    assert [c.seq for c in pending] == [1, 3]
    gone = add_pending(pending, _c(0, 0))  # arrives late, same base as seq 1
    assert [(e.seq, e.carried_by) for e in gone] == [(0, 1)]


def test_contributions_across_a_rebase_are_both_merged(run_store):
    """K=2 example of the issue: a's seq 1 (base 0) is pending and seq 2 (base 1) arrives; both
    are merged, each against its own base, so version 2 depends on seq 1."""
    beat(run_store, "a")
    beat(run_store, "b")
    s = live_syncer(run_store)
    contribution(run_store, 0, "b", 1)
    contribution(run_store, 0, "a", 2)
    assert step(s, 0)  # version 1 from a and b
    k1, _, _ = contribution(run_store, 0, "a", 3, base_version=0)  # trained on base 0 still
    k2, _, _ = contribution(run_store, 0, "a", 4, base_version=1)
    contribution(run_store, 0, "b", 5, base_version=1)
    assert step(s, 0)
    m = ledger.read_manifest(run_store, 0, 2)
    assert {c["key"]: c["status"] for c in m["contributions"] if c["learner_id"] == "a"} == {k1: "used", k2: "used"}
    assert m["quorum_size"] == 2
    assert audit_ledger(run_store, run_id=s.run_id, fragments=[0, 1]).problems == []


def test_audit_finds_lost_and_duplicated_contributions(run_store):
    beat(run_store, "a")
    s = live_syncer(run_store)
    contribution(run_store, 0, "a", 5)
    contribution(run_store, 0, "a", 7)
    assert step(s, 0)
    audit = audit_ledger(run_store, run_id=s.run_id, fragments=[0, 1])
    assert audit.problems == [] and audit.counts["used"] == 1 and audit.counts["superseded"] == 1
    assert audit.used_tokens[0] == 64
    late, _, _ = contribution(run_store, 0, "a", 6)  # below the high-water mark and in no entry
    pending, _, _ = contribution(run_store, 0, "a", 8)
    audit = audit_ledger(run_store, run_id=s.run_id, fragments=[0, 1])
    assert audit.counts["pending"] == 1
    assert len(audit.problems) == 1 and late in audit.problems[0] and "lost" in audit.problems[0]
    m = ledger.read_manifest(run_store, 0, 1)
    twice = {**m, "version": 2, "nonce": "dup", "contributions": m["contributions"][:1]}
    assert ledger.commit_manifest(run_store, twice)
    problems = audit_ledger(run_store, run_id=s.run_id, fragments=[0]).problems
    assert any("in 2 ledger entries" in p for p in problems)


@pytest.mark.parametrize("num_learners", [16])
def test_out_of_phase_schedule_loses_nothing(num_learners):
    """Schedule simulation with the real intake, ready_to_merge and commit: M learners, half at
    1.0 s and half at 1.5 s per step, H = 24, tau = 2, K = 1, a fake clock. Each learner sends
    every H of its steps against the version it holds and receives the latest version tau
    steps later. Every contribution ends used (none refused, none superseded: each re-bases
    between sends), and the audit finds nothing lost."""
    H, tau, horizon_s = 24, 2, 400.0
    store = open_store(f"memory://sim-{uuid.uuid4().hex}")
    make_run(store, num_fragments=1, sync_every=H, overlap_steps=tau, quorum=1, max_staleness=8,
             checkpoint_every=1000, grace_max_s=5.0, heartbeat_s=1000.0, lease_s=10_000.0)
    learners = [f"l{i:02d}" for i in range(num_learners)]
    step_s = {lid: 1.0 if i % 2 == 0 else 1.5 for i, lid in enumerate(learners)}
    for lid in learners:
        beat(store, lid)
    clock = VirtualClock()
    s = Syncer(store, options=SyncerOptions(syncer_id="sim", gc=False, clock=clock))
    assert s.acquire()
    s.restore()
    s._refresh_learners()
    holds = {lid: 0 for lid in learners}
    events = []  # (time, kind, learner)
    for i, lid in enumerate(learners):  # phases spread over one cycle
        heapq.heappush(events, (H * step_s[lid] * (1 + i / num_learners), 0, lid))
    seq = 0
    sent = 0
    while events:
        t, kind, lid = heapq.heappop(events)
        clock.advance_to(t)
        if kind == 0:  # send, then receive tau steps later
            seq += 1
            contribution(store, 0, lid, seq, base_version=holds[lid], c_tokens=H * 8, c_steps=H)
            sent += 1
            heapq.heappush(events, (t + tau * step_s[lid], 1, lid))
            if t + H * step_s[lid] < horizon_s:
                heapq.heappush(events, (t + H * step_s[lid], 0, lid))
        else:
            holds[lid] = s.states[0].version
        s.poll_contributions()
        s.maybe_merge(s.states[0])
    for _ in range(50):  # drain: the grace window runs out on the fake clock
        clock.advance(1.0)
        s.poll_contributions()
        s.maybe_merge(s.states[0])
    audit = audit_ledger(store, run_id=s.run_id, fragments=[0])
    assert audit.problems == []
    assert audit.counts["used"] == sent and audit.counts["refused"] == 0 and audit.counts["pending"] == 0
    stale = [c["staleness"] for v in ledger.list_versions(store, 0) for c in ledger.read_manifest(store, 0, v)["contributions"]]
    assert max(stale) < 8


def test_the_grace_window_spans_what_the_first_sender_can_absorb():
    """K = 1, two live learners at 1 s per step, H = 24, tau = 2, gamma 0.5. A decoupled
    learner [L8] holds out for its own merge until step t + H - 1, so the syncer waits up to
    gamma * (H - 1) steps for the second learner and merges both in one version."""
    store = open_store(f"memory://grace-{uuid.uuid4().hex}")
    make_run(store, num_fragments=1, sync_every=24, overlap_steps=2, quorum=1, grace_gamma=0.5, grace_max_s=30.0,
             heartbeat_s=1000.0, lease_s=10_000.0)
    for lid in ("a", "b"):
        beat(store, lid, step_time_s=1.0)
    clock = VirtualClock()
    s = Syncer(store, options=SyncerOptions(syncer_id="g", gc=False, clock=clock))
    assert s.acquire()
    s.restore()
    s._refresh_learners()
    contribution(store, 0, "a", 1)
    merged_at = None
    for t in range(12):  # a's contribution waits; b reports at t = 8 s
        clock.advance_to(float(t))
        if t == 8:
            contribution(store, 0, "b", 1)
        s.poll_contributions()
        if s.maybe_merge(s.states[0]) and merged_at is None:
            merged_at = clock.monotonic()
    first = ledger.read_manifest(store, 0, 1)
    merged = sorted(c["learner_id"] for c in first["contributions"])
    assert (merged_at, merged) == (8.0, ["a", "b"])  # 8 s < 0.5 * 23 s: b's work joins a's merge


def test_non_finite_update_commits_nothing_and_refuses_the_culprit_V3(run_store):
    """[V3] a finite contribution so large that the outer step overflows fp32: nothing is
    committed and the contribution is quarantined (no ledger entry: the report is its record)."""
    beat(run_store, "a")
    s = live_syncer(run_store)
    huge = {k: torch.full_like(t, 3e38) for k, t in s.states[0].value.items()}
    key, _, _ = contribution(run_store, 0, "a", 5, tensors=huge)
    assert not step(s, 0)
    assert ledger.list_versions(run_store, 0) == [0] and key in s.bad_keys
    assert "not finite" in json.loads(run_store.get(layout.quarantine_key(key)))["reason"]
    contribution(run_store, 0, "a", 6)
    assert step(s, 0)
    assert [c["seq"] for c in ledger.read_manifest(run_store, 0, 1)["contributions"]] == [6]


def test_contribution_far_above_the_running_median_norm_is_clipped_V2(run_store):
    """[V2] once 8 norms are known, a contribution 1000x the running median is scaled down to
    the bound (not refused), its factor in the ledger; a restarted syncer has the same median."""
    beat(run_store, "a")
    s = live_syncer(run_store)
    for seq in range(1, 9):
        contribution(run_store, 0, "a", seq, base_version=s.states[0].version)
        assert step(s, 0)
    median = statistics.median(s.states[0].norms)
    assert list(restored(run_store).states[0].norms) == list(s.states[0].norms)  # from the ledger
    big = {k: 1000 * t for k, t in contribution(run_store, 0, "a", 9, key="tmp/9.safetensors")[2].items()}
    key, _, _ = contribution(run_store, 0, "a", 10, base_version=8, tensors=big)
    assert step(s, 0)
    entry = {c["key"]: c for c in ledger.read_manifest(run_store, 0, 9)["contributions"]}[key]
    assert entry["status"] == "used" and 0 < entry["clip"] < 0.01
    assert entry["norm"] == pytest.approx(NORM_BOUND_FACTOR * median)
    r = restored(run_store)  # the replay clips the same
    assert r.states[0].version == 9
    assert all(torch.equal(t, r.states[0].current.raw[k]) for k, t in s.states[0].current.raw.items())


def _resend_on_a_merged_base():
    """Learner a sends d1 (seq 1, base 0), version 1 merges it, then a sends d12 = 3 d1 (its
    progress 1 plus progress 2, still on base 0) and version 2 merges that; one Nesterov step per
    merge. Returns (store, syncer, v0, v1, d1, d12, version 2's ledger entry)."""
    run_store = open_store(f"memory://resend-{uuid.uuid4().hex}")
    make_run(run_store, outer_lr_scaling="none")
    beat(run_store, "a")
    s = live_syncer(run_store)
    v0 = {k: t.clone() for k, t in s.states[0].value.items()}
    d1 = {k: 0.01 * torch.ones_like(t) for k, t in v0.items()}
    d12 = {k: 3 * t for k, t in d1.items()}
    contribution(run_store, 0, "a", 1, tensors=d1, c_tokens=64, c_steps=2)
    assert step(s, 0)
    v1 = {k: t.clone() for k, t in s.states[0].value.items()}
    contribution(run_store, 0, "a", 2, tensors=d12, c_tokens=192, c_steps=6)
    assert step(s, 0)
    return run_store, s, v0, v1, d1, d12, ledger.read_manifest(run_store, 0, 2)["contributions"][0]


def test_an_older_base_is_measured_against_the_current_value():
    """[M3] a contribution on an older base pulls the
    fragment towards the learner's model, g = (current - base) + delta, so what the version in
    between already merged is not applied twice. A restarted syncer replays it bit for bit, reading the base's published value."""
    run_store = open_store(f"memory://cur-{uuid.uuid4().hex}")
    make_run(run_store, outer_lr_scaling="none")  # one Nesterov step per merge: easy to check by hand
    beat(run_store, "a")
    s = live_syncer(run_store)
    v0 = {k: t.clone() for k, t in s.states[0].value.items()}
    d1 = {k: 0.01 * torch.ones_like(t) for k, t in v0.items()}
    d2 = {k: 0.03 * torch.ones_like(t) for k, t in v0.items()}
    contribution(run_store, 0, "a", 1, tensors=d1, c_tokens=64, c_steps=2)
    assert step(s, 0)  # version 1: a alone (b has not reported; K = 1)
    v1 = {k: t.clone() for k, t in s.states[0].value.items()}
    for k in v1:  # first Nesterov step: buf = g, new = v0 - lr * (g + m * g)
        assert torch.allclose(v1[k], v0[k] - 0.7 * 1.9 * d1[k], atol=1e-6), k
    beat(run_store, "a", state="finished")  # b is then the only live learner: no grace window to wait out
    beat(run_store, "b")  # joins with a contribution on version 0, made before version 1 existed
    contribution(run_store, 0, "b", 1, tensors=d2, c_tokens=64, c_steps=2)
    assert step(s, 0)
    entry = ledger.read_manifest(run_store, 0, 2)["contributions"][0]
    assert entry["base_version"] == 0 and "increment_of" not in entry
    g = {k: (v1[k] - v0[k]) + d2[k] for k in v0}  # = v1 - theta_b
    buf = {k: 0.9 * d1[k] + g[k] for k in g}
    for k in v1:
        assert torch.allclose(s.states[0].value[k], v1[k] - 0.7 * (g[k] + 0.9 * buf[k]), atol=1e-6), k
    r = restored(run_store)  # replays from version 0: reads version 0's published value for b's base
    for k, t in s.states[0].current.raw.items():
        assert torch.equal(t, r.states[0].current.raw[k])
    assert audit_ledger(run_store, run_id=s.run_id, fragments=[0]).used_tokens[0] == 128


def test_audit_flags_a_gone_base_that_replay_needs_M6():
    """[M6] outer gradients are measured against the current value: a restarting syncer replays each
    merge against its contributions' bases: `inspect --verify` (audit_ledger) reports a base
    version that is gone while a replay still needs it."""
    run_store = open_store(f"memory://base-{uuid.uuid4().hex}")
    make_run(run_store, checkpoint_every=10)  # no checkpoint: a replay runs from version 0
    beat(run_store, "a")
    beat(run_store, "b")
    s = live_syncer(run_store)
    drive(run_store, s, rounds=3)  # b's contribution in version 3 is on base 1
    assert not audit_ledger(run_store, run_id=s.run_id, fragments=[0]).problems
    run_store.delete(layout.manifest_key(0, 1))
    problems = audit_ledger(run_store, run_id=s.run_id, fragments=[0]).problems
    assert any(layout.manifest_key(0, 1) in p and "the base of a contribution used by version" in p
               for p in problems), problems


def test_a_resend_on_a_merged_base_counts_only_new_tokens_under_current_M6():
    """[M6] a resend on a base already merged is measured against the
    current value, which holds the merged part, so its gradient is the whole `current - theta`;
    its tokens and steps count only the increment (weight, ledger totals), and a restarted
    syncer replays it bit for bit."""
    run_store, s, v0, v1, d1, d12, entry = _resend_on_a_merged_base()
    assert entry["increment_of"]["seq"] == 1 and entry["merged_tokens"] == 128
    # its 4 new steps are 2 cycles at H = 2: a bounded catch-up, the buffer takes in g / 2 ([M3])
    assert ledger.read_manifest(run_store, 0, 2)["outer_intake"] == 0.5
    g = {k: (v1[k] - v0[k]) + d12[k] for k in v0}
    buf = {k: 0.9 * d1[k] + 0.5 * g[k] for k in g}
    for k in v1:
        assert torch.allclose(s.states[0].value[k], v1[k] - 0.7 * (g[k] + 0.9 * buf[k]), atol=1e-6), k
    r = restored(run_store)
    for k, t in s.states[0].current.raw.items():
        assert torch.equal(t, r.states[0].current.raw[k])
    assert r.states[0].tips["a"].seq == 2
    assert audit_ledger(run_store, run_id=s.run_id, fragments=[0]).used_tokens[0] == 192


def test_an_idle_syncer_polls_less_often_and_at_once_again_when_a_contribution_comes(run_store):
    """The serve loop's pause: poll_s while contributions arrive or wait for a merge; idle, it
    doubles up to a quarter of the live learners' median step time, never past heartbeat_s
    (the loop writes the lease's heartbeat too) and never below poll_s."""
    s = live_syncer(run_store)
    assert s.poll_contributions() == 0
    pauses = [s.opts.poll_s]
    for _ in range(10):
        pauses.append(s.next_poll_s(pauses[-1], idle=True))
    assert pauses[:3] == [0.01, 0.02, 0.04] and pauses[-1] == s.config.heartbeat_s == 0.5  # no learner live
    s.learners.step_time_s = 0.4
    assert s.next_poll_s(0.5, idle=True) == pytest.approx(0.1)
    s.learners.step_time_s = 0.001
    assert s.next_poll_s(0.5, idle=True) == s.opts.poll_s
    beat(run_store, "a")
    contribution(run_store, 0, "a", 1)
    assert s.poll_contributions() == 1  # a key it had not seen: the loop goes back to poll_s
    assert s.next_poll_s(0.5, idle=False) == s.opts.poll_s
    assert s.poll_contributions() == 0
