"""`ddiloco demo`: a real run on a local-directory bucket, end to end.

    ddiloco demo --workdir runs/demo --learners 3 --duration 150

init, one syncer and N learners as subprocesses on the built-in GPT and
Shakespeare; half-way one learner is killed with SIGKILL and restarted ten
seconds later. The demo process only observes (it reads the bucket like
`ddiloco status` does) and evaluates the global model now and then. It ends
with a summary and a PNG plot of loss over time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import torch
from rich.console import Console
from rich.live import Live
from rich.table import Table

from ddiloco_cli.ops.plot import DemoTrace, plot_trace
from ddiloco_cli.protocol import layout, ledger, published
from ddiloco_cli.store import open_store
from ddiloco_cli.tasks import evaluate, load_task

DEMO_TASK = "ddiloco_cli.tasks.gpt:tiny"


def _spawn(args: list[str], log_path: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log = open(log_path, "ab")
    return subprocess.Popen([sys.executable, "-m", "ddiloco_cli", *args], stdout=log, stderr=subprocess.STDOUT, env=env)


def _learner_beats(store) -> dict[str, dict[str, Any]]:
    beats = ledger.read_heartbeats(store, layout.LEARNER_HEARTBEAT_PREFIX, "learner_heartbeat")
    return {b.record["learner_id"]: {**b.record, "age_s": b.age_s} for b in beats}


DEMO_INIT = ["--task", DEMO_TASK, "-P", "4", "-H", "16", "--overlap-steps", "6", "-K", "1", "--codec", "int4",
             "--inner-lr", "2e-3", "--warmup-steps", "20", "--lr-schedule", "constant", "--total-steps", "0",
             "--batch-size", "16", "--lease", "6", "--heartbeat", "1"]


def run_demo(*, workdir: str, num_learners: int = 3, duration_s: float = 150.0, kill: bool = True,
             console: Console | None = None) -> dict[str, Any]:
    console = console or Console(stderr=True)
    demo = _Demo(workdir, num_learners=num_learners, duration_s=duration_s, kill=kill)
    demo.start()
    try:
        with Live(demo.table(), console=console, refresh_per_second=2, transient=False) as live:
            while demo.trace.now() < duration_s:
                time.sleep(1.0)
                demo.tick()
                live.update(demo.table())
    finally:
        demo.stop()
    summary = demo.finish()
    _print_summary(console, summary)
    return summary


class _Demo:
    """One demo run: its bucket, processes, trace and the victim's kill and restart."""

    def __init__(self, workdir: str, *, num_learners: int, duration_s: float, kill: bool):
        self.workdir, self.num_learners, self.duration_s = workdir, num_learners, duration_s
        self.bucket, self.logs = os.path.join(workdir, "bucket"), os.path.join(workdir, "logs")
        if os.path.exists(self.bucket):
            shutil.rmtree(self.bucket)
        os.makedirs(self.logs, exist_ok=True)
        torch.set_num_threads(1)
        subprocess.run([sys.executable, "-m", "ddiloco_cli", "init", self.bucket, *DEMO_INIT], check=True,
                       capture_output=True)
        self.store = open_store(self.bucket)
        self.run = ledger.read_run(self.store)
        self.plan = ledger.read_plan(self.store, run_id=self.run["run_id"])
        self.task = load_task(self.run["task"])
        self.model = self.task.build_model()
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.trace = DemoTrace()
        self.initial_loss = self.eval_global()
        self.names = [f"learner-{i}" for i in range(num_learners)]
        self.victim = self.names[-1] if kill and num_learners > 1 else None
        self.killed_at: float | None = None
        self.restarted_at: float | None = None
        self.last_eval = time.monotonic()
        self.procs: dict[str, subprocess.Popen] = {}
        self.beats: dict[str, dict[str, Any]] = {}

    def eval_global(self) -> float:
        published.load_global_model(self.store, run_id=self.run["run_id"], plan=self.plan, model=self.model)
        loss = evaluate(self.task, self.model, batch_size=32, max_batches=8)
        self.trace.global_loss.append((self.trace.now(), loss))
        return loss

    def _learn(self, name: str) -> subprocess.Popen:
        return _spawn(["learn", self.bucket, "--learner-id", name, "--threads", "1"],
                      os.path.join(self.logs, f"{name}.log"))

    def start(self) -> None:
        self.procs["syncer"] = _spawn(["sync", self.bucket, "--poll", "0.1", "--eval-every", "10"],
                                      os.path.join(self.logs, "syncer.log"))
        for name in self.names:
            self.procs[name] = self._learn(name)

    def table(self) -> Table:
        t = Table(title=f"ddiloco demo: {self.trace.now():5.0f}s / {self.duration_s:.0f}s   global val loss "
                        f"{self.trace.global_loss[-1][1]:.3f} (start {self.initial_loss:.3f})")
        for col in ("learner", "state", "step", "loss", "up MB", "down MB", "fragment versions"):
            t.add_column(col)
        for lid, b in sorted(self.beats.items()):
            alive = self.procs[lid].poll() is None
            vs = sorted((b.get("versions") or {}).values())
            t.add_row(lid, "alive" if alive else "[red]killed[/]", str(b["step"]),
                      f"{b['loss']:.3f}" if b.get("loss") is not None else "-",
                      f"{b.get('bytes_up', 0) / 1e6:.2f}", f"{b.get('bytes_down', 0) / 1e6:.2f}",
                      f"{vs[0]}..{vs[-1]}" if vs else "-")
        return t

    def tick(self) -> None:
        """One look at the bucket: the learners' losses, the victim's kill and restart, an eval."""
        trace = self.trace
        self.beats = _learner_beats(self.store)
        for lid, b in self.beats.items():
            fresh = b["age_s"] < 3 * float(self.run["heartbeat_s"]) and b["state"] == "running"
            if b.get("loss") is not None and fresh and self.procs[lid].poll() is None:
                trace.learner_loss.setdefault(lid, []).append((trace.now(), float(b["loss"])))
            elif lid in trace.learner_loss:  # a gap in the plot while it is gone
                trace.learner_loss[lid].append((trace.now(), float("nan")))
        if self.victim and self.killed_at is None and trace.now() > self.duration_s / 2:
            self.procs[self.victim].send_signal(signal.SIGKILL)
            self.procs[self.victim].wait()
            self.killed_at = trace.now()
            trace.events.append((self.killed_at, f"kill -9 {self.victim}"))
        if self.victim and self.killed_at is not None and self.restarted_at is None and trace.now() > self.killed_at + 10:
            self.procs[self.victim] = self._learn(self.victim)
            self.restarted_at = trace.now()
            trace.events.append((self.restarted_at, f"restart {self.victim}"))
        if time.monotonic() - self.last_eval > 15:
            self.eval_global()
            self.last_eval = time.monotonic()

    def stop(self) -> None:
        """The learners stopped (SIGTERM), then the syncer once it merged their last contributions."""
        learners = {name: proc for name, proc in self.procs.items() if name != "syncer"}
        for proc in learners.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in learners.values():
            _wait(proc)
        time.sleep(2.0)  # let the syncer merge the last contributions
        self.procs["syncer"].send_signal(signal.SIGTERM)
        _wait(self.procs["syncer"])

    def finish(self) -> dict[str, Any]:
        """The final eval, the summary (also in summary.json) and the plot."""
        final_loss = self.eval_global()
        beats = _learner_beats(self.store)
        summary = _summary(self.run, beats, num_params=self.num_params, initial_loss=self.initial_loss,
                           final_loss=final_loss, wall_s=self.trace.now(), num_learners=self.num_learners,
                           victims={self.victim} if self.killed_at else set())
        plot_path = os.path.join(self.workdir, "loss.png")
        plot_trace(self.trace, plot_path, title="ddiloco demo: Decoupled DiLoCo on Shakespeare")
        summary["plot"] = plot_path
        with open(os.path.join(self.workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        return summary


def _wait(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _summary(run: dict[str, Any], beats: dict[str, dict[str, Any]], *, num_params: int, initial_loss: float,
             final_loss: float, wall_s: float, num_learners: int, victims: set[str]) -> dict[str, Any]:
    steps = sum(b["step"] for b in beats.values())
    tokens = sum(b["tokens"] for b in beats.values())
    moved = sum(b.get("bytes_up", 0) + b.get("bytes_down", 0) for b in beats.values())
    # data-parallel equivalent: a ring all-reduce of fp32 gradients sends and receives ~2x the model per step
    dp_bytes = 2 * 4 * num_params * steps
    # goodput: tokens trained over what every learner would have trained without the kill,
    # estimated by the learners that were never killed (restart start-up time counts as lost)
    spared = [b["tokens"] for lid, b in beats.items() if lid not in victims]
    goodput = tokens / (num_learners * (sum(spared) / len(spared))) if spared else 1.0
    return {
        "run_id": run["run_id"], "num_params": num_params, "num_learners": num_learners,
        "val_loss_start": initial_loss, "val_loss_end": final_loss, "inner_steps": steps, "tokens": tokens,
        "bytes_moved": moved, "bytes_data_parallel": dp_bytes, "ratio_vs_data_parallel": dp_bytes / max(moved, 1),
        "goodput": goodput, "wall_s": wall_s,
    }


def _print_summary(console: Console, s: dict[str, Any]) -> None:
    console.print(f"[bold]validation loss of the global model[/]: {s['val_loss_start']:.3f} -> {s['val_loss_end']:.3f}")
    console.print(f"inner steps {s['inner_steps']:,} ({s['tokens']:,} tokens) across {s['num_learners']} learners "
                  f"in {s['wall_s']:.0f}s; goodput {s['goodput']:.1%}")
    console.print(f"bytes moved {s['bytes_moved'] / 1e6:.1f} MB vs data-parallel equivalent "
                  f"{s['bytes_data_parallel'] / 1e6:.1f} MB ({s['ratio_vs_data_parallel']:.0f}x less)")
    console.print(f"plot: {s['plot']}")
