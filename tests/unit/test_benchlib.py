"""The pieces of scripts/benchlib.py with logic of their own: failure traces, the
chaos driver's bookkeeping, goodput arithmetic, stall detection, merged tokens,
the paced task, and the data-parallel baseline's optimizer settings."""

import sys
import time

import pytest
import torch

from support import REPO

sys.path.insert(0, str(REPO / "scripts"))
import benchlib  # noqa: E402
from benchlib import Failure, Sample, failure_trace, goodput, longest_stall, merged_tokens  # noqa: E402

IDS = ["l0", "l1", "l2"]


def test_failure_trace_is_deterministic_for_a_seed():
    a = failure_trace(seed=7, learner_ids=IDS, mean_between_s=10, restart_delay_s=2, duration_s=200)
    b = failure_trace(seed=7, learner_ids=IDS, mean_between_s=10, restart_delay_s=2, duration_s=200)
    c = failure_trace(seed=8, learner_ids=IDS, mean_between_s=10, restart_delay_s=2, duration_s=200)
    assert a == b
    assert a != c
    assert len(a) > 10


def test_failure_trace_is_sorted_in_window_and_never_kills_a_down_learner():
    trace = failure_trace(seed=3, learner_ids=IDS, mean_between_s=5, restart_delay_s=4, duration_s=300)
    assert [f.t_s for f in trace] == sorted(f.t_s for f in trace)
    assert all(0 < f.t_s < 300 and f.restart_delay_s == 4 for f in trace)
    for lid in IDS:
        times = [f.t_s for f in trace if f.learner == lid]
        assert times, lid
        # the next failure comes only after the learner is back
        assert all(b - a > 4 for a, b in zip(times, times[1:]))


def test_failure_trace_rate_matches_the_mean():
    # many learners, long window: the count is close to duration / (mean + restart) per learner
    ids = [f"l{i}" for i in range(50)]
    trace = failure_trace(seed=0, learner_ids=ids, mean_between_s=20, restart_delay_s=5, duration_s=1000)
    expected = 50 * 1000 / (20 + 5)
    assert 0.9 * expected < len(trace) < 1.1 * expected


def test_failure_trace_rejects_bad_arguments():
    with pytest.raises(ValueError):
        failure_trace(seed=0, learner_ids=IDS, mean_between_s=0, restart_delay_s=1, duration_s=10)


def test_goodput_arithmetic():
    assert goodput(useful_tokens=900, elapsed_s=10, fault_free_tokens_per_s=100) == pytest.approx(0.9)
    assert goodput(useful_tokens=0, elapsed_s=10, fault_free_tokens_per_s=100) == 0
    with pytest.raises(ValueError):
        goodput(useful_tokens=1, elapsed_s=0, fault_free_tokens_per_s=1)


def S(t, v, up=1, syncer=True):
    return Sample(float(t), tuple(v), up, syncer)


def test_longest_stall_counts_only_time_with_learners_and_syncer_up():
    samples = [S(0, [0]), S(1, [1]), S(2, [2]), S(3, [2]), S(4, [2]), S(5, [2]), S(6, [3]), S(7, [4])]
    assert longest_stall(samples) == 4.0  # versions stuck at 2 from t=2 until t=6
    # the same gap while no learner is up is not a stall
    down = [S(0, [0]), S(1, [1]), S(2, [2], up=0), S(3, [2], up=0), S(4, [2], up=0), S(5, [2], up=0), S(6, [3])]
    assert longest_stall(down) == 1.0
    # nor while the syncer is down
    nosync = [S(0, [0]), S(1, [1]), S(2, [1], syncer=False), S(3, [1], syncer=False), S(4, [2])]
    assert longest_stall(nosync) == 1.0
    # a stall that lasts to the last sample still counts
    assert longest_stall([S(0, [0, 0]), S(1, [1, 0]), S(2, [1, 0]), S(9, [1, 0])]) == 8.0
    # any fragment advancing ends a stall
    assert longest_stall([S(0, [0, 0]), S(1, [0, 1]), S(2, [1, 1]), S(3, [1, 2])]) == 1.0
    assert longest_stall([]) == 0.0


def test_merged_tokens_counts_used_contributions_per_fragment_in_window():
    manifests = [
        {"created_s": 10.0, "contributions": [{"c_tokens": 100, "used": True}, {"c_tokens": 50, "used": False}]},
        {"created_s": 20.0, "contributions": [{"c_tokens": 300, "used": True}]},
        {"created_s": 30.0, "contributions": []},
    ]
    assert merged_tokens(manifests, num_fragments=2) == 200.0
    assert merged_tokens(manifests, num_fragments=2, window_s=(15.0, 40.0)) == 150.0


class FakeProc:
    def __init__(self):
        self.rc = None

    def poll(self):
        return self.rc


class FakeCluster:
    """Records kills and restarts; the driver only uses these three methods."""

    def __init__(self, ids):
        self.procs = {lid: FakeProc() for lid in ids}
        self.log = []

    def learner_running(self, lid):
        return self.procs[lid].rc is None

    def kill_learner(self, lid):
        self.procs[lid].rc = -9
        self.log.append(("kill", lid))
        return True

    def start_learner(self, lid):
        self.procs[lid] = FakeProc()
        self.log.append(("restart", lid))


def test_chaos_driver_replays_trace_in_order_and_skips_finished_learners():
    trace = [Failure(1.0, "l0", 2.0), Failure(1.5, "l1", 2.0), Failure(2.0, "l2", 1.0)]
    t0 = time.monotonic()
    driver = benchlib.ChaosDriver(trace, t0=t0)
    cluster = FakeCluster(IDS)
    cluster.procs["l2"].rc = 0  # already finished: its failure is skipped, nothing restarts it
    driver.now = lambda: now  # drive the clock by hand
    for now in (0.5, 1.2, 1.6, 2.5, 3.1, 3.6):
        driver.tick(cluster)
    assert cluster.log == [("kill", "l0"), ("kill", "l1"), ("restart", "l0"), ("restart", "l1")]
    assert driver.skipped == 1 and driver.pending_restarts() == 0


def test_paced_task_sleeps_only_in_training(monkeypatch):
    task = benchlib.paced_tiny
    model = task.build_model()
    batch = next(task.batches(shard=0, num_shards=1, seed=0, batch_size=2))
    slept = []
    monkeypatch.setattr(benchlib.time, "sleep", slept.append)
    monkeypatch.setenv(benchlib.PACE_ENV, "40")
    loss = task.loss(model, batch)
    assert torch.isfinite(loss) and slept == [0.04]
    model.eval()
    task.loss(model, batch)
    assert slept == [0.04]
    assert task.num_tokens(batch) == 2 * 64


def test_slow_env_paces_the_difference_to_the_slowdown():
    # a 1.5x slower learner of a 40 ms step sleeps 20 ms per step; 1x does not sleep
    assert benchlib.slow_env(0.04, 1.5) == {benchlib.PACE_ENV: "20.0"}
    assert benchlib.slow_env(0.04, 1.0) == {benchlib.PACE_ENV: "0.0"}


def test_data_parallel_baseline_uses_the_inner_schedule(monkeypatch):
    inner = {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1, "warmup_steps": 2, "lr_schedule": "cosine",
             "total_steps": 4, "grad_clip": 1.0, "batch_size": 2}
    task = benchlib.paced_tiny.inner
    before = benchlib.val_loss(task, task.build_model(), max_batches=1)
    lrs = []
    real_step = torch.optim.AdamW.step

    def spy(self, *a, **k):
        lrs.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    model = benchlib.train_data_parallel(task, steps=4, batch_size=4, inner=inner)
    assert lrs == [benchlib.lr_at(s, inner) for s in range(4)] and lrs[0] < lrs[1]  # warmup, then cosine
    assert benchlib.val_loss(task, model, max_batches=1) < before  # it trains


@pytest.mark.parametrize("arm", ["diloco", "lockstep", "decoupled", "mixed", "m8", "diloco8"])
def test_every_convergence_arm_makes_a_run_init_accepts(tmp_path, arm):
    """bench_convergence's init flags per arm go through the real CLI: the classic-DiLoCo
    reference must really be one fragment, no overlap, exact gradients and every learner."""
    import bench_convergence
    from typer.testing import CliRunner

    from ddiloco_cli.cli.app import app
    from ddiloco_cli.protocol.runconfig import read_run_config
    from ddiloco_cli.store import open_store

    args = bench_convergence.parse_args(["--learners", "4"])
    url = str(tmp_path / "bucket")
    result = CliRunner().invoke(app, benchlib.init_args(url, **bench_convergence.init_flags(args, arm=arm)))
    assert result.exit_code == 0, result.output
    config = read_run_config(open_store(url))
    if arm == "diloco":
        assert (config.mode, config.quorum, config.num_fragments, config.overlap_steps, config.codec) == \
            ("lockstep", 4, 1, 0, "none")
    elif arm == "diloco8":  # m8's reference: 8 learners of half the batch
        assert (config.mode, config.quorum, config.num_fragments, config.overlap_steps, config.codec,
                config.batch_size) == ("lockstep", 8, 1, 0, "none", 8)
    elif arm == "lockstep":
        assert (config.mode, config.quorum, config.codec) == ("lockstep", 4, "int4")
    else:
        assert (config.mode, config.quorum, config.merge) == ("decoupled", 1, "rda")


def test_bench_traffic_window_falls_back_to_the_whole_run_when_the_steady_one_is_empty():
    """bench_traffic: a fast learner of a short run may write no two heartbeats between
    --skip-steps and total_steps; its figures then come from the whole run, flagged, instead of
    the run failing (a loaded CI machine hit that)."""
    import bench_traffic

    def beat(t, step):
        return {"time_s": t, "step": step}

    steady = [beat(1, 2), beat(2, 10), beat(3, 20), beat(4, 30), beat(5, 48)]
    first, last, ok = bench_traffic.measured_window(steady, skip_steps=8, total_steps=48)
    assert ok and (first["step"], last["step"]) == (10, 30)
    # the first beat came after the bootstrap at step 20 and the next is the final one
    sparse = [beat(1, 20), beat(2, 24)]
    first, last, ok = bench_traffic.measured_window(sparse, skip_steps=8, total_steps=24)
    assert not ok and (first["step"], last["step"]) == (20, 24)
    with pytest.raises(RuntimeError, match="no steps"):
        bench_traffic.measured_window([beat(1, 5)], skip_steps=8, total_steps=24)
