"""Helpers of bench_overhead.py: per-thread measurements of a worker process (CPU time and
context switches of each thread, cProfile of every thread, thread CPU per call of named
functions), and the report (the A/B headline, then the machinery breakdown)."""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable


def _task_stat(tid: str) -> list[str] | None:
    """The fields of /proc/self/task/TID/stat after the command name (the first is the state,
    the stat file's 3rd field), or None when the thread ended meanwhile."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


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
            fields = _task_stat(tid)
            if fields is None:
                continue
            cpu_s, name = (int(fields[11]) + int(fields[12])) / tick, f"native-{tid}"
        out[name] = out.get(name, 0.0) + cpu_s
    return out



def thread_faults() -> dict[str, int]:
    """Minor page faults of every live thread of this process, by Python name (others
    ``native-TID``), from /proc: a page touched for the first time since the allocator got it
    from the kernel (or gave it back, trimming its heap, and got it again)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        fields = _task_stat(tid)
        if fields is not None:
            name = names.get(int(tid), f"native-{tid}")
            out[name] = out.get(name, 0) + int(fields[7])  # minflt, the stat file's 10th field
    return out


def thread_switches() -> dict[str, list[int]]:
    """[voluntary, involuntary] context switches of every live thread of this process, by
    Python name (others ``native-TID``), from /proc: a voluntary switch is a wait (the GIL, a
    lock, an event, I/O), an involuntary one a preemption."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, list[int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
        except OSError:
            continue
        acc = out.setdefault(names.get(int(tid), f"native-{tid}"), [0, 0])
        acc[0] += int(fields["voluntary_ctxt_switches"])
        acc[1] += int(fields["nonvoluntary_ctxt_switches"])
    return out


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
    ("ddiloco_cli.protocol.records", "sha256_hex"), ("ddiloco_cli.learner.sendpath", "outer_gradient"),
    ("ddiloco_cli.learner.uploader", "Uploader.submit"), ("ddiloco_cli.learner.receivepath", "ReceivePath._receive"),
    ("ddiloco_cli.learner.receivepath", "ReceivePath._add_to_params"),
    ("ddiloco_cli.learner.receivepath", "ReceivePath._rebase"),
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


def record_cost_reports() -> list[tuple[int, dict]]:
    """From now on, every cost report the learner's heartbeats carry (``CostMeter.fields``: what
    `status` shows), with the step it was made at, appended to the list returned."""
    from ddiloco_cli.learner.stats import CostMeter

    reports: list[tuple[int, dict]] = []
    fields = CostMeter.fields

    def recorded(self, step: int, workers, **kw) -> dict:
        out = fields(self, step, workers, **kw)
        reports.append((step, out))
        return out

    CostMeter.fields = recorded
    return reports


def steady_reports(reports: list[tuple[int, dict]], *, skip: int, steps: int) -> list[dict]:
    """The non-empty reports made after step ``skip``, up to step ``steps``: the steady state's."""
    return [f for step, f in reports if skip < step <= steps and f]


def headline(res: dict, args) -> dict:
    """What a user measures: per interleaved A/B round, the ddiloco arm's steady-state wall time
    per step over the plain arm's, and all-thread CPU per step likewise; their medians over the
    rounds; peak memory likewise (each arm's largest)."""
    load = [x for r in res["records"] for x in (r["load_before"], r["load_after"])]
    dd = [r for r in res["records"] if r["arm"] == "ddiloco"]
    plain = [r for r in res["records"] if r["arm"] == "plain"]

    def per_step(key: str) -> dict:
        return {arm: statistics.median(r.get(key, 0.0) for r in rs) for arm, rs in (("plain", plain), ("ddiloco", dd))}

    return {"task": args.task, "torch_threads": args.threads, "rounds": args.reps, "steps": args.steps,
            "skip": args.skip, "pinned": args.pin, "workers_cpu": bool(getattr(args, "workers_cpu", False)),
            "load_min": min(load), "load_max": max(load),
            "wall_ratio_median": 1 + res["overhead_median"], "wall_ratio_per_round": [1 + x for x in res["overhead_per_rep"]],
            "cpu_ratio_median": 1 + res["cpu_overhead_median"],
            "wall_p10_ratio_median": 1 + res["p10_overhead_median"],
            "wall_p10_ratio_per_round": [1 + x for x in res["p10_overhead_per_rep"]],
            "cpu_ratio_per_round": [1 + x for x in res["cpu_overhead_per_rep"]],
            "memory_ratio_median": res["memory_ratio_median"], "memory_ratio_per_round": res["memory_ratio_per_rep"],
            "io_process": bool(getattr(args, "io_process", False)),
            "pss_ratio_median": res.get("pss_ratio_median"), "pss_ratio_per_round": res.get("pss_ratio_per_rep"),
            "memory_ratio_of_maxima": res["ddiloco_vm_hwm_kb"] / res["plain_vm_hwm_kb"],
            # the ddiloco arm's peak up to its last step (before the flush of unsent progress on close)
            "ddiloco_vm_hwm_at_last_step_mb": statistics.median(
                (r.get("marks") or {}).get("last", {}).get("vm_hwm_kb", 0) / 1024 for r in dd),
            "wall_ms": {"plain": res["plain_median_ms"], "ddiloco": res["ddiloco_median_ms"]},
            "cpu_ms": {"plain": res["plain_cpu_ms"], "ddiloco": res["ddiloco_cpu_ms"]},
            "main_cpu_ms": {"plain": res["plain_main_cpu_ms"], "ddiloco": res["ddiloco_main_cpu_ms"]},
            "main_voluntary_switches_per_step": per_step("main_voluntary_switches"),
            "main_involuntary_switches_per_step": per_step("main_involuntary_switches"),
            "all_switches_per_step": per_step("all_switches"),
            "main_minor_faults_per_step": per_step("main_minor_faults"),
            "all_minor_faults_per_step": per_step("all_minor_faults")}


def print_headline(h: dict) -> None:
    def rounds(xs: list[float]) -> str:
        return ", ".join(f"{x - 1:+.1%}" for x in xs)

    print(f"\nHEADLINE (task {h['task']}, {h['torch_threads']} torch thread(s), median of {h['rounds']} interleaved "
          f"A/B rounds, steps {h['skip'] + 1}-{h['steps']}, load {h['load_min']:.2f}-{h['load_max']:.2f}"
          f"{'; io helper process' if h.get('io_process') else ''}"
          f"{'; worker threads on CPU 1' if h.get('workers_cpu') else ''})")
    print(f"  wall time per step, ddiloco / plain: {h['wall_ratio_median']:.3f} ({h['wall_ratio_median'] - 1:+.1%}; "
          f"per round {rounds(h['wall_ratio_per_round'])}); {h['wall_ms']['ddiloco']:.1f} vs "
          f"{h['wall_ms']['plain']:.1f} ms")
    print(f"  all-thread CPU per step, ddiloco / plain: {h['cpu_ratio_median']:.3f} ({h['cpu_ratio_median'] - 1:+.1%}; "
          f"per round {rounds(h['cpu_ratio_per_round'])}); {h['cpu_ms']['ddiloco']:.1f} vs {h['cpu_ms']['plain']:.1f} ms")
    if "wall_p10_ratio_median" in h:
        print(f"  fastest tenth of the steps (what a shared host's bursts leave out), ddiloco / plain: "
              f"{h['wall_p10_ratio_median']:.3f} ({h['wall_p10_ratio_median'] - 1:+.1%}; per round "
              f"{rounds(h['wall_p10_ratio_per_round'])})")
    print(f"  peak memory, ddiloco / plain: {h['memory_ratio_median']:.3f}x (per round "
          f"{', '.join(f'{x:.3f}' for x in h['memory_ratio_per_round'])}; largest over largest "
          f"{h['memory_ratio_of_maxima']:.3f}x; ddiloco's peak up to its last step {h['ddiloco_vm_hwm_at_last_step_mb']:.0f} MB)")
    if h.get("pss_ratio_median"):
        print(f"  proportional set size at the last step, ddiloco{' + its io helper' if h.get('io_process') else ''} / "
              f"plain: {h['pss_ratio_median']:.3f}x (per round {', '.join(f'{x:.3f}' for x in h['pss_ratio_per_round'])})")
    sw = h["main_voluntary_switches_per_step"], h["main_involuntary_switches_per_step"]
    print(f"  main thread's context switches per step (waits / preemptions): plain {sw[0]['plain']:.1f} / "
          f"{sw[1]['plain']:.1f}, ddiloco {sw[0]['ddiloco']:.1f} / {sw[1]['ddiloco']:.1f}")
    if "main_minor_faults_per_step" in h:
        mf, af = h["main_minor_faults_per_step"], h["all_minor_faults_per_step"]
        print(f"  minor page faults per step (main thread / all threads): plain {mf['plain']:.0f} / {af['plain']:.0f}, "
              f"ddiloco {mf['ddiloco']:.0f} / {af['ddiloco']:.0f}")


def print_breakdown(res: dict, args) -> None:
    """The per-arm table and the machinery accounting (ddiloco's own functions, by thread)."""
    oh, mem = res["overhead_median"], res["ddiloco_vm_hwm_kb"] / res["plain_vm_hwm_kb"]
    print(f"\nBreakdown. Learner step time (median of per-process steady-state medians), load "
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
        # ddiloco's threads only: "other threads" are not ddiloco's (with 2 torch threads, the OpenMP worker)
        total = mach["main step CPU"] + sum(v for k, v in mach.items() if k.startswith("ddiloco-"))
        print(f"ddiloco machinery per step, ms (load-independent), {what}: "
              + ", ".join(f"{k} {v:.2f}" for k, v in mach.items())
              + f"; CPU total {total:.2f} = {total / res['plain_cpu_ms']:.1%} of the plain step's CPU"
              + (" (target <= 3%: " + ("MET" if total / res["plain_cpu_ms"] <= 0.03 else "NOT MET") + ")"
                 if key == "machinery_steady_ms_per_step" else ""))
        res[key.replace("ms_per_step", "cpu_fraction")] = total / res["plain_cpu_ms"]
    dd = [r for r in res["records"] if r["arm"] == "ddiloco"]
    reports = [f for r in dd for f in r.get("cost_reports", [])]
    if reports:  # what `status` shows: the learner's own heartbeats (wall in step(), workers' CPU)
        own = {k: statistics.median(f.get(k, 0.0) for f in reports)
               for k in ("sync_step_ms", "sync_step_cpu_ms", "sync_worker_cpu_ms")}
        res["self_reported_ms_per_step"] = own
        cost = max(own["sync_step_ms"], own["sync_step_cpu_ms"] + own["sync_worker_cpu_ms"])
        print(f"the learner's own report (its heartbeats, steady state, median of {len(reports)}): in step() "
              f"{own['sync_step_ms']:.2f} ms wall, {own['sync_step_cpu_ms']:.2f} ms CPU; worker threads' CPU "
              f"{own['sync_worker_cpu_ms']:.2f} ms; `status` column `ddiloco`: {cost:.2f} ms = "
              f"{cost / res['plain_median_ms']:.1%} of the plain step")
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
