"""Learner overhead and memory: ddiloco's learner loop vs the same plain AdamW loop,
and syncer memory by the number of fragments it serves.

1. Step time. Two arms, each a fresh process with 1 torch thread, interleaved
   A/B/B/A/A/B/... for --reps rounds on the same task (``mid``, from benchlib: a
   ~3.2M-parameter char-level GPT, block 64, batch 8), same seed, same data stream:
   * plain:   nanoGPT-like loop (lr, forward, backward, clip, AdamW step, loss.item());
   * ddiloco: ``Learner.train`` on a local-directory run with P = H = 24, tau 2, K 1,
     int4, with a real ``ddiloco sync`` process serving it (so versions come back and
     the receive path runs).
   Steady-state median ms/step excludes the first --skip steps of each process.
   Fairness on a 2-core machine: both learner arms are pinned to CPU 0 (--pin), so the
   learner's own background threads (upload encode, receive decode, heartbeat) compete
   with its compute thread, as on a one-core learner: the worst case. The syncer
   stands for a remote machine: pinned to CPU 1 at nice +10 and kept running for
   both arms, so it never takes the learners' core and the arms see the same
   background. Load averages are recorded next to every figure.
2. Peak memory (VmHWM) of each arm's process; target learner <= 1.5x plain.
3. Syncer memory: peak RSS (getrusage of a child) of ``ddiloco sync --fragments 0``
   vs all fragments, on a 24-fragment run of a 25M-parameter model (24 Linear
   1024x1024 layers) after one merge of every served fragment from two learners;
   the import-only baseline is subtracted.

    .venv/bin/python scripts/bench_overhead.py                       # ~6 min on 2 cores
    .venv/bin/python scripts/bench_overhead.py --json /tmp/overhead.json
    .venv/bin/python scripts/bench_overhead.py --steps 40 --skip 10 --reps 1 --syncer-width 128   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parent.parent
THIS = os.path.abspath(__file__)
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
from benchlib import mid  # noqa: E402

MID_TASK = f"{benchlib.BENCHLIB_PATH}:mid"
BATCH_SIZE = 8
INNER_LR = 1e-3
WARMUP = 20
SEED = 0


def _stamp() -> tuple[float, float, float]:
    """(wall, CPU of the whole process, CPU of this thread), seconds."""
    return time.perf_counter(), time.process_time(), time.thread_time()


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) of every live thread of this process, by Python name.
    Python threads are read from their own CPU clocks (exact); /proc's utime + stime, for
    the others, are 10 ms scheduler ticks charged to whichever thread a tick finds running:
    a thread that runs a millisecond now and then would be off by tens of percent."""
    import threading

    by_tid = {t.native_id: t for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        thread = by_tid.get(int(tid))
        if thread is not None:
            try:
                cpu_s = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except (OSError, ValueError):  # the thread ended meanwhile
                continue
            name = thread.name
        else:
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            cpu_s, name = (int(fields[11]) + int(fields[12])) / tick, f"native-{tid}"
        out[name] = out.get(name, 0.0) + cpu_s
    return out


def vm_hwm_kb(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


# ------------------------------------------------------------------------- workers
def plain_worker(steps: int, out: str) -> None:
    """The plain loop: same task, model, optimizer, lr warmup, clip, batch and seed as
    the learner; no ddiloco import beyond the task."""
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = mid.build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=INNER_LR, betas=(0.9, 0.95), weight_decay=0.1)
    batches = mid.batches(shard=0, num_shards=1, seed=12345, batch_size=BATCH_SIZE)
    stamps = [_stamp()]
    for step in range(steps):
        lr = INNER_LR * (step + 1) / WARMUP if step < WARMUP else INNER_LR
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = next(batches)
        loss = mid.loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        float(loss.detach())
        stamps.append(_stamp())
    _write(out, arm="plain", stamps=stamps, numel=sum(p.numel() for p in params))


def profile_threads(out_dir: str) -> Callable[[], None]:
    """cProfile every thread started from now on, and the calling one, in thread CPU time
    (``time.thread_time``: a thread waiting on a lock or on fsync costs nothing); the returned
    function stops the caller's profile and writes one pstats file per thread name
    (threads that are still running are written as they stand)."""
    import cProfile
    import threading

    profiles: dict[str, cProfile.Profile] = {}
    original_start = threading.Thread.start

    def start(self) -> None:
        run = self.run  # subclasses override run(): wrap this instance's

        def profiled() -> None:
            prof = profiles.setdefault(self.name, cProfile.Profile(time.thread_time))
            prof.enable()
            try:
                run()
            finally:
                prof.disable()

        self.run = profiled
        original_start(self)

    threading.Thread.start = start
    main = profiles.setdefault("MainThread", cProfile.Profile(time.thread_time))
    main.enable()

    def dump() -> None:
        main.disable()
        os.makedirs(out_dir, exist_ok=True)
        for name, prof in list(profiles.items()):
            prof.dump_stats(os.path.join(out_dir, f"{name}.pstats"))

    return dump


# (module, attribute) of the functions ``--timers`` times: inclusive thread CPU per call, by thread
TIMED = (
    ("ddiloco_cli.learner.receiver", "Receiver._fetch"), ("ddiloco_cli.learner.receiver", "Receiver._newest"),
    ("ddiloco_cli.protocol.ledger", "latest_version"), ("ddiloco_cli.protocol.ledger", "read_manifest"),
    ("ddiloco_cli.protocol.published", "FragmentReader.read"), ("ddiloco_cli.protocol.published", "FragmentReader._payload"),
    ("ddiloco_cli.numerics.codec", "decode_tensors"), ("ddiloco_cli.numerics.codec", "apply_published_delta"),
    ("ddiloco_cli.numerics.codec", "encode_with_residual"), ("ddiloco_cli.store.retry", "RetryingStore.put_if_absent"),
    ("ddiloco_cli.store.retry", "RetryingStore.get"), ("ddiloco_cli.learner.sync", "DiLoCoSync._send"),
    ("ddiloco_cli.learner.session", "SessionWriter.beat"), ("ddiloco_cli.learner.receiver", "Receiver._manifests_since"),
    ("ddiloco_cli.numerics.quantized", "Quantized.dense"), ("ddiloco_cli.numerics.codec", "_quantize"),
    ("ddiloco_cli.numerics.codec", "_quantize_together"), ("ddiloco_cli.numerics.codec", "_quantize_flat"),
    ("ddiloco_cli.protocol.records", "sha256_hex"),
)


def time_functions() -> dict[str, list[float]]:
    """Wrap every TIMED function (inclusive thread CPU of each call, ~1 us a call on top);
    returns {"thread-kind function": [calls, CPU s]}, filled as they run. Thread kinds:
    main, uploader (all of them), receiver, heartbeat."""
    import importlib
    import inspect
    import threading

    spent: dict[str, list[float]] = {}

    def kind() -> str:
        name = threading.current_thread().name
        return "main" if name == "MainThread" else name.removeprefix("ddiloco-").split("-")[0]

    for module, attr in TIMED:
        owner = importlib.import_module(module)
        *path, leaf = attr.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, leaf):
            continue
        fn = getattr(owner, leaf)

        def wrapped(*a, _fn=fn, _name=attr, **k):
            c0 = time.thread_time()
            try:
                return _fn(*a, **k)
            finally:
                acc = spent.setdefault(f"{kind()} {_name}", [0, 0.0])
                acc[0] += 1
                acc[1] += time.thread_time() - c0

        if isinstance(inspect.getattr_static(owner, leaf), staticmethod):
            wrapped = staticmethod(wrapped)
        setattr(owner, leaf, wrapped)
    return spent


def ddiloco_worker(url: str, learner_id: str, steps: int, out: str, profile_dir: str | None = None,
                   timers: bool = False, skip: int = 0) -> None:
    torch.set_num_threads(1)
    dump_profiles = profile_threads(profile_dir) if profile_dir else None
    timed_calls = time_functions() if timers else None
    calls_at_last_step: dict[str, list[float]] = {}
    from ddiloco_cli.learner import DiLoCoSync, Learner, LearnerOptions
    from ddiloco_cli.store import open_store

    # main-thread time inside the loop's ddiloco call (``step``: send, i.e. gather + delta + queue,
    # and receive, i.e. take + scatter, and the bookkeeping), and in send alone, wall and CPU: one
    # timed call per step (a wrapper's clock reads cost microseconds; ``_receive``, called for every
    # fragment in flight at every step, would be timed mostly for its clocks)
    spent = {"step_s": 0.0, "send_s": 0.0, "step_cpu_s": 0.0, "send_cpu_s": 0.0, "step_calls": 0, "send_calls": 0}

    def timed(name, fn):
        def wrapped(*a, **k):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                spent[name + "_s"] += time.perf_counter() - t0
                spent[name + "_cpu_s"] += time.thread_time() - c0
                spent[name + "_calls"] += 1
        return wrapped

    DiLoCoSync._send = timed("send", DiLoCoSync._send)
    DiLoCoSync.step = timed("step", DiLoCoSync.step)
    from ddiloco_cli.learner.receiver import Receiver

    receivers: list = []
    start_receiver = Receiver.start

    def start(self) -> None:  # keep the instance: its poll and download counters
        receivers.append(self)
        start_receiver(self)

    Receiver.start = start
    stamps = [_stamp()]
    threads: dict[str, float] = {}
    at_last_step: dict[str, float] = {}
    threads_at_skip: dict[str, float] = {}
    at_skip: dict[str, float] = {}

    def on_progress(p: dict) -> None:
        stamps.append(_stamp())
        if len(stamps) == skip + 1 and 0 < skip < steps:  # the steady state starts: the start-up work is behind
            threads_at_skip.update(thread_cpu_s())
            at_skip.update(spent)
        if len(stamps) == steps + 1:  # last step: the workers are still alive, the flush on close not begun
            threads.update(thread_cpu_s())
            at_last_step.update(spent)
            for r in receivers[:1]:
                at_last_step.update(polls=r.num_polls, downloads=getattr(r, "num_downloads", None),
                                    waits=getattr(r, "num_waits", None))
            if timed_calls is not None:
                calls_at_last_step.update({k: list(v) for k, v in timed_calls.items()})

    learner = Learner(open_store(url), options=LearnerOptions(learner_id=learner_id, steps=steps, log_every=10**9,
                                                              task=MID_TASK),
                      on_progress=on_progress)
    reason = learner.train()
    if dump_profiles is not None:
        dump_profiles()
    s = learner.stats
    _write(out, arm="ddiloco", stamps=stamps, reason=reason, blocked_s=s.blocked_s, bytes_up=s.bytes_up,
           bytes_down=s.bytes_down, num_contributions=s.num_contributions,
           num_flushed=spent["send_calls"] - at_last_step["send_calls"],
           versions_received=sum(1 for v in s.versions.values() if v > 0),
           max_version=max(s.versions.values(), default=0), thread_cpu_s=threads, timers=calls_at_last_step,
           thread_cpu_s_at_skip=threads_at_skip, at_skip=at_skip, **at_last_step)


def _write(out: str, **rec) -> None:
    rec["vm_hwm_kb"] = vm_hwm_kb()
    with open(out, "w") as f:
        json.dump(rec, f)


# --------------------------------------------------------------------- orchestrator
def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _prefix(cpu: int | None, nice: int = 0) -> list[str]:
    pre = []
    if nice:
        pre += ["nice", "-n", str(nice)]
    if cpu is not None:
        pre += ["taskset", "-c", str(cpu)]
    return pre


def run_arm(arm: str, *, url: str, rep: int, steps: int, skip: int, workdir: str, cpu: int | None,
            profile_dir: str | None = None, timers: bool = False) -> dict:
    out = os.path.join(workdir, f"{arm}-{rep}.json")
    cmd = [*_prefix(cpu), sys.executable, THIS, "--worker", arm, "--steps", str(steps), "--out", out]
    if arm == "ddiloco":
        cmd += ["--url", url, "--learner-id", f"bench-{rep}", "--skip", str(skip)]
        if profile_dir:
            cmd += ["--profile", os.path.join(profile_dir, f"rep{rep}")]
        if timers:
            cmd += ["--timers"]
    load0 = os.getloadavg()[0]
    subprocess.run(cmd, check=True, env=_env(), cwd=str(REPO))
    with open(out) as f:
        rec = json.load(f)
    stamps = rec.pop("stamps")
    dts = [b[0] - a[0] for a, b in zip(stamps, stamps[1:])][skip:]
    cpu = [b[1] - a[1] for a, b in zip(stamps, stamps[1:])][skip:]
    main_cpu = [b[2] - a[2] for a, b in zip(stamps, stamps[1:])][skip:]
    rec.update(rep=rep, median_ms=1e3 * statistics.median(dts), mean_ms=1e3 * statistics.fmean(dts),
               cpu_median_ms=1e3 * statistics.median(cpu), cpu_mean_ms=1e3 * statistics.fmean(cpu),
               main_cpu_median_ms=1e3 * statistics.median(main_cpu),
               p90_ms=1e3 * sorted(dts)[int(0.9 * len(dts))], steps_measured=len(dts),
               load_before=load0, load_after=os.getloadavg()[0])
    print(f"  rep {rep} {arm:8s} median {rec['median_ms']:7.1f} ms/step  p90 {rec['p90_ms']:7.1f}  "
          f"cpu {rec['cpu_mean_ms']:7.1f} (main {rec['main_cpu_median_ms']:6.1f})  VmHWM {rec['vm_hwm_kb'] / 1024:6.0f} MB  load {load0:.2f}->{rec['load_after']:.2f}", flush=True)
    return rec


def step_time_comparison(args, workdir: str) -> dict:
    from ddiloco_cli.ops.runinit import RunSpec, init_run
    from ddiloco_cli.store import open_store

    url = os.path.join(workdir, "run")
    init_run(open_store(url), RunSpec(task=MID_TASK, num_fragments=24, sync_every=24, overlap_steps=2, quorum=1,
                                      codec="int4", inner_lr=INNER_LR, warmup_steps=WARMUP, lr_schedule="constant",
                                      total_steps=0, batch_size=BATCH_SIZE, seed=SEED))
    cpu_l, cpu_s = (0, 1) if args.pin else (None, None)
    launcher = benchlib.Launcher(workdir, env=_env(), cwd=str(REPO))
    syncer = launcher.start("syncer", "sync", url, prefix=tuple(_prefix(cpu_s, nice=10)))
    records = []
    try:
        for rep in range(args.reps):
            order = ("plain", "ddiloco") if rep % 2 == 0 else ("ddiloco", "plain")
            for arm in order:
                records.append(run_arm(arm, url=url, rep=rep, steps=args.steps, skip=args.skip, workdir=workdir,
                                       cpu=cpu_l, profile_dir=args.profile, timers=args.timers))
        syncer_hwm = vm_hwm_kb(syncer.pid)
    finally:
        syncer.terminate()
        syncer.wait(timeout=60)
        launcher.close()
    plain = [r for r in records if r["arm"] == "plain"]
    dd = [r for r in records if r["arm"] == "ddiloco"]
    ratios = [d["median_ms"] / p["median_ms"] for p, d in zip(plain, dd)]  # same rep: adjacent in time
    cpu_ratios = [d["cpu_mean_ms"] / p["cpu_mean_ms"] for p, d in zip(plain, dd)]
    return {
        "records": records, "syncer_vm_hwm_kb": syncer_hwm,
        "plain_median_ms": statistics.median(r["median_ms"] for r in plain),
        "ddiloco_median_ms": statistics.median(r["median_ms"] for r in dd),
        "overhead_per_rep": [r - 1 for r in ratios], "overhead_median": statistics.median(ratios) - 1,
        "plain_cpu_ms": statistics.median(r["cpu_mean_ms"] for r in plain),
        "ddiloco_cpu_ms": statistics.median(r["cpu_mean_ms"] for r in dd),
        "cpu_overhead_per_rep": [r - 1 for r in cpu_ratios], "cpu_overhead_median": statistics.median(cpu_ratios) - 1,
        "plain_main_cpu_ms": statistics.median(r["main_cpu_median_ms"] for r in plain),
        "ddiloco_main_cpu_ms": statistics.median(r["main_cpu_median_ms"] for r in dd),
        "machinery_ms_per_step": _machinery(dd, steps=args.steps),
        "machinery_steady_ms_per_step": _machinery(dd, steps=args.steps, skip=args.skip),
        "plain_vm_hwm_kb": max(r["vm_hwm_kb"] for r in plain), "ddiloco_vm_hwm_kb": max(r["vm_hwm_kb"] for r in dd),
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150, help="inner steps per process")
    ap.add_argument("--skip", type=int, default=30, help="start-up steps left out of each process's median")
    ap.add_argument("--reps", type=int, default=4, help="A/B rounds (order alternates)")
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin learners to CPU 0 / syncer to CPU 1")
    ap.add_argument("--syncer-width", type=int, default=1024, help="layer width of the syncer-memory model (24 layers)")
    ap.add_argument("--skip-syncer-memory", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timers", action="store_true",
                    help="time the learner's main functions (thread CPU per call, inclusive; ~1 us a call more) and "
                         "print them per step and per call")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="cProfile the ddiloco arm in thread CPU time, one pstats file per thread in DIR/repN/ (slows that arm: its "
                         "figures are then not comparable)")
    # internal: one arm in this process
    ap.add_argument("--worker", choices=("plain", "ddiloco"), help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--learner-id", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "plain":
        return plain_worker(args.steps, args.out)
    if args.worker == "ddiloco":
        return ddiloco_worker(args.url, args.learner_id, args.steps, args.out, profile_dir=args.profile,
                              timers=args.timers, skip=args.skip)
    if args.pin and (os.cpu_count() or 1) < 2:
        args.pin = False

    workdir = tempfile.mkdtemp(prefix="bench-overhead-")
    try:
        n = sum(p.numel() for p in mid.build_model().parameters())
        print(f"task mid: {n / 1e6:.2f}M params, batch {BATCH_SIZE} x {mid.config.block_size} tokens; "
              f"P = H = 24, int4; {args.reps} A/B rounds x {args.steps} steps (first {args.skip} skipped); "
              f"pinned: {args.pin}; load {os.getloadavg()[0]:.2f}", flush=True)
        res = step_time_comparison(args, workdir)
        res["model_numel"] = n
        if not args.skip_syncer_memory:
            res["syncer_memory"] = syncer_memory(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    oh, mem = res["overhead_median"], res["ddiloco_vm_hwm_kb"] / res["plain_vm_hwm_kb"]
    print(f"\nLearner step time (median of per-process steady-state medians), 1 thread, load "
          f"{min(r['load_before'] for r in res['records']):.2f}-{max(r['load_after'] for r in res['records']):.2f}")
    print(f"{'arm':8s} {'wall ms/step':>12s} {'CPU ms/step':>12s} {'peak RSS MB':>12s}")
    for arm in ("plain", "ddiloco"):
        print(f"{arm:8s} {res[arm + '_median_ms']:12.1f} {res[arm + '_cpu_ms']:12.1f} {res[arm + '_vm_hwm_kb'] / 1024:12.0f}")
    print(f"overhead per A/B round: {', '.join(f'{x:+.1%}' for x in res['overhead_per_rep'])}; "
          f"median {oh:+.1%} (target <= +3%: {'MET' if oh <= 0.03 else 'NOT MET'})")
    coh = res["cpu_overhead_median"]
    print(f"CPU time (all threads of the process) per step, per round: "
          f"{', '.join(f'{x:+.1%}' for x in res['cpu_overhead_per_rep'])}; median {coh:+.1%} "
          f"(load-independent: includes the background upload/receive/heartbeat threads)")
    print(f"learner peak memory {mem:.2f}x plain (target <= 1.5x: {'MET' if mem <= 1.5 else 'NOT MET'}); "
          f"syncer peak {res['syncer_vm_hwm_kb'] / 1024:.0f} MB")
    print(f"main-thread CPU per step (median): plain {res['plain_main_cpu_ms']:.1f} ms, ddiloco "
          f"{res['ddiloco_main_cpu_ms']:.1f} ms")
    for key, what in (("machinery_ms_per_step", f"all {args.steps} steps, start-up included"),
                      ("machinery_steady_ms_per_step", f"steady state: steps {args.skip + 1}-{args.steps}")):
        mach = res[key]
        total = mach["main step CPU"] + sum(v for k, v in mach.items() if "thread" in k or "ddiloco-" in k)
        print(f"ddiloco machinery per step, ms (load-independent), {what}: "
              + ", ".join(f"{k} {v:.2f}" for k, v in mach.items())
              + f"; CPU total {total:.2f} = {total / res['plain_cpu_ms']:.1%} of the plain step's CPU"
              + (" (target <= 3%: " + ("MET" if total / res["plain_cpu_ms"] <= 0.03 else "NOT MET") + ")"
                 if key == "machinery_steady_ms_per_step" else ""))
        res[key.replace("ms_per_step", "cpu_fraction")] = total / res["plain_cpu_ms"]
    dd = [r for r in res["records"] if r["arm"] == "ddiloco"]
    print("ddiloco arm: contributions sent " + ", ".join(str(r["num_contributions"]) for r in dd)
          + "; fragments received (version > 0) " + ", ".join(f"{r['versions_received']}/24" for r in dd)
          + "; blocked s " + ", ".join(f"{r['blocked_s']:.2f}" for r in dd)
          + "; receiver polls per step " + ", ".join(f"{r.get('polls', 0) / args.steps:.2f}" for r in dd)
          + ", downloads per step " + ", ".join(f"{(r.get('downloads') or 0) / args.steps:.2f}" for r in dd)
          + ", sleeps per step " + ", ".join(f"{(r.get('waits') or 0) / args.steps:.2f}" for r in dd))
    if args.timers:
        print("timed functions, inclusive thread CPU (median over processes): ms per step, calls per step, ms per call")
        for key in sorted({k for r in dd for k in r["timers"]}):
            calls = statistics.median(r["timers"].get(key, [0, 0.0])[0] for r in dd) / args.steps
            ms = 1e3 * statistics.median(r["timers"].get(key, [0, 0.0])[1] for r in dd) / args.steps
            print(f"  {key:45s} {ms:6.3f} ms/step  {calls:5.2f} calls/step  {ms / calls if calls else 0:6.3f} ms/call")
    sm = res.get("syncer_memory")
    if sm:
        base = sm["import_baseline"]
        print(f"\nSyncer peak RSS, 24 fragments of a {sm['model_numel'] / 1e6:.1f}M-param model "
              f"({sm['model_numel'] * 4 / 2**20:.0f} MB fp32), after one 2-learner merge of each served fragment:")
        for name in ("fragment 0", "fragments 0-5", "all 24"):
            print(f"  {name:10s} {sm[name] / 1024:7.0f} MB  ({(sm[name] - base) / 1024:6.0f} MB above the "
                  f"{base / 1024:.0f} MB import baseline)")
        print(f"  fragment 0 / all, above baseline: {sm['ratio_above_baseline']:.3f} (1/24 = {1 / 24:.3f})")
        print(f"  linear fit: {sm['fixed_kb'] / 1024:.0f} MB fixed + {sm['per_fragment_kb'] / 1024:.1f} MB per served "
              f"fragment ({sm['per_fragment_kb'] / sm['fragment_fp32_kb']:.1f}x its {sm['fragment_fp32_kb'] / 1024:.1f} MB "
              f"of fp32 values); 0-5 predicted {(sm['fixed_kb'] + 6 * sm['per_fragment_kb']) / 1024:.0f} MB, "
              f"measured {sm['fragments 0-5'] / 1024:.0f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
