"""The metrics writer and reader on every store backend (local, memory, S3 on the moto
server, GCS on fake-gcs-server). The other metrics tests are in tests/unit/test_metrics.py."""

from __future__ import annotations

import pytest

from ddiloco_cli.ops.metrics import MetricsWriter, read_metrics


def test_writer_round_trips_on_every_backend(store):
    w = MetricsWriter(store, role="learner", writer_id="a", flush_every_s=3600).start()
    for step in range(1, 6):
        w.log(step=step * 10, loss=5.0 / step, tokens=step * 100, note="x")
    w.close()
    recs = read_metrics(store)
    assert [r.step for r in recs] == [10, 20, 30, 40, 50]
    assert {(r.role, r.writer_id) for r in recs} == {("learner", "a")}
    assert recs[0].fields["event"] == "start" and "event" not in recs[1].fields
    assert recs[2].fields["loss"] == pytest.approx(5.0 / 3, rel=1e-5)
    assert abs(recs[0].t - store.now()) < 600, "t is on the store's clock"
