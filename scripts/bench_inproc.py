"""The learner's cost measured inside one process: short phases of the training loop with
``DiLoCoSync.step`` called after every step and phases without it, alternating (A B B A A B
...), on one model, one data stream and one learner session, so that what makes a whole process
or a stretch of minutes faster or slower on a shared host (its memory's placement, its core's
neighbours, their bursts) is the same for both arms.

bench_overhead.py compares processes, as a user compares two runs; on this project's 2-core
hosts whole processes of either arm ran 10-14% slower than others for their whole life, and
within one process the step time drifted by 20% over tens of seconds, which no number of
process rounds resolves to 1%. Here the learner's session stays open (its worker threads idle
in a phase without ``step``: a plain phase costs what the plain loop costs, once the first
--skip steps, which finish the work the last ``step`` queued, are left out), the phases are
short (--steps, default H = 24: every fragment sent once a phase), and each pair of adjacent
phases gives one ratio (median step time with ``step`` over median step time without); the
headline is the median over every pair of every process, with its quartiles. What it leaves
out: the start (the session's threads, the global model's read) and memory (bench_overhead.py
measures both). Same run as bench_overhead.py: P = H = 24, tau 2, K 1, int4, a real ``ddiloco
sync`` on CPU 1 at nice +10, the learner process on CPU 0 (its worker threads too: the worst
case) with 1 torch thread, the allocator settings the learner sets (``allocator.tune()``) in
both arms. All-thread CPU per step (the process's CPU clock) is compared the same way, and each
arm's training thread CPU and its time off CPU a step (wall minus that CPU: waiting for the GIL
or a lock, or preempted) are reported (medians of the phases), the latter by part of the step
(forward, backward, optimizer, ddiloco's ``step``). --workers-cpu puts the worker
threads on CPU 1 (the training thread alone on CPU 0: a learner with a core to spare, where what
is left is the GIL and the caches).

    .venv/bin/python scripts/bench_inproc.py                       # 3 processes x 40 pairs
    .venv/bin/python scripts/bench_inproc.py --procs 1 --pairs 4   # smoke
    .venv/bin/python scripts/bench_inproc.py --task tiny --steps 48 --skip 8 --json /tmp/inproc.json
    .venv/bin/python scripts/bench_inproc.py --threads 2 --procs 1 --pairs 16    # the learner on both CPUs
    .venv/bin/python scripts/bench_inproc.py --workers-cpu         # its worker threads on a core of their own
    .venv/bin/python scripts/bench_inproc.py --workers-cpu --io-process --procs 1 --pairs 6 --profile-step /tmp/step
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
from bench_overhead import INNER_LR, REPO, SEED, TASKS, WARMUP, _env, _prefix, init_bench_run, pin_workers  # noqa: E402

THIS = os.path.abspath(__file__)


PARTS = ("forward", "backward", "optimizer", "ddiloco")  # of a step: where the training thread waits


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


def _off_cpu(off: dict[str, float], part: str, since: tuple[float, float]) -> tuple[float, float]:
    """Add the training thread's time off its CPU since ``since`` to ``off[part]``; the clocks now."""
    now = _clocks()
    off[part] += (now[0] - since[0]) - (now[1] - since[1])
    return now


def worker(args) -> dict:
    from ddiloco_cli import DiLoCoSync, SyncOptions
    from ddiloco_cli.learner import allocator
    from ddiloco_cli.store import open_store

    allocator.tune()
    torch.set_num_threads(args.threads)
    if args.workers_cpu:
        pin_workers(1)  # before the session starts its threads
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval / 1e3)
    torch.manual_seed(SEED)
    _, task, batch_size = TASKS[args.task]
    model = task.build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=INNER_LR, betas=(0.9, 0.95), weight_decay=0.1)
    batches = task.batches(shard=0, num_shards=1, seed=12345, batch_size=batch_size)
    store = open_store(args.url)
    done = [0]

    def train_step(off: dict[str, float]) -> int:
        """One step; adds the training thread's time off its CPU in each part to ``off``."""
        done[0] += 1
        t = _clocks()
        for group in optimizer.param_groups:
            group["lr"] = INNER_LR * done[0] / WARMUP if done[0] <= WARMUP else INNER_LR
        batch = next(batches)
        loss = task.loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        t = _off_cpu(off, "forward", t)
        loss.backward()
        t = _off_cpu(off, "backward", t)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        float(loss.detach())
        _off_cpu(off, "optimizer", t)
        return int(task.num_tokens(batch))

    # --profile-step: cProfile of the training thread inside DiLoCoSync.step alone, in its CPU time
    profiler = cProfile.Profile(time.thread_time) if args.profile_step else None
    helper_cpu = [lambda: 0.0]  # the io helper process's CPU (--io-process), at its latest report

    def cpu_s() -> float:
        return time.process_time() + helper_cpu[0]()

    def phase(sync) -> dict:
        stamps = [(time.perf_counter(), cpu_s(), time.thread_time())]
        off = dict.fromkeys(PARTS, 0.0)
        for i in range(args.steps):
            if i == args.skip:
                off = dict.fromkeys(PARTS, 0.0)  # the steady steps only
            n_tok = train_step(off)
            if sync is not None:
                t = _clocks()
                if profiler is not None:
                    profiler.enable()
                sync.step(num_tokens=n_tok)
                if profiler is not None:
                    profiler.disable()
                _off_cpu(off, "ddiloco", t)
            stamps.append((time.perf_counter(), cpu_s(), time.thread_time()))
        steady = stamps[args.skip:]
        dts = [b[0] - a[0] for a, b in zip(steady, steady[1:])]
        n = len(steady) - 1
        wall, main_cpu = steady[-1][0] - steady[0][0], steady[-1][2] - steady[0][2]
        return {"median_ms": 1e3 * statistics.median(dts), "p10_ms": 1e3 * sorted(dts)[len(dts) // 10],
                "cpu_ms": 1e3 * (steady[-1][1] - steady[0][1]) / n, "main_cpu_ms": 1e3 * main_cpu / n,
                # the training thread's time off its CPU a step: waits (the GIL, locks) and preemptions
                "main_off_cpu_ms": 1e3 * (wall - main_cpu) / n,
                "off_cpu_ms_by_part": {k: 1e3 * v / (args.steps - args.skip) for k, v in off.items()}}

    phases = []
    with DiLoCoSync(store, model, learner_id=args.learner_id,
                    options=SyncOptions(handle_sigterm=False, align_schedule=False, stall_alert=False,
                                        io_process=args.io_process)) as sync:
        if args.io_process:
            helper_cpu[0] = lambda: sync._io.cpu_s() or 0.0
            if args.workers_cpu:  # the helper's threads beside the syncer, as the worker threads would be
                for tid in os.listdir(f"/proc/{sync._io.pid}/task"):
                    os.sched_setaffinity(int(tid), {1})
        for pair in range(args.pairs):
            for arm in (("plain", "ddiloco") if pair % 2 == 0 else ("ddiloco", "plain")):
                rec = phase(sync if arm == "ddiloco" else None)
                phases.append({"arm": arm, "pair": pair, **rec})
        versions = sum(1 for v in sync.stats.versions.values() if v > 0)
        ddiloco_steps = sum(1 for r in phases if r["arm"] == "ddiloco") * args.steps
        in_step_cpu_ms = 1e3 * sync._cost.in_step_cpu_s / ddiloco_steps
    if profiler is not None:
        profiler.dump_stats(f"{args.profile_step}.{args.learner_id}")
    return {"phases": phases, "versions": versions, "contributions": sync.stats.num_contributions,
            "in_step_cpu_ms": in_step_cpu_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=sorted(TASKS), default="mid")
    ap.add_argument("--procs", type=int, default=3, help="learner processes, one after the other")
    ap.add_argument("--pairs", type=int, default=40, help="plain/ddiloco phase pairs per process")
    ap.add_argument("--steps", type=int, default=24, help="steps per phase")
    ap.add_argument("--skip", type=int, default=4, help="steps left out at the start of every phase")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (2: the learner on both CPUs)")
    ap.add_argument("--workers-cpu", action="store_true",
                    help="with 1 torch thread: the training thread on CPU 0, the learner's worker threads on CPU 1 "
                         "beside the syncer (a learner with a core to spare, as on a GPU host)")
    ap.add_argument("--switch-interval", type=float, default=0.0, metavar="MS",
                    help="sys.setswitchinterval in ms (Python's default 5): how long a thread that wants the GIL "
                         "waits before the holder must drop it; an experiment")
    ap.add_argument("--io-process", action="store_true",
                    help="the learner's uploader and receiver in its io helper process (SyncOptions.io_process): "
                         "its CPU counts in the all-thread CPU; with --workers-cpu it runs on CPU 1")
    ap.add_argument("--profile-step", default=None, metavar="FILE",
                    help="cProfile the training thread inside DiLoCoSync.step (thread CPU; slows that arm), one "
                         "pstats file a process (FILE.inproc-N), and print its top functions")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--learner-id", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        with open(args.out, "w") as f:
            json.dump(worker(args), f)
        return
    pin = (os.cpu_count() or 1) >= 2
    if args.workers_cpu and (not pin or args.threads != 1):
        raise SystemExit("--workers-cpu needs 2 CPUs and 1 torch thread")
    workdir = tempfile.mkdtemp(prefix="bench-inproc-")
    url = os.path.join(workdir, "run")
    init_bench_run(url, args.task)
    launcher = benchlib.Launcher(workdir, env=_env(), cwd=str(REPO))
    syncer = launcher.start("syncer", "sync", url, prefix=tuple(_prefix(1 if pin else None, nice=10)))
    load0 = os.getloadavg()[0]
    where = ("; io helper process" if args.io_process else "") + ("; worker threads on CPU 1" if args.workers_cpu else "")
    print(f"task {args.task}, {args.threads} torch thread(s){where}: {args.procs} process(es) x {args.pairs} pairs x "
          f"{args.steps} steps a phase ({args.skip} left out); load {load0:.2f}", flush=True)
    procs = []
    try:
        for i in range(args.procs):
            out = os.path.join(workdir, f"proc{i}.json")
            cpus = ("0" if args.threads == 1 and not args.workers_cpu else "0,1") if pin else None
            subprocess.run([*_prefix(cpus), sys.executable, THIS, "--worker", "--out", out, "--url", url,
                            "--learner-id", f"inproc-{i}", "--task", args.task, "--steps", str(args.steps),
                            "--skip", str(args.skip), "--pairs", str(args.pairs), "--threads", str(args.threads),
                            "--switch-interval", str(args.switch_interval),
                            *(["--workers-cpu"] if args.workers_cpu else []),
                            *(["--io-process"] if args.io_process else []),
                            *(["--profile-step", args.profile_step] if args.profile_step else [])],
                           check=True, env=_env(args.threads), cwd=str(REPO))
            with open(out) as f:
                rec = json.load(f)
            procs.append(rec["phases"])
            if args.profile_step:
                stats = pstats.Stats(f"{args.profile_step}.inproc-{i}")
                stats.sort_stats("tottime").print_stats(25)
            print(f"  process {i}: {rec['contributions']} contributions sent, {rec['versions']}/24 fragments received; "
                  f"the training thread's CPU in DiLoCoSync.step {rec['in_step_cpu_ms']:.3f} ms a step")
            by = {(r["pair"], r["arm"]): r for r in procs[-1]}
            ratios = [by[p, "ddiloco"]["median_ms"] / by[p, "plain"]["median_ms"] - 1 for p in range(args.pairs)]
            print(f"  process {i}: plain {statistics.median(r['median_ms'] for r in procs[-1] if r['arm'] == 'plain'):.1f}"
                  f" ms/step; ddiloco/plain, median of its pairs {100 * statistics.median(ratios):+.1f}%", flush=True)
    finally:
        syncer.terminate()
        syncer.wait(timeout=60)
        launcher.close()
    result: dict = {"task": args.task, "threads": args.threads, "workers_cpu": args.workers_cpu,
                    "io_process": args.io_process,
                    "switch_interval_ms": args.switch_interval or None, "load_before": load0,
                    "load_after": os.getloadavg()[0], "processes": procs}
    for key, what in (("median_ms", "wall time per step"), ("p10_ms", "fastest tenth of the steps"),
                      ("cpu_ms", "all-thread CPU per step")):
        pairs = []
        for phases in procs:
            by = {(r["pair"], r["arm"]): r for r in phases}
            pairs += [by[p, "ddiloco"][key] / by[p, "plain"][key] - 1 for p in range(args.pairs)]
        q = statistics.quantiles(pairs, n=4) if len(pairs) >= 2 else [pairs[0]] * 3
        result[key] = {"per_pair": pairs, "median": statistics.median(pairs), "quartiles": [q[0], q[2]]}
        print(f"{what}, ddiloco / plain, median of {len(pairs)} pairs: {100 * result[key]['median']:+.2f}% "
              f"(quartiles {100 * q[0]:+.2f}% .. {100 * q[2]:+.2f}%)")
    for key, what in (("main_cpu_ms", "the training thread's CPU"), ("main_off_cpu_ms", "the training thread off "
                                                                     "its CPU (waits, preemptions)")):
        per_arm = {arm: statistics.median(r[key] for phases in procs for r in phases if r["arm"] == arm)
                   for arm in ("plain", "ddiloco")}
        result[key] = per_arm
        print(f"{what} per step, median of the phases: plain {per_arm['plain']:.2f} ms, "
              f"ddiloco {per_arm['ddiloco']:.2f} ms")
    by_part = {arm: {k: statistics.median(r["off_cpu_ms_by_part"][k] for phases in procs for r in phases
                                         if r["arm"] == arm) for k in PARTS} for arm in ("plain", "ddiloco")}
    result["off_cpu_ms_by_part"] = by_part
    print("  by part of the step (plain / ddiloco, ms): " + ", ".join(
        f"{k} {by_part['plain'][k]:.2f} / {by_part['ddiloco'][k]:.2f}" for k in PARTS))
    print(f"load {load0:.2f} -> {result['load_after']:.2f}")
    benchlib.write_result(result, json_path=args.json, workdir=workdir, keep_workdir=False)


if __name__ == "__main__":
    main()
