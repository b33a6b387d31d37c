"""Loss pictures: learners' training loss, the global model's validation loss and events
over time, as a PNG (matplotlib, optional: `pip install 'ddiloco[plot]'`). The demo draws
its trace here, and `ddiloco plot` draws a run's metrics history. No Rich, no torch."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ddiloco_cli.errors import DdilocoError, UsageError
from ddiloco_cli.ops.metrics import Record, read_metrics
from ddiloco_cli.ops.metrics_files import check_output_path, make_parent
from ddiloco_cli.protocol import layout, ledger
from ddiloco_cli.store.base import Store


@dataclass
class DemoTrace:
    t0: float = field(default_factory=time.monotonic)
    learner_loss: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    global_loss: list[tuple[float, float]] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0


def plot_trace(trace: DemoTrace, path: str, *, title: str) -> bool:
    """Draw learners' training loss, the global model's validation loss and the events
    over time into a PNG at path (used by the demo and `ddiloco plot`). Returns False,
    drawing nothing, when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for lid, pts in sorted(trace.learner_loss.items()):
        ax.plot([t for t, _ in pts], [v for _, v in pts], lw=1, alpha=0.8, label=f"{lid} (train)")
    ax.plot([t for t, _ in trace.global_loss], [v for _, v in trace.global_loss], "k-o", lw=2, label="global model (val)")
    for t, what in trace.events:
        ax.axvline(t, color="red", ls="--", lw=0.8)
        ax.text(t, ax.get_ylim()[1], what, rotation=90, va="top", ha="right", fontsize=7, color="red")
    ax.set_xlabel("seconds")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_run(store: Store, out_path: str) -> dict[str, Any]:
    """Draw the demo's loss picture from a run's metrics history: every learner's training
    loss (a gap while it was gone, a red line where it restarted) and the global model's
    validation loss (from `sync --eval-every`), over seconds since the first record.
    Returns {records, learners, global_points, path}. Raises UsageError when there is
    nothing to draw or matplotlib is missing."""
    check_output_path(out_path)
    records = [r for r in read_metrics(store) if "loss" in r.fields or "global_val_loss" in r.fields]
    if not records:
        raise UsageError(f"no loss records under {store.url}/{layout.METRICS_PREFIX} to plot "
                         "(learners write them while training; `sync --eval-every N` adds the global val loss)")
    t0 = min(r.t for r in records)
    trace = DemoTrace(t0=0.0)
    by_learner: dict[str, list[Record]] = {}
    for r in records:
        if r.role == "learner" and "loss" in r.fields:
            by_learner.setdefault(r.writer_id, []).append(r)
        elif "global_val_loss" in r.fields:
            trace.global_loss.append((r.t - t0, float(r.fields["global_val_loss"])))
    trace.global_loss.sort()
    for lid, rs in sorted(by_learner.items()):
        rs.sort(key=lambda r: r.t)
        pts = trace.learner_loss[lid] = []
        for prev, r in zip([None, *rs], rs):
            if prev is not None and r.fields.get("event") == "start":
                pts.append((r.t - t0, float("nan")))  # a gap while it was gone
                trace.events.append((r.t - t0, f"restart {lid}"))
            pts.append((r.t - t0, float(r.fields["loss"])))
    make_parent(out_path)
    try:
        run_id = ledger.read_run(store)["run_id"]
    except DdilocoError:
        run_id = "?"
    if not plot_trace(trace, out_path, title=f"ddiloco run {run_id}: training loss and global validation loss"):
        raise UsageError("plotting needs matplotlib: pip install 'ddiloco[plot]'")
    return {"records": len(records), "learners": len(by_learner), "global_points": len(trace.global_loss),
            "path": out_path}
