"""Evaluate the global model: `ddiloco eval URL`, and `sync --eval-every N` in the background."""

from __future__ import annotations

import logging
import threading
from typing import Any

from ddiloco_cli.protocol import ledger, published
from ddiloco_cli.protocol.signing import Trust
from ddiloco_cli.store.base import Store
from ddiloco_cli.tasks import evaluate, load_run_task

log = logging.getLogger(__name__)


class GlobalEvaluator:
    """The run's task and one model, built once; ``__call__`` loads the newest global
    parameters into it and returns the mean validation loss per token. ``task_spec``
    overrides the task run.json names (like ``learn --task``)."""

    def __init__(self, store: Store, *, batch_size: int | None = None, max_batches: int | None = 8,
                 device: str = "cpu", task_spec: str | None = None):
        self.store = store
        self.run = ledger.read_run(store)
        self.plan = ledger.read_plan(store, run_id=self.run["run_id"])
        self.task = load_run_task(self.run, override=task_spec)  # this machine's code, checked by hash
        self.model = self.task.build_model().to(device)
        self.plan.check_model(dict(self.model.named_parameters()))
        self.batch_size = batch_size or int(self.run["inner"]["batch_size"])
        self.max_batches, self.device = max_batches, device

    def __call__(self) -> dict[str, Any]:
        """{run_id, val_loss, versions: {fragment: version}}. Raises like read_global_params
        (ProtocolError / InvalidPayloadError on bad bucket content)."""
        versions = published.load_global_model(self.store, run_id=self.run["run_id"], plan=self.plan, model=self.model,
                                               trust=Trust(self.store, run=self.run))
        loss = evaluate(self.task, self.model, batch_size=self.batch_size, max_batches=self.max_batches,
                        device=self.device)
        return {"run_id": self.run["run_id"], "val_loss": loss, "versions": versions}


def evaluate_global(store: Store, **options: Any) -> dict[str, Any]:
    """Evaluate the latest global model once (options: see GlobalEvaluator)."""
    return GlobalEvaluator(store, **options)()


class PeriodicEvaluator:
    """Evaluates the global model every ``every_versions`` merges, in a daemon thread so
    that the syncer's loop never waits for it, and logs ``global_val_loss`` to a metrics
    writer at the merge count it started from. At most one evaluation runs at a time; a
    failed one is logged and the next is tried ``every_versions`` merges later."""

    def __init__(self, store: Store, *, every_versions: int, writer, max_batches: int | None = 8):
        if every_versions < 1:
            raise ValueError("every_versions must be >= 1")
        self.store, self.every, self.writer, self.max_batches = store, every_versions, writer, max_batches
        self._evaluator: GlobalEvaluator | None = None
        self._next = every_versions
        self._thread: threading.Thread | None = None

    def on_merges(self, num_merges: int) -> None:
        if num_merges < self._next or (self._thread is not None and self._thread.is_alive()):
            return
        self._next = num_merges + self.every
        self._thread = threading.Thread(target=self._run, args=(num_merges,), name="ddiloco-eval", daemon=True)
        self._thread.start()

    def _run(self, num_merges: int) -> None:
        try:
            if self._evaluator is None:
                self._evaluator = GlobalEvaluator(self.store, max_batches=self.max_batches)
            result = self._evaluator()
        except Exception as exc:  # noqa: BLE001 - evaluation must never stop the syncer
            log.warning("evaluation after %d merges failed: %s", num_merges, exc)
            return
        log.info("global model after %d merges: val loss %.4f", num_merges, result["val_loss"])
        self.writer.log(step=num_merges, global_val_loss=result["val_loss"],
                        global_version_sum=sum(result["versions"].values()))

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join()


__all__ = ["GlobalEvaluator", "evaluate_global", "PeriodicEvaluator"]
