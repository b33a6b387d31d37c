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


def run_demo(*, workdir: str, num_learners: int = 3, duration_s: float = 150.0, kill: bool = True,
             console: Console | None = None) -> dict[str, Any]:
    console = console or Console(stderr=True)
    bucket = os.path.join(workdir, "bucket")
    logs = os.path.join(workdir, "logs")
    if os.path.exists(bucket):
        shutil.rmtree(bucket)
    os.makedirs(logs, exist_ok=True)
    torch.set_num_threads(1)
    init_args = ["init", bucket, "--task", DEMO_TASK, "-P", "4", "-H", "16", "--overlap-steps", "6", "-K", "1",
                 "--codec", "int4", "--inner-lr", "2e-3", "--warmup-steps", "20", "--lr-schedule", "constant",
                 "--total-steps", "0", "--batch-size", "16", "--lease", "6", "--heartbeat", "1"]
    subprocess.run([sys.executable, "-m", "ddiloco_cli", *init_args], check=True, capture_output=True)
    store = open_store(bucket)
    run = ledger.read_run(store)
    plan = ledger.read_plan(store, run_id=run["run_id"])
    task = load_task(run["task"])
    model = task.build_model()
    num_params = sum(p.numel() for p in model.parameters())
    trace = DemoTrace()

    def eval_global() -> float:
        published.load_global_model(store, run_id=run["run_id"], plan=plan, model=model)
        loss = evaluate(task, model, batch_size=32, max_batches=8)
        trace.global_loss.append((trace.now(), loss))
        return loss

    initial_loss = eval_global()
    procs: dict[str, subprocess.Popen] = {
        "syncer": _spawn(["sync", bucket, "--poll", "0.1", "--eval-every", "10"], os.path.join(logs, "syncer.log"))}
    names = [f"learner-{i}" for i in range(num_learners)]
    for name in names:
        procs[name] = _spawn(["learn", bucket, "--learner-id", name, "--threads", "1"], os.path.join(logs, f"{name}.log"))
    victim = names[-1] if kill and num_learners > 1 else None
    killed_at = restarted_at = None
    last_eval = time.monotonic()

    def table() -> Table:
        t = Table(title=f"ddiloco demo: {trace.now():5.0f}s / {duration_s:.0f}s   global val loss "
                        f"{trace.global_loss[-1][1]:.3f} (start {initial_loss:.3f})")
        for col in ("learner", "state", "step", "loss", "up MB", "down MB", "fragment versions"):
            t.add_column(col)
        for lid, b in sorted(beats.items()):
            alive = procs[lid].poll() is None
            vs = sorted((b.get("versions") or {}).values())
            t.add_row(lid, "alive" if alive else "[red]killed[/]", str(b["step"]),
                      f"{b['loss']:.3f}" if b.get("loss") is not None else "-",
                      f"{b.get('bytes_up', 0) / 1e6:.2f}", f"{b.get('bytes_down', 0) / 1e6:.2f}",
                      f"{vs[0]}..{vs[-1]}" if vs else "-")
        return t

    beats: dict[str, dict[str, Any]] = {}
    try:
        with Live(table(), console=console, refresh_per_second=2, transient=False) as live:
            while trace.now() < duration_s:
                time.sleep(1.0)
                beats = _learner_beats(store)
                for lid, b in beats.items():
                    fresh = b["age_s"] < 3 * float(run["heartbeat_s"]) and b["state"] == "running"
                    if b.get("loss") is not None and fresh and procs[lid].poll() is None:
                        trace.learner_loss.setdefault(lid, []).append((trace.now(), float(b["loss"])))
                    elif lid in trace.learner_loss:  # a gap in the plot while it is gone
                        trace.learner_loss[lid].append((trace.now(), float("nan")))
                if victim and killed_at is None and trace.now() > duration_s / 2:
                    procs[victim].send_signal(signal.SIGKILL)
                    procs[victim].wait()
                    killed_at = trace.now()
                    trace.events.append((killed_at, f"kill -9 {victim}"))
                if victim and killed_at is not None and restarted_at is None and trace.now() > killed_at + 10:
                    procs[victim] = _spawn(["learn", bucket, "--learner-id", victim, "--threads", "1"],
                                           os.path.join(logs, f"{victim}.log"))
                    restarted_at = trace.now()
                    trace.events.append((restarted_at, f"restart {victim}"))
                if time.monotonic() - last_eval > 15:
                    eval_global()
                    last_eval = time.monotonic()
                live.update(table())
    finally:
        for name, proc in procs.items():
            if proc.poll() is None and name != "syncer":
                proc.send_signal(signal.SIGTERM)
        for name, proc in procs.items():
            if name != "syncer":
                _wait(proc)
        time.sleep(2.0)  # let the syncer merge the last contributions
        procs["syncer"].send_signal(signal.SIGTERM)
        _wait(procs["syncer"])
    final_loss = eval_global()
    beats = _learner_beats(store)
    summary = _summary(run, beats, num_params=num_params, initial_loss=initial_loss, final_loss=final_loss,
                       wall_s=trace.now(), num_learners=num_learners, victims={victim} if killed_at else set())
    plot_path = os.path.join(workdir, "loss.png")
    plot_trace(trace, plot_path, title="ddiloco demo: Decoupled DiLoCo on Shakespeare")
    summary["plot"] = plot_path
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    _print_summary(console, summary)
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
