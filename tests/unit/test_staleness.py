"""Staleness is other learners' work ([M5], staleness.py): a learner's own merges never make
its next contribution stale, catch-ups after a syncer outage are not refused, a restarted
syncer judges staleness as the serving one did, and the simulation refuses nothing for a
single learner or equal speeds."""

from __future__ import annotations

import uuid

import pytest

from ddiloco_cli.protocol import ledger
from ddiloco_cli.store import open_store
from ddiloco_cli.syncer.staleness import cycle_advance, others_work, version_shares

from support.runs import beat, contribution, live_syncer, make_run, restored, step

H = 2  # make_run's sync_every


def _entries(store, p: int = 0) -> list[dict]:
    return [c for v in ledger.list_versions(store, p) for c in ledger.read_manifest(store, p, v)["contributions"]]


def _merge_alone(s) -> None:
    """Poll, judge, and commit the pending set now (no grace window: merges one by one)."""
    s.poll_contributions()
    state = s.states[0]
    s.decider.admit_pending(state)
    v = state.version
    assert s.commit(state, grace_s=0.0) and s.states[0].version == v + 1


def test_each_contribution_counts_for_at_most_one_send_and_shares_come_from_the_manifest():
    assert cycle_advance([("a", 684), ("b", 1)], sync_every=16, num_learners=2) == pytest.approx(17 / 32)
    m = {"cycle_advance": 0.75, "contributions": [
        {"used": True, "learner_id": "a", "c_steps": 40},
        {"used": True, "learner_id": "b", "c_steps": 12, "increment_of": {"c_steps": 4}},
        {"used": False, "learner_id": "c", "c_steps": 16}]}
    advance, shares = version_shares(m, sync_every=16)
    assert advance == 0.75 and shares == {"a": pytest.approx(0.75 * 16 / 24), "b": pytest.approx(0.75 * 8 / 24)}
    table = {v: (1.0, {"a": 0.5, "b": 0.5}) for v in range(1, 11)}
    assert others_work("a", base_version=2, version=10, shares_of=table.__getitem__, limit=100) == 4.0
    assert others_work("a", base_version=0, version=10, shares_of=table.__getitem__, limit=1.2) == 1.5  # stops early


def test_a_single_learners_catch_up_never_makes_its_next_contributions_stale():
    """One learner; the syncer started late, so its first contribution covers 684 steps. Its
    next ones were sent on base 0 before it could receive version 1. Before: the catch-up moved
    the clock 342 cycles and every one of them was refused as stale."""
    store = open_store(f"memory://stale-{uuid.uuid4().hex}")
    make_run(store, num_fragments=1, max_staleness=4)
    beat(store, "a")
    s = live_syncer(store)
    contribution(store, 0, "a", 1, c_steps=684, c_tokens=684 * 8)
    assert step(s, 0)
    for seq in range(2, 8):  # still on base 0: each resends its progress since that base
        contribution(store, 0, "a", seq, c_steps=684 + H * (seq - 1), c_tokens=(684 + H * (seq - 1)) * 8)
        assert step(s, 0)
    entries = _entries(store)
    assert [e["status"] for e in entries] == ["used"] * 7
    assert all(e["staleness"] == 0 for e in entries)


@pytest.mark.parametrize("num_learners", [3, 8])
def test_catch_ups_after_a_syncer_outage_are_not_refused(num_learners):
    """N learners train 40 cycles through a syncer outage on base 1; the syncer comes back and
    their catch-ups (30 H steps each, on base 1) arrive one by one, each merged on its own. A
    restarted syncer judges the rest as the serving one would. Before: the first catch-up moved
    the clock 41 / N cycles per learner's send and the others were refused as stale."""
    store = open_store(f"memory://outage-{uuid.uuid4().hex}")
    make_run(store, num_fragments=1, max_staleness=4)
    learners = [f"l{i}" for i in range(num_learners)]
    for lid in learners:
        beat(store, lid)
    s = live_syncer(store)
    for lid in learners:
        contribution(store, 0, lid, 1, c_steps=H, c_tokens=H * 8)
    assert step(s, 0) and s.states[0].version == 1
    steps = H + 40 * H
    contribution(store, 0, learners[0], 2, base_version=1, c_steps=steps, c_tokens=steps * 8)
    _merge_alone(s)
    for i, lid in enumerate(learners[1:], start=1):
        if i == num_learners // 2:  # the syncer restarts: shares come back from the manifests
            s.heartbeat(force=True, state="stopped")
            r = restored(store)
            assert r.states[0].shares == {}
            s = live_syncer(store, syncer_id=f"again{i}")
        contribution(store, 0, lid, 2, base_version=1, c_steps=steps, c_tokens=steps * 8)
        s.poll_contributions()
        state = s.states[0]
        assert s.decider.staleness(state, state.contributions()[0]) == pytest.approx(i / num_learners)
        _merge_alone(s)
    entries = [e for e in _entries(store) if e["seq"] == 2]
    assert len(entries) == num_learners and all(e["status"] == "used" for e in entries)
    assert max(e["staleness"] for e in entries) < 1.0


@pytest.mark.parametrize("learners", [1, 2])
def test_the_simulation_refuses_nothing_through_a_syncer_outage(learners):
    """The deterministic simulation (real syncer and learner code): one learner, or two at equal
    speeds, train through a 6 s syncer outage from 0.5 s (15 cycles of H = 8 at 50 ms a step),
    max_staleness 4. Before: the first catch-up moved the clock over 4 cycles, and the
    contributions sent on the old base after it (the learner's own, or the other's catch-up)
    were refused (5 of 13 for the single learner)."""
    from ddiloco_cli.simtrain import Scenario, simulate_train

    sc = Scenario(learners=learners, steps_per_learner=160, step_s=0.05, eval_points=1, eval_batches=1,
                  arms=("decoupled",), syncer_outages=[{"at_s": 0.5, "duration_s": 6.0}],
                  run={"sync_every": 8, "overlap_steps": 4, "num_fragments": 2, "max_staleness": 4})
    r = simulate_train(sc)["decoupled"]
    assert r["ledger"]["used"] > 0 and r["ledger"]["refused"] == 0
