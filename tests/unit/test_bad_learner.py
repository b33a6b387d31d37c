"""One bad learner (or one bad object) cannot hurt the run (issue 25): bounded norms, shares and
counters that survive restarts; heartbeats from the future; status alerts on a learner that keeps
being cut. (Signatures before decoding and quarantine reports that survive a restart [A2], on every
backend: tests/integration/test_quarantine_stores.py.)"""

from __future__ import annotations

import pytest
import torch

from ddiloco_cli.protocol import layout, ledger
from ddiloco_cli.store import open_store

TASK = "ddiloco_cli.tasks.gpt:tiny"


# ------------------------------------------------------------ bounded influence
def test_one_learners_share_of_a_merge_is_capped_and_replayed(tmp_path):
    from ddiloco_cli.syncer.decide import MAX_SHARE

    from support.runs import beat, contribution, live_syncer, make_run, restored, step

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


def test_norms_that_grow_for_every_learner_at_once_are_not_clipped_but_one_outlier_still_is(tmp_path):
    from ddiloco_cli.syncer.judge import NORM_BOUND_FACTOR, norm_clip

    from support.runs import beat, contribution, delta_for, live_syncer, make_run, restored, step

    window = [1.0] * 8 + [9.0, 11.0]  # the merged norms and the others' pending ones
    assert norm_clip(10.0, window, [[9.0, 11.0]]) == 1.0  # the peers' median (10) floors the window's (1)
    assert norm_clip(10.0, window, [[], [1.0, 9.0, 11.0]]) == 1.0  # the highest floor counts
    assert norm_clip(1000.0, window, [[9.0, 11.0]]) == pytest.approx(NORM_BOUND_FACTOR * 10.0 / 1000.0)
    assert norm_clip(10.0, window) == pytest.approx(NORM_BOUND_FACTOR / 10.0)  # no peers: the window's
    store = open_store(str(tmp_path / "run"))
    make_run(store, quorum=3)
    for lid in "abc":
        beat(store, lid)
    s = live_syncer(store, fragments=[0])

    def merge(v: int, scale: dict[str, float]) -> dict[str, dict]:
        for i, lid in enumerate("abc"):
            delta = {k: scale[lid] * t for k, t in delta_for(store, 0, 10 * v + i).items()}
            contribution(store, 0, lid, v + 1, base_version=v, tensors=delta)
        assert step(s, 0) and s.states[0].version == v + 1
        return {e["learner_id"]: e for e in ledger.read_manifest(store, 0, v + 1)["contributions"]}

    merge(0, dict(a=1.0, b=1.0, c=1.0))
    merge(1, dict(a=1.0, b=1.0, c=1.0))
    grown = merge(2, dict(a=8.0, b=8.0, c=8.0))  # a warmup: every norm 8x the window's at once
    assert all("clip" not in e for e in grown.values())
    outlier = merge(3, dict(a=8.0, b=8.0, c=800.0))
    assert "clip" not in outlier["a"] and "clip" not in outlier["b"] and 0 < outlier["c"]["clip"] < 0.05
    r = restored(store)  # the replay merges the same
    assert all(torch.equal(t, r.states[0].current.raw[k]) for k, t in s.states[0].current.raw.items())


def test_a_huge_delta_in_a_fragments_first_merge_is_clipped_by_the_two_others_in_it(tmp_path):
    from support.runs import beat, contribution, delta_for, live_syncer, make_run

    store = open_store(str(tmp_path / "run"))
    make_run(store, quorum=3)
    for lid in "abm":
        beat(store, lid)
    s = live_syncer(store, fragments=[0])
    for i, lid in enumerate("abm"):  # no merged norm yet: a's and b's are all there is to go by
        scale = 1000.0 if lid == "m" else 1.0
        contribution(store, 0, lid, 1, tensors={k: scale * t for k, t in delta_for(store, 0, i).items()})
    s.poll_contributions()
    assert s.maybe_merge(s.states[0])
    used = {e["learner_id"]: e for e in ledger.read_manifest(store, 0, 1)["contributions"]}
    assert "clip" not in used["a"] and "clip" not in used["b"] and 0 < used["m"]["clip"] < 0.01


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

    from ddiloco_cli.syncer.decide import STEP_SLACK, TOKEN_SLACK

    from support.runs import beat, contribution, live_syncer, make_run, step

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

    from ddiloco_cli.learner.session import check_id_free
    from ddiloco_cli.ops.observe import run_status

    from support.runs import beat, live_syncer, make_run

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
    from ddiloco_cli.ops.observe import run_status
    from ddiloco_cli.syncer.state import SUSPECT_AFTER

    from support.runs import beat, contribution, live_syncer, make_run, step

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
