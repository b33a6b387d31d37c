"""The deterministic simulation's parts (ddiloco_cli/simtrain): the event loop, the
simulated bucket's costs and visibility, the scenario, the report's arithmetic, and one
tiny whole run against the real syncer and learner code."""

from __future__ import annotations

import pytest
import torch

from ddiloco_cli.errors import UsageError
from ddiloco_cli.protocol import layout
from ddiloco_cli.simtrain.arms import allreduce_s, concat, dp_step_s, sync_time_s
from ddiloco_cli.simtrain.bucket import Link, SimBucket, SimStore
from ddiloco_cli.simtrain.loop import EventLoop, Timer, TurnClock
from ddiloco_cli.simtrain.report import duration, percentile, time_to_reach
from ddiloco_cli.simtrain.scenario import Scenario, load_scenario
from ddiloco_cli.store.base import NotFound


def test_event_loop_runs_in_time_order_and_ties_in_insertion_order():
    loop, seen = EventLoop(), []
    for t, name in [(2.0, "c"), (1.0, "a"), (1.0, "b"), (0.5, "first")]:
        loop.at(t, seen.append, name)
    loop.run(done=lambda: False)
    assert seen == ["first", "a", "b", "c"] and loop.now == 2.0


def test_timer_keeps_the_earliest_wakeup_and_drops_cancelled_ones():
    loop, fired = EventLoop(), []
    timer = Timer(loop, lambda: fired.append(loop.now))
    timer.arm(5.0)
    timer.arm(3.0)  # earlier: replaces
    timer.arm(4.0)  # later: ignored
    loop.run(done=lambda: False)
    assert fired == [3.0]
    timer.arm(7.0)
    timer.cancel()
    loop.run(done=lambda: False)
    assert fired == [3.0]


def _store(bucket, loop, *, latency_s=0.1, bps=1000.0, parallel=1):
    clock = TurnClock(loop)
    return SimStore(bucket, clock, Link(bps, bps, latency_s), name="t", seed="s", parallel=parallel), clock


def test_a_write_is_visible_to_others_only_when_it_would_have_finished():
    loop, bucket = EventLoop(), SimBucket()
    writer, wclock = _store(bucket, loop)
    reader, rclock = _store(bucket, loop)
    assert writer.put_if_absent("a/x", b"0123456789")  # 0.1 s latency + 10 B / 1000 B/s
    assert wclock.spent == pytest.approx(0.11)
    with pytest.raises(NotFound):
        reader.get("a/x")  # at t = 0 it is still uploading
    assert reader.list("a/") == []
    loop.now = 0.2
    rclock.begin()
    assert reader.get("a/x") == b"0123456789"
    assert rclock.spent == pytest.approx(0.11)
    assert not writer.put_if_absent("a/x", b"other")  # a create decides on what exists, visible or not


def test_an_overwrite_leaves_the_old_content_visible_until_it_lands():
    loop, bucket = EventLoop(), SimBucket()
    writer, wclock = _store(bucket, loop)
    reader, _ = _store(bucket, loop)
    writer.put("hb", b"old")
    loop.now = 1.0
    wclock.begin()
    writer.put("hb", b"new")
    assert reader.get("hb") == b"old"
    loop.now = 2.0
    assert reader.get("hb") == b"new"


def test_parallel_intake_overlaps_the_latency_of_contribution_gets_only():
    loop, bucket = EventLoop(), SimBucket()
    bucket.write("contributions/p00000/a/00000001.safetensors", b"x" * 100, 0.0)
    bucket.write("fragments/x", b"x" * 100, 0.0)
    store, clock = _store(bucket, loop, latency_s=0.4, bps=1e9, parallel=4)
    store.get("contributions/p00000/a/00000001.safetensors")
    assert clock.spent == pytest.approx(0.1, rel=1e-3)
    clock.begin()
    store.get("fragments/x")
    assert clock.spent == pytest.approx(0.4, rel=1e-3)


def test_a_larger_models_payload_takes_its_tensor_bytes_times_the_scale_and_its_header_once():
    """At ``model_params`` a payload's tensor data crosses the link ``payload_scale`` times as
    slowly, its safetensors header (a few hundred bytes per tensor, whatever their size) as
    it is: scaling the header too made the tiny GPT's sparse contributions (a third header)
    weigh 1.5x what a large model's do."""
    from ddiloco_cli.numerics import codec
    from ddiloco_cli.simtrain.bucket import header_bytes

    payload = codec.encode_tensors({"w": torch.randn(4096) * 1e-3}, codec="sparse", block_size=1024, density=0.02)
    hdr = header_bytes(payload)
    assert 8 < hdr < len(payload) and hdr == 8 + int.from_bytes(payload[:8], "little")
    assert header_bytes(b"\xff" * 16) == 0 and header_bytes(b"abc") == 0  # not a payload: all of it scales
    key, first = "contributions/p00000/a/00000001.safetensors", f"fragments/p00000/payloads/{layout.num(0)}-k.safetensors"
    for scale, plain in ((1.0, True), (1000.0, False)):
        loop, bucket = EventLoop(), SimBucket()
        bucket.payload_scale = scale
        store, clock = _store(bucket, loop, latency_s=0.0, bps=1e6)
        store.put(key, payload)
        want = len(payload) / 1e6 if plain else (hdr + 1000.0 * (len(payload) - hdr)) / 1e6
        assert clock.spent == pytest.approx(want, rel=1e-9)
        clock.begin()
        store.put("other/x.json", payload)  # a record: never scaled
        assert clock.spent == pytest.approx(len(payload) / 1e6, rel=1e-9)
        clock.begin()
        store.put(first, payload)  # the run's first version: built from the seed, not scaled
        assert clock.spent == pytest.approx(len(payload) / 1e6, rel=1e-9)
        assert store.bytes_up == 3 * len(payload)  # the counters stay the real bytes


def test_scenario_file_flags_and_quick(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('learners = 3\nspeeds = "two"\n[run]\nsync_every = 8\noverlap_steps = 4\n[[joins]]\nlearner = 1\nat_s = 30\n')
    sc = load_scenario(str(path), learners=5, steps_per_learner=None)
    assert sc.learners == 5 and sc.run_config().sync_every == 8 and sc.join_s(1) == 30.0
    assert [f for f, _ in sc.speed_factors()] == [1.0, 1.5, 1.0, 1.5, 1.0]
    assert load_scenario(str(path), quick=True).learners == 2
    with pytest.raises(UsageError, match="unknown keys"):
        load_scenario(None, bogus=1)
    with pytest.raises(UsageError, match="unknown RunConfig"):
        load_scenario(None, run={"nope": 1})


def test_learner_ids_follow_the_format_and_must_differ():
    # "l{i}" names the learners as bench_convergence.py does, so their data is its real learners'
    assert load_scenario(None, learners=3, learner_id_format="l{i}").learner_ids() == ["l0", "l1", "l2"]
    assert Scenario(learners=2).learner_ids() == ["L000", "L001"]
    for bad in ("same", "{j}"):
        with pytest.raises(UsageError, match="learner_id_format"):
            load_scenario(None, learners=2, learner_id_format=bad)


def test_lognormal_speeds_and_preemptions_are_seeded():
    a = Scenario(learners=4, speeds="lognormal", sigma=0.5, mtbf_s=100.0, seed=3)
    b = Scenario(learners=4, speeds="lognormal", sigma=0.5, mtbf_s=100.0, seed=4)
    assert a.speed_factors() == Scenario(**vars(a)).speed_factors() != b.speed_factors()
    trace = a.preemptions(0, 1000.0)
    assert trace and all(back - down == pytest.approx(a.downtime_s) for down, back in trace)
    assert all(t1[0] >= t0[1] for t0, t1 in zip(trace, trace[1:]))


def test_time_to_reach_interpolates_and_percentiles():
    curve = [(10.0, 3.0), (20.0, 2.0), (30.0, 1.5)]
    assert time_to_reach(curve, 2.5) == pytest.approx(15.0)
    assert time_to_reach(curve, 3.5) == 10.0
    assert time_to_reach(curve, 1.0) is None
    assert percentile([5, 1, 3, 2, 4], 0.5) == 3 and percentile([], 0.5) is None


def test_dp_step_time_is_compute_plus_a_ring_all_reduce():
    sc = Scenario(learners=4, step_s=1.0, up_mbps=100.0, down_mbps=100.0, rtt_ms=50.0)
    # 2 (M-1)/M x 4 B x 1e6 params = 6e6 B at 12.5e6 B/s, + 6 one-way latencies of 25 ms
    assert dp_step_s(sc, 1_000_000) == pytest.approx(1.0 + 0.48 + 0.15)
    assert dp_step_s(Scenario(learners=1, step_s=2.0), 10**9) == 2.0
    # a synchronous step waits for the slowest learner
    assert dp_step_s(Scenario(learners=4, speeds="two", slow_factor=1.5), 1_000_000) == pytest.approx(1.5 + 0.63)


def test_classic_diloco_time_is_compute_plus_one_all_reduce_per_cycle():
    sc = Scenario(learners=4, step_s=1.0, up_mbps=100.0, down_mbps=100.0, rtt_ms=50.0)
    assert allreduce_s(sc, 1_000_000) == pytest.approx(0.63)
    assert sync_time_s(sc, 1_000_000, 48, 16) == pytest.approx(48 + 3 * 0.63)
    assert sync_time_s(sc, 1_000_000, 47, 16) == pytest.approx(47 + 2 * 0.63)  # the third all-reduce not yet done
    assert [duration(None), duration(59.6), duration(3000), duration(7.2e4)] == ["not reached", "60 s", "50 min", "20.0 h"]


def test_payload_scale_charges_tensor_payloads_only_and_keeps_real_byte_counts():
    loop, bucket = EventLoop(), SimBucket()
    bucket.payload_scale = 10.0
    store, clock = _store(bucket, loop, latency_s=0.0, bps=1000.0)
    store.put("fragments/f0000/payloads/x.safetensors", b"0" * 100)  # 100 B x 10 at 1000 B/s
    assert clock.spent == pytest.approx(1.0)
    store.put("fragments/f0000/manifests/x.json", b"0" * 100)  # a record: not scaled
    assert clock.spent == pytest.approx(1.1)
    store.put(layout.payload_key(0, 0, "full", "ab12"), b"0" * 100)  # the first version: built from the seed
    assert clock.spent == pytest.approx(1.2)
    store.put(layout.payload_key(0, 1, "delta", "ab12"), b"0" * 100)
    assert clock.spent == pytest.approx(2.2)
    assert store.bytes_up == 400


def test_concat_joins_tuples_of_tensors():
    import torch

    a, b = (torch.zeros(2, 3), torch.ones(2, 3)), (torch.ones(1, 3), torch.zeros(1, 3))
    x, y = concat([a, b])
    assert x.shape == (3, 3) and y.shape == (3, 3) and float(x[2].sum()) == 3.0


def test_a_tiny_run_merges_every_contribution_with_the_real_code():
    from ddiloco_cli.simtrain import simulate_train

    sc = Scenario(learners=2, steps_per_learner=32, step_s=0.5, eval_points=1, eval_batches=2, arms=("decoupled",),
                  run={"sync_every": 8, "overlap_steps": 4, "num_fragments": 2})
    r = simulate_train(sc)["decoupled"]
    assert r["ledger"]["merged_token_fraction"] == pytest.approx(1.0)
    assert r["ledger"]["refused"] == 0 and r["ledger"]["used"] > 0
    assert r["val_loss"] < 4.5  # the untrained tiny GPT is at 4.59


def _tiny(**over) -> Scenario:
    base = dict(learners=2, steps_per_learner=32, step_s=0.5, eval_points=1, eval_batches=1, arms=("decoupled",),
                run={"sync_every": 8, "overlap_steps": 4, "num_fragments": 2})
    return Scenario(**{**base, **over})


def test_time_to_data_parallels_loss_at_a_larger_models_size():
    from ddiloco_cli.simtrain import simulate_train

    arms = dict(arms=("decoupled", "sync", "dp"), dp_steps=16, eval_points=4)
    small = simulate_train(_tiny(**arms))
    big = simulate_train(_tiny(**arms, model_params=2e8))
    # the same loss per step (the data-parallel run is the same), the times of a 1000x larger model
    assert big["dp"]["val_loss"] == small["dp"]["val_loss"]
    assert big["dp"]["time_to_final_s"] == pytest.approx(16 * dp_step_s(_tiny(), 2e8))
    assert big["sync"]["time_s"] == pytest.approx(sync_time_s(_tiny(), 2e8, 32, 8))
    assert big["decoupled"]["virtual_s"] > small["decoupled"]["virtual_s"] + 10  # its transfers take longer
    assert big["decoupled"]["bytes_up_per_learner"] < 1e6  # the counters stay the real bytes
    for result in (small, big):  # reached exactly when a point of the arm's curve is at the target or below
        target, dec, sync = result["dp"]["val_loss"], result["decoupled"], result["sync"]
        best_dec = min([p["val_loss"] for p in dec["curve"]] + [dec["val_loss"]])
        assert (dec["time_to_dp_loss_s"] is None) == (best_dec > target)
        assert (sync["time_to_dp_loss_s"] is None) == (min(v for _, v in sync["curve_steps"]) > target)
        assert len(sync["curve_steps"]) >= 2


def test_a_merge_costs_a_part_per_version_and_a_part_per_contribution_at_its_codecs_rates():
    from ddiloco_cli.protocol import ledger
    from ddiloco_cli.simtrain.scenario import MERGE_PARAMS_PER_S, VERSION_PARAMS_PER_S
    from ddiloco_cli.simtrain.world import World

    n = 2_000_000
    int4, sparse = _tiny(), _tiny(run={"codec": "sparse", "sync_every": 8, "overlap_steps": 4, "num_fragments": 2})
    assert int4.merge_cost_s(n, 4) == pytest.approx(n / VERSION_PARAMS_PER_S + 4 * n / MERGE_PARAMS_PER_S["int4"])
    assert sparse.merge_cost_s(n, 4) == pytest.approx(n / VERSION_PARAMS_PER_S + 4 * n / MERGE_PARAMS_PER_S["sparse"])
    assert sparse.merge_cost_s(n, 16) < int4.merge_cost_s(n, 16) / 2  # sparse contributions cost less each
    assert _tiny(syncer_cores=4).merge_cost_s(n, 4) == pytest.approx(int4.merge_cost_s(n, 4) / 4)
    slow = _tiny(merge_params_per_s=1e6, version_params_per_s=1e7)
    assert slow.merge_cost_s(n, 3) == pytest.approx(n / 1e7 + 3 * n / 1e6)
    with pytest.raises(UsageError, match="syncer_cores"):
        _tiny(syncer_cores=0).check()
    # the simulated syncer is charged exactly that for each merge it commits (slow rates: seconds)
    sc = slow
    world = World(sc)
    world.run()
    want = 0.0
    for p in range(world.plan.num_fragments):
        for v in range(1, (ledger.latest_version(world.admin, p) or 0) + 1):
            entries = ledger.read_manifest(world.admin, p, v, run_id=world.run_id)["contributions"]
            want += sc.merge_cost_s(world.plan.fragment_numel(p), sum(1 for e in entries if e.get("used")))
    assert want > 1.0 and sum(s.total_merge_s() for s in world.syncers) == pytest.approx(want)


def test_on_a_link_too_thin_for_a_cycle_the_learners_still_take_new_versions():
    """At 3e8 parameters over 100 Mbps a fragment's download outlasts a cycle (8 steps of
    0.5 s): every version arrives after the fragment's next send. The learners take them
    anyway (before 0.2.4 the simulated learner dropped them and never re-based)."""
    from ddiloco_cli.simtrain import simulate_train

    r = simulate_train(_tiny(steps_per_learner=96, model_params=3e8))["decoupled"]
    assert r["lag_steps_p50"] is not None and r["lag_steps_p50"] > 4  # received, later than tau
    assert r["ledger"]["refused"] == 0 and r["ledger"]["merged_token_fraction"] == 1.0


def test_a_standby_syncer_takes_over_during_an_outage_and_nothing_is_lost():
    from ddiloco_cli.simtrain import simulate_train

    outage = [{"at_s": 5.0, "duration_s": 1000.0}]
    alone = simulate_train(_tiny(syncer_outages=outage))["decoupled"]
    covered = simulate_train(_tiny(syncer_outages=outage, standby=True))["decoupled"]
    assert alone["virtual_s"] > 1005.0  # the merges wait for the primary's return
    assert covered["virtual_s"] < 100.0 and covered["syncer_epochs"] == 2
    for r in (alone, covered):
        assert r["ledger"]["merged_token_fraction"] == pytest.approx(1.0)


def test_preempted_learners_come_back_as_new_sessions_and_finish():
    from ddiloco_cli.simtrain import simulate_train

    r = simulate_train(_tiny(mtbf_s=6.0, downtime_s=2.0, joins=[{"learner": 1, "at_s": 3.0}]))["decoupled"]
    assert r["preemptions"] > 0 and r["sessions"] == 2 + r["preemptions"]
    assert r["ledger"]["used"] > 0 and r["ledger"]["refused"] == 0


def test_crash_points_of_a_commit_and_a_send_lose_nothing_and_replay_bit_exactly():
    from ddiloco_cli.simtrain.crash import Point, crash_scenario, points_of, run_point, verify

    scenario = crash_scenario(1, steps=12)
    world, plan = run_point(scenario, None)
    assert verify(world) == []
    points = points_of(plan)
    assert {p.target for p in points} == {"syncer", "learner"}
    chosen = [Point("syncer", plan.counts["syncer"] // 2, "before"), Point("syncer", plan.counts["syncer"] // 2, "after"),
              Point("learner", 1, "after"), Point("learner", 2, "queued")]
    for point in chosen:
        world, crashed = run_point(scenario, point)
        assert crashed.fired and world.loop.crashes, point
        assert verify(world) == [], point


def test_verify_catches_a_state_that_a_replay_does_not_reproduce():
    from ddiloco_cli.simtrain.crash import crash_scenario, run_point, verify

    world, _ = run_point(crash_scenario(2, steps=8), None)
    state = world.syncer.syncer.states[0]
    key = next(iter(state.current.raw))
    state.current.raw[key] = state.current.raw[key] + 1e-3
    assert any("differs" in problem for problem in verify(world))


def test_the_example_scenarios_load():
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[2] / "examples" / "simulation").glob("*.toml"))
    assert files
    for path in files:
        load_scenario(str(path)).run_config()


def test_sweep_table_goes_between_its_markers(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import sweep_sim

    cells = {(name, 2): [(1.01, 1.04), (1.03, 1.06)] for name in sweep_sim.ROWS}
    text = sweep_sim.table(cells, learners=[2])
    assert "1.020 (1.010-1.030)" in text and "1.050 (1.040-1.060)" in text
    doc = tmp_path / "results.md"
    doc.write_text(f"# R\n\nbefore\n{sweep_sim.BEGIN}\nold\n{sweep_sim.END}\nafter\n")
    sweep_sim.write_results(text, path=str(doc))
    out = doc.read_text()
    assert "old" not in out and text in out and out.startswith("# R\n\nbefore\n") and out.endswith("after\n")
    sc = sweep_sim.scenario_for({"ratio": 5.0, "preempt": True}, learners=2, seed=0, steps=8)
    assert sc.step_s == pytest.approx(5 * sweep_sim.round_trip_s(sc))
    assert sc.downtime_s / (sc.downtime_s + sc.mtbf_s) == pytest.approx(0.1)


def test_sweep_table_from_saved_cells_states_the_refusals_and_large_m_rows(tmp_path, capsys):
    """--from-cells rebuilds the table from a --cells-out file: ratios per (row, M) over seeds,
    the largest refused share, and rows not run at a large M shown as "-"."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import sweep_sim

    base, two = list(sweep_sim.ROWS)[:2]
    lines = [dict(row=base, M=2, seed=0, val=2.02, sync=2.0, dp=1.9, used=9, refused=1, merged=1.0),
             dict(row=base, M=2, seed=1, val=2.06, sync=2.0, dp=1.9, used=10, refused=0, merged=1.0),
             dict(row=two, M=2, seed=0, val=1.98, sync=2.0, dp=1.9, used=10, refused=0, merged=1.0),
             dict(row=base, M=64, seed=0, val=2.0, sync=2.0, dp=1.8, used=10, refused=0, merged=1.0)]
    path = tmp_path / "cells.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    text = sweep_sim.main(["--learners", "2,64", "--seeds", "2", "--steps", "8", "--from-cells", str(path)])
    base_line = next(line for line in text.splitlines() if line.startswith(f"| {base} |"))
    assert base_line.split(" | ")[1:4] == ["1.020 (1.010-1.030)", "1.074 (1.063-1.084)", "1.000"]
    two_line = next(line for line in text.splitlines() if line.startswith(f"| {two} |"))
    assert two_line.endswith("| 0.990 | 1.042 | - | - |")
    assert "at most 10.0% of a run's" in text and "(1 at M = 64, base row only)" in text
    capsys.readouterr()


def test_a_forked_crash_point_is_the_run_replayed_from_the_start_with_that_crash():
    from ddiloco_cli.simtrain.crash import crash_scenario, run_point
    from ddiloco_cli.simtrain.crashfork import run_digest, run_seed

    scenario = crash_scenario(3, steps=8)
    base, results, _ = run_seed(scenario, select=lambda p: p.index % 4 == 1, digest=True)
    assert base == [] and {p.target for p, _ in results} == {"syncer", "learner"}
    assert len({r["digest"] for _, r in results}) > 1  # the crashes change how the run ends
    checked = [next((p, r) for p, r in results if p.target == t and p.phase == ph)
               for t, ph in (("syncer", "before"), ("syncer", "after"), ("learner", "queued"), ("learner", "after"))]
    for point, result in checked:
        assert result["fired"] and result["problems"] == [], point
        world, crashed = run_point(scenario, point)
        assert crashed.fired and run_digest(world) == result["digest"], point


def test_a_forked_point_reports_its_problems_and_a_dying_child_is_a_failure(monkeypatch):
    from ddiloco_cli.simtrain import crashfork
    from ddiloco_cli.simtrain.crash import crash_scenario

    scenario = crash_scenario(4, steps=8)
    monkeypatch.setattr(crashfork, "verify", lambda world: ["made up"] if world.loop.crashes else [])
    _, results, _ = crashfork.run_seed(scenario, select=lambda p: p.index == 0, jobs=2)
    assert results and all(r["problems"] == ["made up"] for _, r in results)
    monkeypatch.setattr(crashfork, "verify", lambda world: crashfork.os._exit(3) if world.loop.crashes else [])
    _, results, _ = crashfork.run_seed(scenario, select=lambda p: p.index == 0)
    assert results and all("without a readable report" in r["problems"][0] for _, r in results)


def test_outage_recovery_is_measured_against_the_run_without_it_delayed_by_the_outage():
    """sweep_outer's recovery: the chaos curve after the syncer's return against the preempt
    row's curve shifted by the outage's length; negative when the outage cost less than its
    own time, positive when the run is still behind that trend; points past the trend's end
    are left out."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import sweep_outer

    trend = [dict(t_s=t, val_loss=3.0 - 0.01 * t) for t in range(0, 101, 10)]  # 3.0 at 0 s, 2.0 at 100 s
    outage = dict(at_s=20.0, duration_s=30.0)  # back at 50 s; the trend there is the curve at 20 s
    chaos = [dict(t_s=50.0 + d, val_loss=v) for d, v in ((0, 2.9), (5, 2.78), (10, 2.69), (20, 2.60), (45, 2.40))]
    rec = sweep_outer.recovery(chaos, outage=outage, cycle_s=5.0, trend_curve=trend)
    assert rec["1_cycles"] == dict(t_s=55.0, val=2.78, trend=2.75, above=0.03)  # still 0.03 above
    assert rec["2_cycles"]["above"] == pytest.approx(-0.01) and rec["2_cycles"]["trend"] == pytest.approx(2.7)
    assert rec["4_cycles"]["t_s"] == 70.0 and rec["4_cycles"]["above"] == pytest.approx(0.0)
    assert "8_cycles" in rec and rec["8_cycles"]["t_s"] == 95.0  # 95 - 30 = 65 s: inside the trend's 100 s
    assert rec["8_cycles"]["above"] == pytest.approx(0.05)
    short = sweep_outer.recovery(chaos, outage=outage, cycle_s=5.0, trend_curve=trend[:6])  # the trend ends at 50 s
    assert "4_cycles" in short and "8_cycles" not in short


def test_sweep_rows_subset_and_run_overrides_report_bytes_and_never_overwrite_the_table(tmp_path, capsys):
    """--rows and --run (a sparse sweep): the table has only those rows, the text names the codec
    and the overrides and each M's bytes per parameter per cycle; --write-results refuses them."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import sweep_sim

    base, two = sweep_sim.ROW_KEYS["base"], sweep_sim.ROW_KEYS["two"]
    lines = [dict(row=base, M=4, seed=s, val=2.2, sync=2.0, dp=1.9, used=10, refused=0, merged=1.0,
                  up_b_per_param_cycle=0.02 + 0.01 * s, down_b_per_param_cycle=0.01) for s in (0, 1)]
    lines.append(dict(row=two, M=4, seed=0, val=2.1, sync=2.0, dp=1.9, used=10, refused=0, merged=1.0))  # older file
    path = tmp_path / "cells.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    text = sweep_sim.main(["--learners", "4", "--seeds", "2", "--steps", "8", "--rows", "base",
                           "--run", '{"codec": "sparse"}', "--from-cells", str(path)])
    assert f"| {base} |" in text and f"| {two} |" not in text
    assert "sparse at density 0.02" in text and "outer lr 2.5, momentum 0" in text
    assert "M = 4 0.025 / 0.010" in text and "--rows base --run" in text
    with pytest.raises(SystemExit):
        sweep_sim.main(["--rows", "base", "--write-results", "--from-cells", str(path)])
    with pytest.raises(SystemExit):
        sweep_sim.main(["--rows", "nosuchrow", "--from-cells", str(path)])
    capsys.readouterr()


def test_sweep_time_to_loss_runs_the_arms_and_times_them_at_each_size(tmp_path, capsys):
    """A small sweep end to end (real processes of the pool): one row per arm and size, the
    data-parallel time from its time model, the JSON rows."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import sweep_time_to_loss

    out = tmp_path / "ttl.json"
    result = sweep_time_to_loss.main(["--learners", "2", "--seeds", "1", "--steps", "32", "--dp-steps", "8",
                                      "--sizes", "1e7,1e9", "--codecs", "int4", "--eval-points", "3", "--jobs", "1",
                                      "--json", str(out)])
    rows = result["rows"]
    assert {(r["arm"], r["size"]) for r in rows} == {(a, s) for a in ("data-parallel", "classic DiLoCo", "decoupled int4")
                                                     for s in (1e7, 1e9)}
    sc = Scenario(learners=2)
    for r in rows:
        if r["arm"] == "data-parallel":
            assert r["time_s"] == pytest.approx(8 * dp_step_s(sc, r["size"]))
    dec = {r["size"]: r for r in rows if r["arm"] == "decoupled int4"}
    assert dec[1e9]["run_s"] > dec[1e7]["run_s"]  # the larger model's payloads take longer
    assert "| decoupled int4 |" in result["table"] and json.loads(out.read_text())["rows"] == rows
    capsys.readouterr()
