"""Metrics history: rolling bounded segments, an untrusted-input reader, exports and loggers
(the writer on every backend: tests/integration/test_metrics_backends.py)."""

from __future__ import annotations

import csv
import json
import logging
import math
import os

import pytest

from ddiloco_cli.errors import UsageError
from ddiloco_cli.ops import metrics
from ddiloco_cli.ops.metrics import MetricsWriter, Record, read_metrics
from ddiloco_cli.protocol import layout
from ddiloco_cli.store import open_store


def _keys(store, prefix=layout.METRICS_PREFIX):
    return [i.key for i in store.list(prefix)]


def test_segments_roll_and_at_most_max_segments_are_kept_across_restarts_H3(store_url):
    store = open_store(store_url("memory"))
    w = MetricsWriter(store, role="learner", writer_id="a", records_per_segment=3, max_segments=2, flush_every_s=3600)
    for step in range(10):
        w.log(step=step, loss=1.0)
    w.close()
    keys = _keys(store)
    assert [layout.parse_metrics_key(k)[2] for k in keys] == [2, 3], keys  # 4 segments written, oldest 2 gone
    assert [r.step for r in read_metrics(store)] == [6, 7, 8, 9]

    # a restart under the same id continues after the last segment and stays within the bound
    w2 = MetricsWriter(store, role="learner", writer_id="a", records_per_segment=3, max_segments=2, flush_every_s=3600)
    w2.log(step=100, loss=0.5)
    w2.close()
    assert [layout.parse_metrics_key(k)[2] for k in _keys(store)] == [3, 4]
    recs = read_metrics(store)
    assert [r.step for r in recs] == [9, 100]
    assert recs[-1].fields["event"] == "start", "a new session marks its first record"


def test_segment_byte_bound_H3(store_url):
    store = open_store(store_url("memory"))
    w = MetricsWriter(store, role="syncer", writer_id="s", segment_bytes=400, max_segments=100, flush_every_s=3600)
    for step in range(40):
        w.log(step=step, merges=step, grace_s=0.25)
    w.close()
    sizes = [i.size for i in store.list(layout.METRICS_PREFIX)]
    assert len(sizes) > 1 and max(sizes) <= 400
    assert [r.step for r in read_metrics(store)] == list(range(40))


def test_two_processes_under_one_id_never_overwrite_each_other_H1(store_url):
    store = open_store(store_url("memory"))
    w1 = MetricsWriter(store, role="learner", writer_id="a", flush_every_s=3600)
    w2 = MetricsWriter(store, role="learner", writer_id="a", flush_every_s=3600)
    w1.log(step=1, loss=1.0)
    w2.log(step=2, loss=2.0)
    w1.flush()
    w2.flush()  # listed before w1's segment? both still pick their own names
    w1.log(step=3, loss=3.0)
    w1.close()
    w2.close()
    assert sorted(r.step for r in read_metrics(store)) == [1, 2, 3]
    assert all(layout.parse_metrics_key(k) for k in _keys(store))


class _FlakyStore:
    """Wraps a store; every call fails while ``down`` is set (an outage)."""

    def __init__(self, inner):
        self.inner, self.down, self.url = inner, True, inner.url

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def call(*args, **kwargs):
            if self.down:
                raise OSError("bucket unreachable")
            return fn(*args, **kwargs)

        return call


def test_log_never_touches_the_bucket_and_an_outage_loses_nothing(store_url, caplog):
    inner = open_store(store_url("memory"))
    flaky = _FlakyStore(inner)
    w = MetricsWriter(flaky, role="learner", writer_id="a", flush_every_s=3600)
    for step in range(3):
        w.log(step=step, loss=1.0)  # would raise if log() did I/O during the outage
    with caplog.at_level(logging.WARNING):
        w.flush()
    assert "will retry" in caplog.text and _keys(inner) == []
    w.log(step=3, loss=1.0)
    flaky.down = False
    w.close()
    assert [r.step for r in read_metrics(inner)] == [0, 1, 2, 3]


def test_reader_skips_hostile_segments_and_lines_H2(store_url, caplog):
    store = open_store(store_url("memory"))
    good = b'{"step":1,"t":10.5,"loss":2.0,"event":"start"}\n'
    bad_lines = [
        b"not json",
        b'{"step":2,"t":11,"loss":NaN}',
        b'{"step":3,"t":12,"loss":[1,2]}',
        b'{"step":4,"t":13,"loss":true}',
        b'{"step":5,"t":14,"x":"' + b"y" * 500 + b'"}',
        b'{"step":"6","t":15}',
        b'{"t":16}',
        b'{"step":7,"t":17,"bad key":1}',
        b"[" * 3000 + b"]" * 3000,
        b'{"step":8,"t":18,"s":"' + b"z" * 5000 + b'"}',
        b"\xff\xfe",
    ]
    key_a, key_big = (layout.metrics_segment_key("learner", w, 0, "0123abcd") for w in ("a", "big"))
    store.put(key_a, good + b"\n".join(bad_lines) + b"\n" + good)
    store.put(key_big, b"{}\n" * (metrics.MAX_SEGMENT_BYTES // 3 + 1))
    store.put("metrics/learner/a/evil.jsonl", good)
    store.put("metrics/other/a/00000000000000000000-0123abcd.jsonl", good)
    with caplog.at_level(logging.WARNING):
        recs = read_metrics(store)
    assert [(r.writer_id, r.step) for r in recs] == [("a", 1), ("a", 1)]
    text = caplog.text
    assert f"{key_a}: {len(bad_lines)} malformed line(s) skipped (first: line 2)" in text
    assert key_big in text and "limit" in text
    assert "metrics/learner/a/evil.jsonl is not a metrics segment name" in text


def test_versions_behind_joins_learners_with_syncers():
    recs = [Record("syncer", "s", {"t": 1.0, "step": 1, "version_sum": 10}),
            Record("learner", "a", {"t": 2.0, "step": 5, "version_sum": 6, "version_count": 2}),
            Record("syncer", "s", {"t": 3.0, "step": 2, "version_sum": 20}),
            Record("learner", "a", {"t": 4.0, "step": 9, "version_sum": 20, "version_count": 2}),
            Record("learner", "b", {"t": 0.5, "step": 1, "version_sum": 0, "version_count": 2})]
    metrics.add_versions_behind(recs)
    assert recs[1].fields["versions_behind"] == 2.0  # (10 - 6) / 2 fragments
    assert recs[3].fields["versions_behind"] == 0.0
    assert "versions_behind" not in recs[4].fields  # no syncer record yet


def test_csv_export(tmp_path, store_url):
    store = open_store(store_url("memory"))
    w = MetricsWriter(store, role="learner", writer_id="a", flush_every_s=3600)
    w.log(step=10, loss=3.5, tokens_per_s=100.0)
    w.close()
    w = MetricsWriter(store, role="syncer", writer_id="s", flush_every_s=3600)
    w.log(step=1, merges=1, quorum_max=2)
    w.close()
    out = tmp_path / "deep" / "m.csv"
    assert metrics.write_csv(read_metrics(store), str(out)) == 2
    rows = list(csv.DictReader(open(out)))
    assert [(r["role"], r["writer_id"], r["step"]) for r in rows] == [("learner", "a", "10"), ("syncer", "s", "1")]
    assert rows[0]["loss"] == "3.5" and rows[0]["merges"] == "" and rows[1]["quorum_max"] == "2"
    with pytest.raises(UsageError, match="is a directory"):
        metrics.write_csv([], str(tmp_path))
    monkeypatch_cwd = tmp_path / "cwd"
    monkeypatch_cwd.mkdir()
    os.chdir(monkeypatch_cwd)  # a file named "-" would land here
    try:
        from support.built_run import invoke

        r = invoke("metrics", store.url, "--csv", "-")
    finally:
        os.chdir(tmp_path)
    assert r.exit_code == 0, r.output
    assert list(csv.DictReader(r.stdout.splitlines()))[1]["quorum_max"] == "2"
    assert not (monkeypatch_cwd / "-").exists() and "wrote 2 records to stdout" in r.stderr


def test_wandb_project_comes_from_the_flag_or_the_environment(monkeypatch):
    from ddiloco_cli.ops.metric_loggers import wandb_project

    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    assert wandb_project() == "ddiloco"
    monkeypatch.setenv("WANDB_PROJECT", "mine")
    assert wandb_project() == "mine"
    from support.built_run import invoke

    monkeypatch.delenv("WANDB_PROJECT")
    r = invoke("learn", "memory://nothing-here", "--learner-id", "a", "--wandb-project", "flagged")
    assert r.exit_code == 3 and os.environ.get("WANDB_PROJECT") == "flagged", r.output


def test_tensorboard_export_is_readable_by_tensorboard(tmp_path, store_url):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store = open_store(store_url("memory"))
    w = MetricsWriter(store, role="learner", writer_id="a", flush_every_s=3600)
    for step in (10, 20, 30):
        w.log(step=step, loss=4.0 - step / 10)
    w.close()
    n = metrics.write_tensorboard(read_metrics(store), str(tmp_path / "tb"))
    assert n == 3
    acc = EventAccumulator(str(tmp_path / "tb" / "learner" / "a"))
    acc.Reload()
    assert [(e.step, round(e.value, 5)) for e in acc.Scalars("loss")] == [(10, 3.0), (20, 2.0), (30, 1.0)]


def test_log_with_tensorboard_forwards_from_the_flusher(tmp_path, store_url):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store = open_store(store_url("memory"))
    logger = metrics.make_logger("tensorboard", run_id="r", role="learner", writer_id="a", log_dir=str(tmp_path))
    w = MetricsWriter(store, role="learner", writer_id="a", flush_every_s=3600, loggers=[logger])
    w.log(step=1, loss=2.5, note="text is not a scalar")
    w.close()
    acc = EventAccumulator(str(tmp_path / "learner" / "a"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["loss"]
    assert acc.Scalars("loss")[0].value == 2.5


def test_unknown_logger_is_a_usage_error():
    with pytest.raises(UsageError, match="choose one of tensorboard, wandb, mlflow"):
        metrics.make_logger("neptune", run_id="r", role="learner", writer_id="a", log_dir=".")


@pytest.mark.parametrize("line", [b'{"step":1,"t":2}', b'{"step":1,"t":2.5,"a.b_c":-1e300,"s":""}'])
def test_parse_line_accepts_flat_records(line):
    rec = metrics.parse_line(line)
    assert rec is not None and rec["step"] == 1 and all(not isinstance(v, float) or math.isfinite(v) for v in rec.values())


def test_writer_id_from_free_text():
    assert metrics.writer_id_from("fragments-0,2,4") == "fragments-0-2-4"
    assert metrics.writer_id_from("host/with spaces:1") == "host-with-spaces-1"
    assert layout.valid_learner_id(metrics.writer_id_from("é" * 100))
    assert json.dumps(metrics.writer_id_from("x" * 100)).count("x") == 64


def test_reader_bounds_the_read_even_when_the_listing_understates_the_size_H2(store_url, caplog):
    from ddiloco_cli.store.base import ObjectInfo

    store = open_store(store_url("memory"))
    key = layout.metrics_segment_key("learner", "a", 0, "0123abcd")
    store.put(key, b'{"step":1,"t":1}\n' * (metrics.MAX_SEGMENT_BYTES // 16 + 1))

    class Understating:  # the object grew between the LIST and the GET
        url = store.url

        def list(self, prefix=""):
            return [ObjectInfo(i.key, 10, i.mtime_s) for i in store.list(prefix)]

        def get(self, key, *, max_bytes=None):
            return store.get(key, max_bytes=max_bytes)

    with caplog.at_level(logging.WARNING):
        assert read_metrics(Understating()) == []
    assert key in caplog.text and "bound" in caplog.text


def test_status_shows_the_newest_global_val_loss(tmp_path):
    from rich.console import Console

    from ddiloco_cli.cli.render import render_status
    from ddiloco_cli.ops.observe import run_status
    from ddiloco_cli.ops.runinit import RunSpec, init_run

    store = open_store(str(tmp_path / "run"))
    init_run(store, RunSpec())
    assert run_status(store)["global_eval"] is None
    old = MetricsWriter(store, role="syncer", writer_id="fragments-0-1", records_per_segment=1, flush_every_s=3600)
    old.log(step=5, global_val_loss=3.0)
    old.log(step=6, merges=6)  # a newer segment without an evaluation
    old.close()
    new = MetricsWriter(store, role="syncer", writer_id="fragments-2-3", flush_every_s=3600)
    new.log(step=9, global_val_loss=2.5)
    new.close()
    status = run_status(store)
    assert status["global_eval"]["val_loss"] == 2.5 and status["global_eval"]["step"] == 9
    console = Console(width=200, record=True)
    console.print(render_status(status))
    assert "global val loss 2.5000" in console.export_text()


def test_log_with_mlflow_writes_a_local_run(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    logger = metrics.make_logger("mlflow", run_id="r1", role="learner", writer_id="a", log_dir=str(tmp_path))
    logger.log({"step": 10, "t": 1.0e9, "loss": 2.5, "event": "start"}, role="learner", writer_id="a")
    logger.log({"step": 20, "t": 1.0e9 + 5, "loss": 2.0}, role="learner", writer_id="a")
    logger.close()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    history = client.get_metric_history(logger.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(10, 2.5), (20, 2.0)]


def test_log_with_wandb_offline_writes_a_local_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = metrics.make_logger("wandb", run_id="r1", role="learner", writer_id="a", log_dir=str(tmp_path))
    assert os.environ["WANDB_MODE"] == "offline"
    logger.log({"step": 10, "t": 1.0e9, "loss": 2.5}, role="learner", writer_id="a")
    logger.close()
    from support.procs import wait_for

    def logged() -> bool:  # wandb's core process writes the run file (what `wandb sync` uploads)
        return any(b"loss" in f.read_bytes() and b"2.5" in f.read_bytes()
                   for f in tmp_path.glob("wandb/offline-run-*/run-*.wandb"))

    wait_for(logged, timeout_s=60, what="the loss in wandb's offline run file")
