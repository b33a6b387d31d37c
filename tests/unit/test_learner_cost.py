"""A learner measures what ddiloco itself costs its steps (issue 27: the learner's cost as a user
sees it) and reports it in its heartbeat; `status` shows it as a share of the step."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from ddiloco_cli import DiLoCoSync
from ddiloco_cli.learner.stats import CostMeter, threads_cpu_s
from ddiloco_cli.ops.runinit import RunSpec, init_run
from ddiloco_cli.protocol import records
from ddiloco_cli.store import open_store
from ddiloco_cli.tasks import load_task

if not hasattr(time, "pthread_getcpuclockid"):
    pytest.skip("no per-thread CPU clocks on this platform", allow_module_level=True)

TINY = "ddiloco_cli.tasks.gpt:tiny"


class Burner(threading.Thread):
    """A thread that, once told to go, spends ``cpu_s`` more of its own CPU time, then waits
    until released."""

    def __init__(self, cpu_s: float):
        super().__init__(daemon=True)
        self.cpu_s, self.go, self.burnt, self.release = cpu_s, threading.Event(), threading.Event(), threading.Event()

    def run(self) -> None:
        self.go.wait(60)
        until = time.thread_time() + self.cpu_s
        while time.thread_time() < until:
            pass
        self.burnt.set()
        self.release.wait(60)


def test_the_meter_reports_the_step_time_and_the_workers_cpu_per_step_since_its_last_report():
    meter, worker = CostMeter(), Burner(0.05)
    worker.start()
    try:
        assert meter.fields(0, [worker]) == {}  # one report: nothing to divide yet
        worker.go.set()
        assert worker.burnt.wait(60)
        meter.in_step_s += 0.020
        meter.in_step_cpu_s += 0.015
        fields = meter.fields(10, [worker])
        assert fields["sync_step_ms"] == pytest.approx(2.0) and fields["sync_step_cpu_ms"] == pytest.approx(1.5)
        assert 5.0 <= fields["sync_worker_cpu_ms"] < 5.0 + 10.0  # 50 ms of CPU over 10 steps, read from its clock
        assert meter.fields(10, [worker]) == fields  # no step since: the last report again
        meter.in_step_s += 0.010
        later = meter.fields(15, [worker])
        assert later["sync_step_ms"] == pytest.approx(2.0) and later["sync_step_cpu_ms"] == 0.0
        assert later["sync_worker_cpu_ms"] < fields["sync_worker_cpu_ms"]
    finally:
        worker.release.set()
        worker.join(60)
    assert threads_cpu_s([worker, threading.Thread(target=lambda: None)]) == 0.0  # ended or never started
    meter.in_step_s += 1.0
    assert meter.fields(20, [worker]) == later  # the leaving heartbeat, its workers stopped: the last report


def test_a_learner_heartbeat_carries_its_cost_and_status_shows_it_as_a_share_of_the_step(tmp_path):
    from ddiloco_cli.cli.render import render_status
    from ddiloco_cli.ops.observe import run_status

    store = open_store(str(tmp_path / "run"))
    init_run(store, RunSpec(task=TINY, num_fragments=2, sync_every=4, overlap_steps=1, codec="int4", total_steps=0,
                            warmup_steps=0, batch_size=4))
    model = load_task(TINY).build_model()
    with DiLoCoSync(store, model, learner_id="cost") as sync:
        assert "sync_step_ms" not in sync._heartbeat_record()  # before two reports
        for _ in range(8):
            sync.step(num_tokens=1)
        sync.record_step_time(0.010)
        record = sync._heartbeat_record()
        records.validate(record, "learner_heartbeat", where="heartbeat")
        assert record["sync_step_ms"] > 0.0 and record["sync_step_cpu_ms"] > 0.0 and record["sync_worker_cpu_ms"] >= 0.0
        assert sync.cost_share == pytest.approx(
            max(record["sync_step_ms"], record["sync_step_cpu_ms"] + record["sync_worker_cpu_ms"]) / 10.0)
        sync._writer.beat()
        status = run_status(store)
    (row,) = status["learners"]
    assert row["sync_step_ms"] == record["sync_step_ms"]
    share = max(record["sync_step_ms"], record["sync_step_cpu_ms"] + record["sync_worker_cpu_ms"]) / 10.0
    assert row["sync_share"] == pytest.approx(share)
    assert f"{share:.1%}" in "".join(str(x) for x in _cells(render_status(status)))


def _cells(group) -> list:
    """Every cell of the rich tables in ``group`` (render_status's output)."""
    from rich.table import Table

    out = []
    for part in getattr(group, "renderables", [group]):
        if isinstance(part, Table):
            for column in part.columns:
                out += list(column._cells)
    return out


def test_the_share_is_the_larger_of_the_wait_and_the_cpu_and_none_without_a_report():
    from ddiloco_cli.ops.observe import _cost

    assert _cost({}, 0.5) == {"sync_step_ms": None, "sync_step_cpu_ms": None, "sync_worker_cpu_ms": None,
                              "sync_share": None}  # an older learner's heartbeat
    assert _cost({"sync_step_ms": 1.0}, 0.0)["sync_share"] is None  # no step time yet
    cpu_bound = {"sync_step_ms": 1.5, "sync_step_cpu_ms": 1.0, "sync_worker_cpu_ms": 4.0}  # one core: CPU
    assert _cost(cpu_bound, 0.5)["sync_share"] == pytest.approx(0.01)
    waiting = {"sync_step_ms": 9.0, "sync_step_cpu_ms": 1.0, "sync_worker_cpu_ms": 2.0}  # a device copy's wait
    assert _cost(waiting, 0.5)["sync_share"] == pytest.approx(0.018)


def test_status_notes_a_live_learner_whose_steps_ddiloco_takes_more_than_a_tenth_of(tmp_path):
    """A learner with short steps (a fixed cost a fragment, every H / P steps) gets a note naming
    the remedies; one under the line, or gone, does not; nor an older learner without the fields."""
    from support.built_run import build_run, write_learner_heartbeat

    from ddiloco_cli.ops.observe import run_status

    built = build_run(str(tmp_path / "run"), rounds=1)
    # step_time_s 0.5 (the helper's): 60 ms of CPU a step is 12%, 30 ms 6%
    write_learner_heartbeat(built.store, built.run, "short", sync_step_ms=5.0, sync_step_cpu_ms=2.0,
                            sync_worker_cpu_ms=58.0)
    write_learner_heartbeat(built.store, built.run, "fine", sync_step_ms=5.0, sync_step_cpu_ms=2.0,
                            sync_worker_cpu_ms=28.0)
    write_learner_heartbeat(built.store, built.run, "gone", state="left", sync_step_ms=90.0)
    status = run_status(built.store)
    rows = {r["learner_id"]: r for r in status["learners"]}
    assert rows["short"]["sync_share"] == pytest.approx(0.12) and rows["fine"]["sync_share"] == pytest.approx(0.06)
    notes = [n for n in status["notes"] if "ddiloco takes" in n]
    assert len(notes) == 1 and notes[0].startswith("learner short: ddiloco takes 12% of its steps")
    assert "--sync-every" in notes[0] and status["alerts"] == []


def test_the_progress_line_says_ddiloco_s_share_once_known(caplog):
    from ddiloco_cli.learner.progress import log_step
    from ddiloco_cli.learner.stats import LearnerStats

    stats = LearnerStats(step=10, loss=2.0, step_time_s=0.1)
    with caplog.at_level("INFO", logger="ddiloco_cli.learner"):
        log_step(10, stats, lr=1e-3, tokens_per_step=64)
        log_step(20, stats, lr=1e-3, tokens_per_step=64, ddiloco_share=0.0234)
    first, second = (r.getMessage() for r in caplog.records)
    assert "ddiloco" not in first and second.endswith("ddiloco 2.3% of a step")


def test_the_learners_metrics_records_carry_ddiloco_s_share():
    """`ddiloco metrics` / `plot` history: the learner's records have the share once known."""
    from ddiloco_cli.ops.metrics import learner_progress_hook

    logged = []

    class Writer:
        def log(self, **fields):
            logged.append({k: v for k, v in fields.items() if v is not None})

    hook = learner_progress_hook(Writer(), every_steps=10)
    base = {"loss": 2.0, "lr": 1e-3, "step_time_s": 0.1, "tokens": 640, "bytes_up": 1, "bytes_down": 2,
            "versions": {0: 1}, "blocked_s": 0.0}
    hook({**base, "step": 10, "ddiloco_share": None})
    hook({**base, "step": 20, "ddiloco_share": 0.021})
    assert "ddiloco_share" not in logged[0] and logged[1]["ddiloco_share"] == 0.021
