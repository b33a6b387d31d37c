"""Learner overhead and memory: ddiloco's learner loop vs the same plain AdamW loop,
and syncer memory by the number of fragments it serves.

HEADLINE: what a user measures. Per interleaved A/B round, the ddiloco arm's steady-state wall
time per step over the plain arm's, and its all-thread CPU per step over the plain arm's; the
median of each over the rounds (>= 5 for a figure to quote); peak memory likewise. The
machinery accounting (the CPU that ddiloco's own functions spend, by thread) is the breakdown.

1. Step time. Two arms, each a fresh process with --threads torch threads (1 or 2), interleaved
   A/B/B/A/A/B/... for --reps rounds on the same task (--task ``mid``, from benchtasks: a
   ~3.2M-parameter char-level GPT, block 64, batch 8; or ``tiny``, the 0.2M one, batch 16,
   steps of a few ms, where fixed costs weigh most), same seed:
   * plain:   nanoGPT-like loop (lr, forward, backward, clip, AdamW step, loss.item());
   * ddiloco: ``Learner.train`` on a local-directory run with P = H = 24, tau 2, K 1,
     int4, with a real ``ddiloco sync`` process serving it (so versions come back and
     the receive path runs).
   Steady-state median ms/step excludes the first --skip steps of each process.
   Fairness on a 2-core machine: with 1 torch thread both learner arms are pinned to CPU 0
   (--pin), so the learner's own background threads (upload encode, receive decode, heartbeat)
   compete with its compute thread, as on a one-core learner: the worst case (with 2, to both
   CPUs). The syncer stands for a remote machine: pinned to CPU 1 at nice +10 and kept running
   for both arms. Load averages are recorded next to every figure: on a shared machine the wall
   ratio moves with whatever else runs on CPU 0; the CPU ratio much less.
   Each process also records its threads' context switches (voluntary: waits on the GIL, a
   lock or I/O; involuntary: preemptions). --wrap runs each arm under a profiler.
   --workers-cpu puts the ddiloco arm's worker threads on CPU 1 (its training thread alone on
   CPU 0: a learner with a core to spare). The headline also gives the ratio of the fastest
   tenth of the steps (a shared host's bursts only ever add time), and the breakdown the
   learner's own report of its cost (its heartbeats' fields, the `ddiloco` column of `status`)
   beside the accounting.
2. Peak memory (VmHWM) of each arm's process.
3. Syncer memory: peak RSS (getrusage of a child) of ``ddiloco sync --fragments 0``
   vs all fragments, on a 24-fragment run of a 25M-parameter model (24 Linear
   1024x1024 layers) after one merge of every served fragment from two learners;
   the import-only baseline is subtracted.

    .venv/bin/python scripts/bench_overhead.py --reps 5 --skip-syncer-memory --json /tmp/overhead.json
    .venv/bin/python scripts/bench_overhead.py --reps 5 --skip-syncer-memory --threads 2
    .venv/bin/python scripts/bench_overhead.py --reps 5 --skip-syncer-memory --task tiny --steps 600 --skip 100
    .venv/bin/python scripts/bench_overhead.py --steps 40 --skip 10 --reps 1 --syncer-width 128   # smoke
    .venv/bin/python scripts/bench_overhead.py --reps 1 --skip-syncer-memory \
        --wrap 'py-spy record --gil --native -r 250 -f raw -o /tmp/p/{arm}-{rep}.txt --'
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parent.parent
THIS = os.path.abspath(__file__)
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overheadlib import (  # noqa: E402
    headline,
    print_breakdown,
    print_headline,
    profile_threads,
    record_cost_reports,
    steady_reports,
    thread_cpu_s,
    thread_faults,
    thread_switches,
    time_functions,
)

# the plain arm imports no more of ddiloco than its task (benchtasks.py): benchlib, which brings in
# the learner, the store and their dependencies, is imported where the orchestrator needs it
from benchtasks import BENCHTASKS_PATH, big, mid, tiny  # noqa: E402

MID_TASK = f"{BENCHTASKS_PATH}:mid"
# --task NAME -> (the run's task spec, the task, batch size)
TASKS = {"mid": (MID_TASK, mid, 8), "tiny": ("ddiloco_cli.tasks.gpt:tiny", tiny, 16),
         "big": (f"{BENCHTASKS_PATH}:big", big, 32)}  # big: scripts/bench_gpu.py's
INNER_LR = 1e-3
WARMUP = 20
SEED = 0


HELPER_CPU_S: list[Callable[[], float]] = [lambda: 0.0]  # the io helper process's CPU (--io-process)


def _stamp() -> tuple[float, float, float]:
    """(wall, CPU of the whole process and of its io helper, CPU of this thread), seconds."""
    return time.perf_counter(), time.process_time() + HELPER_CPU_S[0](), time.thread_time()


def pss_kb(pid: int | str = "self") -> int:
    """Proportional set size (a page shared by n processes counts 1/n in each): what a learner
    and its forked io helper together take, without counting their shared pages twice."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def vm_hwm_kb(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


# ------------------------------------------------------------------------- workers
def _marks(marks: dict, stamps: list, *, skip: int, steps: int) -> None:
    """At the first steady-state step and at the last one: every thread's CPU and context
    switches (the steady state's figures are their differences)."""
    if len(stamps) in (skip + 1, steps + 1) and 0 < skip < steps:
        marks["skip" if len(stamps) == skip + 1 else "last"] = {"cpu": thread_cpu_s(), "switches": thread_switches(),
                                                                "faults": thread_faults(), "vm_hwm_kb": vm_hwm_kb()}


def plain_worker(steps: int, out: str, *, task: str = "mid", threads: int = 1, skip: int = 0,
                 tune: bool = False) -> None:
    """The plain loop: same task, model, optimizer, lr warmup, clip, batch and seed as
    the learner; no ddiloco import beyond the task (and, with ``tune``, the allocator's thresholds)."""
    if tune:
        from ddiloco_cli.learner import allocator

        allocator.tune()
    torch.set_num_threads(threads)
    stamps, marks = [], {}

    def on_step() -> None:  # also once before the first step
        stamps.append(_stamp())
        _marks(marks, stamps, skip=skip, steps=steps)

    numel = plain_loop(steps, task=task, on_step=on_step)
    _write(out, arm="plain", stamps=stamps, numel=numel, marks=marks)


def plain_loop(steps: int, *, task: str = "mid", on_step: Callable[[], None]) -> int:
    """The plain loop: same task, model, optimizer, lr warmup, clip, batch and seed as the
    learner; ``on_step`` once before the first step and after every step. Returns the model's
    trained parameter count."""
    torch.manual_seed(SEED)
    _, the_task, batch_size = TASKS[task]
    model = the_task.build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=INNER_LR, betas=(0.9, 0.95), weight_decay=0.1)
    batches = the_task.batches(shard=0, num_shards=1, seed=12345, batch_size=batch_size)
    on_step()
    for step in range(steps):
        lr = INNER_LR * (step + 1) / WARMUP if step < WARMUP else INNER_LR
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = next(batches)
        loss = the_task.loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        float(loss.detach())
        on_step()
    return sum(p.numel() for p in params)


def init_bench_run(url: str, task: str = "mid") -> None:
    """The learner arm's run: P = H = 24, tau 2, K 1, int4, the plain loop's lr, warmup, batch, seed."""
    from ddiloco_cli.ops.runinit import RunSpec, init_run
    from ddiloco_cli.store import open_store

    spec, _, batch_size = TASKS[task]
    init_run(open_store(url), RunSpec(task=spec, num_fragments=24, sync_every=24, overlap_steps=2, quorum=1,
                                      codec="int4", inner_lr=INNER_LR, warmup_steps=WARMUP, lr_schedule="constant",
                                      total_steps=0, batch_size=batch_size, seed=SEED))


def _timed(spent: dict, name: str, fn: Callable) -> Callable:
    """fn, adding its wall and thread CPU seconds and its calls to spent[name + "_s" / "_cpu_s" / "_calls"]."""
    def wrapped(*a, **k):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            spent[name + "_s"] += time.perf_counter() - t0
            spent[name + "_cpu_s"] += time.thread_time() - c0
            spent[name + "_calls"] += 1
    return wrapped


def _in_new_threads(setup: Callable[[], None]) -> None:
    """Run ``setup`` first in every thread started from now on (the learner's worker threads)."""
    start_run = threading.Thread.run

    def run(self) -> None:
        setup()
        start_run(self)

    threading.Thread.run = run


def nice_workers(nice: int) -> None:
    """The learner's worker threads at ``nice`` (Linux: a thread's own priority), the training
    thread at 0: an experiment, whether a worker thread that preempts the training step less
    eagerly costs it less."""
    _in_new_threads(lambda: os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice))


def pin_workers(cpu: int) -> None:
    """This thread (the training thread) on CPU 0, the learner's worker threads (uploader,
    receiver, heartbeat) on ``cpu``: the layout of a learner on a machine with a core to spare,
    the training loop's one torch thread on its own core."""
    os.sched_setaffinity(0, {0})  # 0: the calling thread (Linux)
    _in_new_threads(lambda: os.sched_setaffinity(0, {cpu}))


def ddiloco_worker(url: str, learner_id: str, steps: int, out: str, profile_dir: str | None = None,
                   timers: bool = False, skip: int = 0, task: str = "mid", threads: int = 1,
                   workers_cpu: int | None = None, workers_nice: int = 0, switch_ms: float = 0.0,
                   io_process: bool = False) -> None:
    torch.set_num_threads(threads)
    if switch_ms:
        sys.setswitchinterval(switch_ms / 1e3)
    if workers_cpu is not None:
        pin_workers(workers_cpu)
    if workers_nice:
        nice_workers(workers_nice)
    dump_profiles = profile_threads(profile_dir) if profile_dir else None
    timed_calls = time_functions() if timers else None
    calls_at_last_step: dict[str, list[float]] = {}
    from ddiloco_cli.learner import DiLoCoSync, Learner, LearnerOptions, SyncOptions
    from ddiloco_cli.store import open_store

    # main-thread time inside the loop's ddiloco call (``step``: send, i.e. gather + delta + queue,
    # and receive, i.e. take + scatter, and the bookkeeping), and in send alone, wall and CPU: one
    # timed call per step (a wrapper's clock reads cost microseconds; ``_receive``, called for every
    # fragment in flight at every step, would be timed mostly for its clocks)
    spent = {"step_s": 0.0, "send_s": 0.0, "step_cpu_s": 0.0, "send_cpu_s": 0.0, "step_calls": 0, "send_calls": 0}
    DiLoCoSync._send = _timed(spent, "send", DiLoCoSync._send)
    DiLoCoSync.step = _timed(spent, "step", DiLoCoSync.step)
    from ddiloco_cli.learner.receiver import Receiver

    receivers: list = []
    start_receiver = Receiver.start

    def start(self) -> None:  # keep the instance: its poll and download counters
        receivers.append(self)
        start_receiver(self)

    Receiver.start = start
    from ddiloco_cli.learner.ioproc import IoProcess

    helpers: list = []
    start_helper = IoProcess.start

    def start_io(self, *a, **k) -> None:  # keep the instance: its pid and CPU
        start_helper(self, *a, **k)
        helpers.append(self)
        HELPER_CPU_S[0] = lambda: self.cpu_s() or 0.0
        if workers_cpu is not None:  # its threads where the worker threads would be
            for tid in os.listdir(f"/proc/{self.pid}/task"):
                os.sched_setaffinity(int(tid), {workers_cpu})

    IoProcess.start = start_io
    reports = record_cost_reports()  # the learner's own cost reports (its heartbeats' fields), by step
    stamps, marks = [_stamp()], {}
    threads: dict[str, float] = {}
    at_last_step: dict[str, float] = {}
    threads_at_skip: dict[str, float] = {}
    at_skip: dict[str, float] = {}

    def on_progress(p: dict) -> None:
        stamps.append(_stamp())
        _marks(marks, stamps, skip=skip, steps=steps)
        if len(stamps) == skip + 1 and 0 < skip < steps:  # the steady state starts: the start-up work is behind
            threads_at_skip.update(thread_cpu_s())
            at_skip.update(spent)
        if len(stamps) == steps + 1:  # last step: the workers are still alive, the flush on close not begun
            threads.update(thread_cpu_s())
            at_last_step.update(spent)
            for r in receivers[:1]:
                at_last_step.update(polls=r.num_polls, downloads=getattr(r, "num_downloads", None),
                                    waits=getattr(r, "num_waits", None))
            at_last_step.update(pss_kb=pss_kb() + sum(pss_kb(h.pid) for h in helpers),
                                helper_vm_hwm_kb=sum(vm_hwm_kb(h.pid) for h in helpers))
            if timed_calls is not None:
                calls_at_last_step.update({k: list(v) for k, v in timed_calls.items()})

    learner = Learner(open_store(url), options=LearnerOptions(learner_id=learner_id, steps=steps, log_every=10**9,
                                                              task=TASKS[task][0],
                                                              sync=SyncOptions(io_process=io_process)),
                      on_progress=on_progress)
    reason, s = learner.train(), learner.stats
    if dump_profiles is not None:
        dump_profiles()
    _write(out, arm="ddiloco", stamps=stamps, reason=reason, blocked_s=s.blocked_s, bytes_up=s.bytes_up,
           bytes_down=s.bytes_down, num_contributions=s.num_contributions,
           num_flushed=spent["send_calls"] - at_last_step["send_calls"],
           versions_received=sum(1 for v in s.versions.values() if v > 0),
           max_version=max(s.versions.values(), default=0), thread_cpu_s=threads, timers=calls_at_last_step,
           thread_cpu_s_at_skip=threads_at_skip, at_skip=at_skip, marks=marks,
           # the heartbeats' reports of the steady state (written after step `skip`, up to the last step)
           cost_reports=steady_reports(reports, skip=skip, steps=steps), **at_last_step)


def _write(out: str, **rec) -> None:
    rec["vm_hwm_kb"] = vm_hwm_kb()
    rec.setdefault("pss_kb", pss_kb())  # the plain loop's at its end; the learner's (and helper's) at its last step
    with open(out, "w") as f:
        json.dump(rec, f)


# --------------------------------------------------------------------- orchestrator
def _env(threads: int = 1) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}


def _prefix(cpu: int | str | None, nice: int = 0) -> list[str]:
    pre = []
    if nice:
        pre += ["nice", "-n", str(nice)]
    if cpu is not None:
        pre += ["taskset", "-c", str(cpu)]
    return pre


def run_arm(arm: str, *, url: str, rep: int, steps: int, skip: int, workdir: str, cpu: int | str | None,
            profile_dir: str | None = None, timers: bool = False, task: str = "mid", threads: int = 1,
            wrap: str | None = None, tune_plain: bool = False, workers_cpu: int | None = None,
            workers_nice: int = 0, switch_ms: float = 0.0, io_process: bool = False) -> dict:
    out = os.path.join(workdir, f"{arm}-{rep}.json")
    # --wrap: a profiler's command line before the worker's (``{arm}``, ``{rep}``: this process's)
    pre = shlex.split(wrap.format(arm=arm, rep=rep)) if wrap else []  # outside taskset: the profiler unpinned
    cmd = [*pre, *_prefix(cpu), sys.executable, THIS, "--worker", arm, "--steps", str(steps), "--out", out,
           "--skip", str(skip), "--task", task, "--threads", str(threads)]
    if arm == "plain" and tune_plain:
        cmd += ["--tune-plain"]
    if arm == "ddiloco":
        cmd += ["--url", url, "--learner-id", f"bench-{rep}"]
        if profile_dir:
            cmd += ["--profile", os.path.join(profile_dir, f"rep{rep}")]
        if timers:
            cmd += ["--timers"]
        if workers_cpu is not None:
            cmd += ["--workers-cpu"]  # the worker threads on CPU 1
        if workers_nice:
            cmd += ["--workers-nice", str(workers_nice)]
        if switch_ms:
            cmd += ["--switch-interval", str(switch_ms)]
        if io_process:
            cmd += ["--io-process"]
    load0 = os.getloadavg()[0]
    subprocess.run(cmd, check=True, env=_env(threads), cwd=str(REPO))
    with open(out) as f:
        rec = json.load(f)
    dts, cpu, main_cpu = step_series(rec.pop("stamps"), skip)
    rec.update(rep=rep, median_ms=1e3 * statistics.median(dts), mean_ms=1e3 * statistics.fmean(dts),
               cpu_median_ms=1e3 * statistics.median(cpu), cpu_mean_ms=1e3 * statistics.fmean(cpu),
               main_cpu_median_ms=1e3 * statistics.median(main_cpu),
               p90_ms=1e3 * sorted(dts)[int(0.9 * len(dts))], p10_ms=1e3 * sorted(dts)[int(0.1 * len(dts))],
               step_ms=[round(1e3 * x, 3) for x in dts], steps_measured=len(dts), **_steady_switches(rec, steps - skip),
               load_before=load0, load_after=os.getloadavg()[0])
    print(f"  rep {rep} {arm:8s} median {rec['median_ms']:7.1f} ms/step  p90 {rec['p90_ms']:7.1f}  "
          f"cpu {rec['cpu_mean_ms']:7.1f} (main {rec['main_cpu_median_ms']:6.1f})  VmHWM {rec['vm_hwm_kb'] / 1024:6.0f} MB  load {load0:.2f}->{rec['load_after']:.2f}", flush=True)
    return rec


def step_series(stamps: list, skip: int) -> tuple[list[float], list[float], list[float]]:
    """Per steady-state step (the first ``skip`` left out) of a worker's stamps (wall, process
    CPU, training-thread CPU): wall seconds, process CPU seconds, training-thread CPU seconds."""
    steps = list(zip(stamps, stamps[1:]))[skip:]
    return tuple([b[i] - a[i] for a, b in steps] for i in range(3))  # type: ignore[return-value]


def _steady_switches(rec: dict, n: int) -> dict[str, float]:
    """Per steady-state step: the main thread's voluntary (waits: the GIL, I/O) and involuntary
    (preempted) context switches, and every thread's together."""
    marks = rec.get("marks") or {}
    if "skip" not in marks or "last" not in marks:
        return {}
    a, b = marks["skip"]["switches"], marks["last"]["switches"]
    diff = {k: [b[k][i] - a.get(k, [0, 0])[i] for i in (0, 1)] for k in b}
    main = diff.get("MainThread", [0, 0])
    out = {"main_voluntary_switches": main[0] / n, "main_involuntary_switches": main[1] / n,
           "all_switches": sum(v[0] + v[1] for v in diff.values()) / n}
    if "faults" in marks["skip"]:
        fa, fb = marks["skip"]["faults"], marks["last"]["faults"]
        faults = {k: fb[k] - fa.get(k, 0) for k in fb}
        out.update(main_minor_faults=faults.get("MainThread", 0) / n, all_minor_faults=sum(faults.values()) / n)
    return out


def step_time_comparison(args, workdir: str) -> dict:
    url = os.path.join(workdir, "run")
    init_bench_run(url, args.task)
    # the learners on CPU 0 (both CPUs with 2 torch threads), the syncer on CPU 1 at nice +10
    cpu_l, cpu_s = (("0" if args.threads == 1 else "0,1"), 1) if args.pin else (None, None)
    workers_cpu = 1 if args.pin and args.workers_cpu else None  # --workers-cpu: the worker threads on CPU 1
    import benchlib  # noqa: PLC0415 - the orchestrator's (see the imports)

    launcher = benchlib.Launcher(workdir, env=_env(), cwd=str(REPO))
    syncer = launcher.start("syncer", "sync", url, prefix=tuple(_prefix(cpu_s, nice=10)))
    records = []
    try:
        for rep in range(args.reps):
            order = ("plain", "ddiloco") if rep % 2 == 0 else ("ddiloco", "plain")
            for arm in order:
                records.append(run_arm(arm, url=url, rep=rep, steps=args.steps, skip=args.skip, workdir=workdir,
                                       cpu="0,1" if workers_cpu is not None and arm == "ddiloco" else cpu_l,
                                       profile_dir=args.profile, timers=args.timers, task=args.task,
                                       threads=args.threads, wrap=args.wrap, tune_plain=args.tune_plain,
                                       workers_cpu=workers_cpu if arm == "ddiloco" else None,
                                       workers_nice=args.workers_nice, switch_ms=args.switch_interval,
                                       io_process=args.io_process))
        syncer_hwm = vm_hwm_kb(syncer.pid)
    finally:
        syncer.terminate()
        syncer.wait(timeout=60)
        launcher.close()
    plain = [r for r in records if r["arm"] == "plain"]
    dd = [r for r in records if r["arm"] == "ddiloco"]
    ratios = [d["median_ms"] / p["median_ms"] for p, d in zip(plain, dd)]  # same rep: adjacent in time
    cpu_ratios = [d["cpu_mean_ms"] / p["cpu_mean_ms"] for p, d in zip(plain, dd)]
    # the fastest tenth of each process's steps: what a neighbour's bursts on a shared host
    # (they only ever add time) leave out; every ddiloco step sends and receives (P = H)
    p10_ratios = [d["p10_ms"] / p["p10_ms"] for p, d in zip(plain, dd)]
    mem_ratios = [d["vm_hwm_kb"] / p["vm_hwm_kb"] for p, d in zip(plain, dd)]
    pss_ratios = [d["pss_kb"] / p["pss_kb"] for p, d in zip(plain, dd) if p.get("pss_kb") and d.get("pss_kb")]
    return {
        "records": records, "syncer_vm_hwm_kb": syncer_hwm,
        "plain_median_ms": statistics.median(r["median_ms"] for r in plain),
        "ddiloco_median_ms": statistics.median(r["median_ms"] for r in dd),
        "overhead_per_rep": [r - 1 for r in ratios], "overhead_median": statistics.median(ratios) - 1,
        "p10_overhead_per_rep": [r - 1 for r in p10_ratios], "p10_overhead_median": statistics.median(p10_ratios) - 1,
        "plain_cpu_ms": statistics.median(r["cpu_mean_ms"] for r in plain),
        "ddiloco_cpu_ms": statistics.median(r["cpu_mean_ms"] for r in dd),
        "cpu_overhead_per_rep": [r - 1 for r in cpu_ratios], "cpu_overhead_median": statistics.median(cpu_ratios) - 1,
        "plain_main_cpu_ms": statistics.median(r["main_cpu_median_ms"] for r in plain),
        "ddiloco_main_cpu_ms": statistics.median(r["main_cpu_median_ms"] for r in dd),
        "machinery_ms_per_step": _machinery(dd, steps=args.steps),
        "machinery_steady_ms_per_step": _machinery(dd, steps=args.steps, skip=args.skip),
        "plain_vm_hwm_kb": max(r["vm_hwm_kb"] for r in plain), "ddiloco_vm_hwm_kb": max(r["vm_hwm_kb"] for r in dd),
        "memory_ratio_per_rep": mem_ratios, "memory_ratio_median": statistics.median(mem_ratios),
        "pss_ratio_per_rep": pss_ratios, "pss_ratio_median": statistics.median(pss_ratios) if pss_ratios else None,
    }


def _machinery(dd: list[dict], *, steps: int, skip: int = 0) -> dict[str, float]:
    """ddiloco's own work per step (median over processes), in ms: main-thread time in
    ``DiLoCoSync.step`` (of it in send; the rest is receive and bookkeeping), and CPU of each
    background thread; these do not depend on the load. ``skip`` > 0: over the steady state
    only (the steps after the first ``skip``, as the step-time medians), without the
    start-up's one-off work (the first heartbeats' re-reads, first calls into cold code,
    the first write into each fragment's folder), which a run of days does not repeat."""
    since = bool(skip) and all(r.get("thread_cpu_s_at_skip") for r in dd)
    n = steps - skip if since else steps

    def spent(r: dict, key: str) -> float:
        return r[key] - (r["at_skip"][key] if since else 0.0)

    def thread(r: dict, k: str) -> float:
        return r["thread_cpu_s"][k] - (r["thread_cpu_s_at_skip"].get(k, 0.0) if since else 0.0)

    out: dict[str, float] = {}
    for key in ("step_s", "send_s", "step_cpu_s", "send_cpu_s"):
        out["main " + key.replace("_s", "").replace("_cpu", " CPU")] = 1e3 * statistics.median(spent(r, key) for r in dd) / n
    out["main receive+rest CPU"] = 1e3 * statistics.median(spent(r, "step_cpu_s") - spent(r, "send_cpu_s")
                                                           for r in dd) / n
    names = ("ddiloco-uploader", "ddiloco-receiver", "ddiloco-heartbeat")  # the uploaders: -0, -1, ... together
    for name in names:
        out[name + " CPU"] = 1e3 * statistics.median(
            sum(thread(r, k) for k in r["thread_cpu_s"] if k.startswith(name)) for r in dd) / n
    others = [sum(thread(r, k) for k in r["thread_cpu_s"] if k != "MainThread" and not k.startswith(names))
              for r in dd]
    out["other threads CPU"] = 1e3 * statistics.median(others) / n
    return out


def _peak_rss_kb(cmd: list[str], *, env: dict) -> int:
    """Peak RSS of one child process (ru_maxrss of a wrapper's only child)."""
    wrapper = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
               "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    res = subprocess.run([sys.executable, "-c", wrapper, *cmd], check=True, env=env, capture_output=True, text=True,
                         cwd=str(REPO))
    return int(res.stdout.strip().splitlines()[-1])


def syncer_memory(args, workdir: str) -> dict:
    """Peak RSS of a syncer serving fragment 0 vs all 24, each after merging two learners'
    int4 contributions into every fragment it serves."""
    from ddiloco_cli.numerics import codec
    from ddiloco_cli.ops.runinit import RunSpec, init_run
    from ddiloco_cli.protocol import layout, ledger, records
    from ddiloco_cli.protocol.published import expected_shapes
    from ddiloco_cli.store import open_store

    import benchlib  # noqa: PLC0415 - the orchestrator's (see the imports)

    size = {benchlib.STACK_WIDTH_ENV: str(args.syncer_width), benchlib.STACK_LAYERS_ENV: "24"}  # a layer a fragment
    env = {**_env(), **size}
    os.environ.update(size)
    out: dict = {"width": args.syncer_width}
    cases = {"fragment 0": ("0", 1), "fragments 0-5": ("0-5", 6), "all 24": ("all", 24)}
    for name, (spec, num) in cases.items():
        url = os.path.join(workdir, f"mem-{spec}")
        store = open_store(url)
        run = init_run(store, RunSpec(task=benchlib.STACK_TASK, num_fragments=24, sync_every=24, quorum=2, codec="int4",
                                      grace_gamma=0.0, lease_s=3600.0, heartbeat_s=1.0))
        plan = ledger.read_plan(store, run_id=run["run_id"])
        g = torch.Generator().manual_seed(0)
        for lid in ("a", "b"):
            store.put(layout.learner_heartbeat_key(lid), records.dumps(records.make(
                "learner_heartbeat", run_id=run["run_id"], learner_id=lid, state="running", step=24, tokens=384,
                step_time_s=1.0, time_s=time.time())))
            for p in range(24):
                delta = {k: 1e-3 * torch.randn(s, generator=g) for k, s in expected_shapes(plan, p).items()}
                header = records.make("contribution", run_id=run["run_id"], fragment=p, learner_id=lid, seq=1,
                                      base_version=0, c_tokens=384, c_steps=24, step=24, nonce=records.new_nonce(),
                                      created_s=time.time())
                store.put_if_absent(layout.contribution_key(p, lid, 1),
                                    codec.encode_tensors(delta, codec="int4", metadata=header))
        out["model_numel"] = sum(plan.fragment_numel(p) for p in range(24))
        cmd = [sys.executable, "-m", "ddiloco_cli", "sync", url, "--no-gc", "--poll", "0.05",
               "--max-versions", str(num), *(["--fragments", spec] if spec != "all" else [])]
        out[name] = _peak_rss_kb(cmd, env=env)
        assert all(ledger.latest_version(store, p) == 1 for p in range(num)), f"{name}: syncer did not merge"
    out["import_baseline"] = _peak_rss_kb(
        [sys.executable, "-c", "import torch, ddiloco_cli.cli.app, ddiloco_cli.syncer.core, ddiloco_cli.store.local"], env=env)
    base = out["import_baseline"]
    out["ratio_above_baseline"] = (out["fragment 0"] - base) / max(1, out["all 24"] - base)
    out["per_fragment_kb"] = (out["all 24"] - out["fragment 0"]) / 23
    out["fixed_kb"] = out["fragment 0"] - out["per_fragment_kb"]
    out["fragment_fp32_kb"] = out["model_numel"] * 4 / 24 / 1024
    return out


# --interference: what other work on the machine costs the plain training step (no ddiloco). Each
# neighbour is a process that wakes every 24 ms and runs ~1 ms of CPU (about what the learner's
# worker threads do per step of the mid GPT, in ~5 wake-ups), touching ``elems`` fp32 values per
# pass; "cpu1-busy" runs flat out. On CPU 1 it stands for the bench's syncer, on CPU 0 for the worker threads.
NEIGHBOURS = {  # name -> (cpu, elems, duty: busy ms per wake-up or None for flat out)
    "alone": None,
    "cpu1-busy": (1, 2 << 20, None),
    "cpu1-duty": (1, 1 << 17, 1.0),
    "cpu0-small": (0, 16 << 10, 1.0),
    "cpu0-large": (0, 2 << 20, 1.0),
}
_NEIGHBOUR_CODE = """import numpy as np, time
a = np.ones({elems}, dtype=np.float32); b = np.empty_like(a)
while True:
    t = time.thread_time()
    while {flat} or time.thread_time() - t < {busy_s}:
        np.multiply(a, 1.0000001, out=b)
    time.sleep(0.024)
"""


def interference(args, workdir: str) -> dict:
    """The plain loop pinned to CPU 0 beside each neighbour, ``args.reps`` rounds in turn: median
    wall and training-thread CPU per step. Tells the worker threads' CPU from what their memory
    traffic costs the training step (docs/results.md, "Learner overhead")."""
    res: dict[str, list[tuple[float, float]]] = {name: [] for name in NEIGHBOURS}
    for rep in range(args.reps):
        for name, spec in NEIGHBOURS.items():
            neighbour = None
            if spec is not None:
                cpu, elems, busy_ms = spec
                code = _NEIGHBOUR_CODE.format(elems=elems, flat=busy_ms is None, busy_s=(busy_ms or 0) / 1e3)
                neighbour = subprocess.Popen([*_prefix(cpu), sys.executable, "-c", code])
            try:
                out = os.path.join(workdir, f"interference-{name}-{rep}.json")
                subprocess.run([*_prefix(0), sys.executable, THIS, "--worker", "plain", "--steps", str(args.steps),
                                "--out", out, "--skip", str(args.skip), "--task", args.task, "--threads", "1"],
                               check=True, env=_env(1), cwd=str(REPO))
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
            with open(out) as f:
                wall, _, main_cpu = step_series(json.load(f)["stamps"], args.skip)
            res[name].append((1e3 * statistics.median(wall), 1e3 * statistics.median(main_cpu)))
            print(f"  rep {rep} {name:11s} wall {res[name][-1][0]:7.1f} ms/step  training thread CPU "
                  f"{res[name][-1][1]:7.1f}  load {os.getloadavg()[0]:.2f}", flush=True)
    alone = statistics.median(c for _, c in res["alone"])
    summary = {name: {"wall_ms": statistics.median(w for w, _ in v), "main_cpu_ms": statistics.median(c for _, c in v),
                      "main_cpu_vs_alone": statistics.median(c for _, c in v) / alone - 1, "rounds": v}
               for name, v in res.items()}
    print(f"\nINTERFERENCE (plain loop on CPU 0, median of {args.reps} rounds; neighbours: ~1 ms of CPU every 24 ms, "
          f"touching 64 KB (small) or 8 MB (large) a pass; busy: flat out)")
    for name, v in summary.items():
        print(f"  {name:11s} wall {v['wall_ms']:7.1f} ms/step  training thread CPU {v['main_cpu_ms']:7.1f} ms "
              f"({100 * v['main_cpu_vs_alone']:+.1f}% vs alone)")
    return {"interference": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150, help="inner steps per process")
    ap.add_argument("--skip", type=int, default=30, help="start-up steps left out of each process's median")
    ap.add_argument("--reps", type=int, default=5, help="A/B rounds (order alternates; >= 5 for a headline)")
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin learners to CPU 0 / syncer to CPU 1")
    ap.add_argument("--syncer-width", type=int, default=1024, help="layer width of the syncer-memory model (24 layers)")
    ap.add_argument("--skip-syncer-memory", action="store_true")
    ap.add_argument("--json", default=None, help="write the headline, the breakdown and every process's record here")
    ap.add_argument("--task", choices=sorted(TASKS), default="mid", help="mid: the 3.2M-param GPT; tiny: the 0.2M one")
    ap.add_argument("--threads", type=int, choices=(1, 2), default=1,
                    help="torch threads of both arms (2: the learners on both CPUs)")
    ap.add_argument("--workers-cpu", action="store_true",
                    help="with 1 torch thread, pinned: the ddiloco arm's training thread on CPU 0 and its worker threads "
                         "(upload, receive, heartbeat) on CPU 1 beside the syncer (nice +10): a learner with a core to "
                         "spare, as on a GPU host or a VM with more cores than torch threads; the default puts them all "
                         "on CPU 0, the worst case")
    ap.add_argument("--io-process", action="store_true",
                    help="the ddiloco arm with its io helper process (`ddiloco learn --io-process`): the helper's CPU "
                         "counts in its all-thread CPU, its memory in the proportional-set-size ratio (with "
                         "--workers-cpu its threads on CPU 1)")
    ap.add_argument("--workers-nice", type=int, default=0, metavar="N",
                    help="the ddiloco arm's worker threads at nice N (the training thread at 0): an experiment")
    ap.add_argument("--switch-interval", type=float, default=0.0, metavar="MS",
                    help="the ddiloco arm's sys.setswitchinterval in ms (Python's default 5): how long a thread that "
                         "wants the GIL waits before it asks the holder to drop it; an experiment")
    ap.add_argument("--tune-plain", action="store_true",
                    help="the plain loop sets the allocator thresholds `ddiloco learn` sets (ddiloco_cli.learner."
                         "allocator): the comparison without the allocator's part (DDILOCO_MALLOC_TUNING=0 in the "
                         "environment: both arms with glibc's defaults)")
    ap.add_argument("--wrap", default=None, metavar="CMD",
                    help="a command line to run each arm's process under, e.g. 'py-spy record --gil --native -r 250 "
                         "-f raw -o /tmp/p/{arm}-{rep}.txt --' ({arm}, {rep}: that process's)")
    ap.add_argument("--timers", action="store_true",
                    help="time the learner's main functions (thread CPU per call, inclusive; ~1 us a call more) and "
                         "print them per step and per call")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="cProfile the ddiloco arm in thread CPU time, one pstats file per thread in DIR/repN/ (slows that arm: its "
                         "figures are then not comparable)")
    ap.add_argument("--interference", action="store_true",
                    help="instead of the A/B: the plain loop alone and beside neighbour processes on either CPU "
                         "(what other work's CPU and memory traffic cost the training step)")
    # internal: one arm in this process
    ap.add_argument("--worker", choices=("plain", "ddiloco"), help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--learner-id", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "plain":
        return plain_worker(args.steps, args.out, task=args.task, threads=args.threads, skip=args.skip,
                            tune=args.tune_plain)
    if args.worker == "ddiloco":
        return ddiloco_worker(args.url, args.learner_id, args.steps, args.out, profile_dir=args.profile,
                              timers=args.timers, skip=args.skip, task=args.task, threads=args.threads,
                              workers_cpu=1 if args.workers_cpu else None, workers_nice=args.workers_nice,
                              switch_ms=args.switch_interval, io_process=args.io_process)
    if args.pin and (os.cpu_count() or 1) < 2:
        args.pin = False
    if args.workers_cpu and (not args.pin or args.threads != 1):
        raise SystemExit("--workers-cpu needs pinning (2 CPUs) and 1 torch thread")

    workdir = tempfile.mkdtemp(prefix="bench-overhead-")
    if args.interference:
        if (os.cpu_count() or 1) < 2:
            raise SystemExit("--interference pins to CPU 0 and CPU 1: this machine has one CPU")
        try:
            res = interference(args, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
        return
    try:
        _, the_task, batch_size = TASKS[args.task]
        n = sum(p.numel() for p in the_task.build_model().parameters())
        print(f"task {args.task}: {n / 1e6:.2f}M params, batch {batch_size} x {the_task.config.block_size} tokens; "
              f"{args.threads} torch thread(s); P = H = 24, int4; {args.reps} A/B rounds x {args.steps} steps "
              f"(first {args.skip} skipped); pinned: {args.pin}{'; io helper process' if args.io_process else ''}{'; worker threads on CPU 1' if args.workers_cpu else ''}; load {os.getloadavg()[0]:.2f}", flush=True)
        from ddiloco_cli.learner import allocator

        tuned, why = allocator.wanted()
        alloc = ("allocator thresholds as `ddiloco learn` sets them in the ddiloco arm" + (
            " and in the plain loop (--tune-plain)" if args.tune_plain else ", glibc's defaults in the plain loop")
            if tuned else f"glibc's allocator as the environment sets it in both arms ({why})")
        print(alloc, flush=True)
        res = step_time_comparison(args, workdir)
        res["model_numel"] = n
        res["allocator"] = alloc
        if not args.skip_syncer_memory:
            res["syncer_memory"] = syncer_memory(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    res["headline"] = headline(res, args)
    print_breakdown(res, args)
    print_headline(res["headline"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
