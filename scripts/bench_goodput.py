"""Goodput benchmark: one seeded failure trace replayed on real processes against
Decoupled DiLoCo (K=1) and lock-step DiLoCo (K=M, --mode lockstep).

Per learner, times between SIGKILLs are exponential (mean --mean-between-s,
counted from when it is back); each killed learner is restarted with the same
command --restart-s later (it then spends a few more seconds importing torch and
loading the global model, as a real restart would). The trace is generated once
from --seed and replayed, at the same offsets, against each mode.

Learners run `--task scripts/benchlib.py:paced_tiny`: the built-in tiny GPT plus a
sleep of --pace-ms per step, standing in for an accelerator, so that M learners
fit on 2 CPU cores and a dead learner does not speed the others up.

Arms, in this order: decoupled fault-free, lockstep fault-free, decoupled chaos,
lockstep chaos. Each measures tokens trained per learner-second over its window
(from when every learner trains to the end, per learner by its heartbeat times).

  goodput (trained) = chaos tokens / (window * M) / fault-free tokens per learner-second
  goodput (merged)  = the same with the tokens the syncer merged into the global
                      model (ledger: used c_tokens / P) during the window
  longest stall     = longest time, sampled every second, with a learner training
                      and a syncer up while no fragment version advanced

    .venv/bin/python scripts/bench_goodput.py                    # CPU defaults, ~6 min on 2 cores
    .venv/bin/python scripts/bench_goodput.py --learners 8 --duration-s 300 --json /tmp/goodput.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

MODES = {"decoupled": dict(mode="decoupled"), "lockstep": dict(mode="lockstep")}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, default=6, help="M")
    ap.add_argument("--pace-ms", type=float, default=250.0, help="simulated accelerator time per step")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--fragments", "-P", type=int, default=4)
    ap.add_argument("--sync-every", "-H", type=int, default=8)
    ap.add_argument("--overlap-steps", type=int, default=2)
    ap.add_argument("--mean-between-s", type=float, default=90.0, help="mean seconds between failures, per learner")
    ap.add_argument("--restart-s", type=float, default=2.0, help="seconds from a kill to the restart")
    ap.add_argument("--duration-s", type=float, default=120.0, help="window of each chaos arm")
    ap.add_argument("--free-duration-s", type=float, default=30.0, help="window of each fault-free arm")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", default=None, help="runs go here (default: a temp dir, removed after)")
    ap.add_argument("--json", dest="json_path", default=None)
    return ap.parse_args(argv)


def run_arm(args, *, mode: str, trace: list[benchlib.Failure] | None, duration_s: float, workdir: str) -> dict:
    M = args.learners
    ids = [f"l{i}" for i in range(M)]
    name = f"{mode}-{'chaos' if trace is not None else 'free'}"
    cluster = benchlib.Cluster(os.path.join(workdir, name), env={benchlib.PACE_ENV: str(args.pace_ms)})
    try:
        run = cluster.init(task=benchlib.PACED_TASK, fragments=args.fragments, sync_every=args.sync_every,
                           overlap_steps=args.overlap_steps, batch_size=args.batch_size, total_steps=0,
                           lr_schedule="constant", inner_lr=2e-3, warmup_steps=10, codec="int4", lease=6,
                           heartbeat=1, max_staleness=16, quorum=M if mode == "lockstep" else 1, mode=mode)
        P = int(run["num_fragments"])
        cluster.start_syncer("--poll", "0.1")
        for lid in ids:
            cluster.start_learner(lid)
        # the window opens when every learner trains (heartbeat running with step >= 1)
        deadline = time.monotonic() + 180
        while True:
            beats = cluster.heartbeats()
            if all(beats.get(lid, {}).get("step", 0) >= 1 for lid in ids):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("learners did not start:\n" + cluster.log_tail("learner-l0"))
            time.sleep(0.2)
        start = {lid: (float(beats[lid]["time_s"]), int(beats[lid]["tokens"])) for lid in ids}
        t0_wall = time.time()
        driver = benchlib.ChaosDriver(trace) if trace is not None else None
        samples: list[benchlib.Sample] = []
        loads = []
        t0 = time.monotonic()
        next_sample = 0.0
        while (now := time.monotonic() - t0) < duration_s:
            if driver is not None:
                driver.tick(cluster)
            if now >= next_sample:
                beats = cluster.heartbeats()
                samples.append(benchlib.Sample(round(now, 3), tuple(cluster.versions()),
                                               len(cluster.learners_up(beats)),
                                               cluster.syncer is not None and cluster.syncer.poll() is None))
                loads.append(os.getloadavg()[0])
                next_sample += 1.0
            time.sleep(0.1)
        t_end_wall = time.time()
        cluster.terminate_learners()
        cluster.stop_syncer()
        beats = cluster.heartbeats()
        trained = {lid: int(beats[lid]["tokens"]) - start[lid][1] for lid in ids}
        learner_s = {lid: t_end_wall - start[lid][0] for lid in ids}
        merged = benchlib.merged_tokens(cluster.manifests(), num_fragments=P, window_s=(t0_wall, t_end_wall))
        events = driver.events if driver is not None else []
        return {
            "arm": name, "mode": mode, "window_s": t_end_wall - t0_wall,
            "trained_tokens": sum(trained.values()), "learner_seconds": sum(learner_s.values()),
            "trained_per_learner_s": sum(trained.values()) / sum(learner_s.values()),
            "merged_tokens": merged, "merged_per_s": merged / (t_end_wall - t0_wall),
            "kills": sum(1 for e in events if e[1] == "kill"), "events": events,
            "versions_end": list(samples[-1].versions) if samples else [],
            "longest_stall_s": benchlib.longest_stall(samples),
            "samples": [[s.t_s, list(s.versions), s.learners_up, s.syncer_up] for s in samples],
            "mean_load_1m": sum(loads) / max(1, len(loads)),
        }
    finally:
        cluster.close()


def main(argv=None) -> dict:
    args = parse_args(argv)
    benchlib.exit_on_sigterm()  # so each Cluster's finally kills its processes
    M = args.learners
    ids = [f"l{i}" for i in range(M)]
    trace = benchlib.failure_trace(seed=args.seed, learner_ids=ids, mean_between_s=args.mean_between_s,
                                   restart_delay_s=args.restart_s, duration_s=args.duration_s)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_goodput_")
    print(f"M={M} pace={args.pace_ms}ms B={args.batch_size} P={args.fragments} H={args.sync_every} "
          f"tau={args.overlap_steps}; trace: {len(trace)} failures in {args.duration_s}s (mean between "
          f"{args.mean_between_s}s per learner, restart after {args.restart_s}s, seed {args.seed}); "
          f"{benchlib.load_text()}", file=sys.stderr)
    results: dict[str, dict] = {}
    plan = [("decoupled", None, args.free_duration_s), ("lockstep", None, args.free_duration_s),
            ("decoupled", trace, args.duration_s), ("lockstep", trace, args.duration_s)]
    for mode, tr, dur in plan:
        name = f"{mode}-{'chaos' if tr is not None else 'free'}"
        print(f"[{name}] {dur:.0f}s window ... ({benchlib.load_text()})", file=sys.stderr)
        results[name] = run_arm(args, mode=mode, trace=tr, duration_s=dur, workdir=workdir)
        r = results[name]
        print(f"[{name}] {r['trained_per_learner_s']:.0f} tok/learner-s, merged {r['merged_per_s']:.0f} tok/s, "
              f"kills {r['kills']}, longest stall {r['longest_stall_s']:.1f}s ({benchlib.load_text()})",
              file=sys.stderr)
    rows = []
    for mode in MODES:
        free, chaos = results[f"{mode}-free"], results[f"{mode}-chaos"]
        g_trained = chaos["trained_per_learner_s"] / free["trained_per_learner_s"]
        g_merged = chaos["merged_per_s"] / free["merged_per_s"] if free["merged_per_s"] else float("nan")
        chaos["goodput_trained"], chaos["goodput_merged"] = g_trained, g_merged
        rows.append([mode, f"{free['trained_per_learner_s']:.0f}", f"{chaos['trained_per_learner_s']:.0f}",
                     f"{100 * g_trained:.1f}%", f"{100 * g_merged:.1f}%", chaos["kills"],
                     f"{free['longest_stall_s']:.1f}", f"{chaos['longest_stall_s']:.1f}",
                     f"{chaos['mean_load_1m']:.1f}"])
    table = benchlib.fmt_table(["mode", "free_tok/learner_s", "chaos_tok/learner_s", "goodput_trained",
                                "goodput_merged", "kills", "stall_free_s", "stall_chaos_s", "load_1m"], rows)
    gd = results["decoupled-chaos"]["goodput_trained"]
    gl = results["lockstep-chaos"]["goodput_trained"]
    stall = results["decoupled-chaos"]["longest_stall_s"]
    verdict = {
        "decoupled_ge_90pct": gd >= 0.90, "lockstep_lt_60pct": gl < 0.60,
        "decoupled_no_stall": stall < 3 * max(1.0, args.sync_every * args.pace_ms / 1e3 / args.fragments) + 2,
    }
    print(table)
    print(f"targets: decoupled >= 90%: {'met' if verdict['decoupled_ge_90pct'] else 'MISSED'} ({100 * gd:.1f}%); "
          f"lockstep < 60%: {'met' if verdict['lockstep_lt_60pct'] else 'MISSED'} ({100 * gl:.1f}%); "
          f"decoupled longest stall {stall:.1f}s ({'no stall' if verdict['decoupled_no_stall'] else 'STALL'})")
    print(f"settings: M={M} pace={args.pace_ms}ms B={args.batch_size} P={args.fragments} H={args.sync_every} "
          f"tau={args.overlap_steps}; {len(trace)} failures in {args.duration_s}s, mean between "
          f"{args.mean_between_s}s/learner, restart after {args.restart_s}s, seed {args.seed}; {benchlib.load_text()}")
    out = {"settings": {k: v for k, v in vars(args).items() if k != "json_path"},
           "trace": [[f.t_s, f.learner, f.restart_delay_s] for f in trace], "results": results, "verdict": verdict}
    return benchlib.write_result(out, json_path=args.json_path, workdir=workdir, keep_workdir=bool(args.workdir))


if __name__ == "__main__":
    main()
