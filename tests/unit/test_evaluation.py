"""`ddiloco eval` and the syncer's background evaluation (`sync --eval-every`)."""

from __future__ import annotations

import json
import logging

import pytest

from ddiloco_cli.ops.evaluation import GlobalEvaluator, PeriodicEvaluator, evaluate_global
from ddiloco_cli.protocol import published
from ddiloco_cli.store import open_store
from ddiloco_cli.tasks import evaluate, load_task

from support.built_run import build_run, invoke


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_run(str(tmp_path_factory.mktemp("eval") / "run"), rounds=2)


def test_eval_is_the_global_models_validation_loss(built):
    task = load_task(built.run["task"])
    model = task.build_model()
    versions = published.load_global_model(built.store, run_id=built.run["run_id"], plan=built.plan, model=model)
    want = evaluate(task, model, batch_size=16, max_batches=3)
    result = invoke("eval", built.url, "--max-batches", "3", "--batch-size", "16", "--json")
    assert result.exit_code == 0, result.output
    got = json.loads(result.output)
    assert got["val_loss"] == pytest.approx(want, rel=1e-6)
    assert {int(p): v for p, v in got["versions"].items()} == versions == {0: 2, 1: 2}
    # the library call behind the command gives the same number
    assert evaluate_global(built.store, max_batches=3, batch_size=16)["val_loss"] == pytest.approx(want, rel=1e-6)


class _Recorder:
    def __init__(self):
        self.records = []

    def log(self, *, step, **fields):
        self.records.append({"step": step, **fields})


def test_periodic_evaluation_runs_every_n_merges_off_the_loop(built):
    writer = _Recorder()
    evaluator = PeriodicEvaluator(built.store, every_versions=3, writer=writer, max_batches=2)
    for merges in range(0, 8):  # what the syncer's progress hook reports, merge by merge
        evaluator.on_merges(merges)
        evaluator.close()  # let each evaluation finish before the next count (the syncer never waits)
    assert [r["step"] for r in writer.records] == [3, 6]
    assert all(r["global_val_loss"] > 0 and r["global_version_sum"] == 4 for r in writer.records)


def test_a_failed_evaluation_is_logged_and_the_syncer_goes_on(tmp_path, caplog):
    store = open_store(str(tmp_path / "no-run"))
    writer = _Recorder()
    evaluator = PeriodicEvaluator(store, every_versions=1, writer=writer)
    with caplog.at_level(logging.WARNING):
        evaluator.on_merges(1)
        evaluator.close()
    assert writer.records == [] and "evaluation after 1 merges failed" in caplog.text


def test_the_evaluator_refuses_a_task_whose_code_differs(built, monkeypatch):
    from ddiloco_cli.errors import UsageError

    run = dict(built.run, task_sha256="0" * 64)  # run.json as a machine with other task code wrote it
    monkeypatch.setattr("ddiloco_cli.ops.evaluation.ledger.read_run", lambda store: run)
    with pytest.raises(UsageError, match="differs from the run's"):
        GlobalEvaluator(built.store)
