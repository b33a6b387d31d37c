"""The simulator against real processes: one scenario both can run the same way.

The real arm is `bench_convergence.py`'s decoupled arm (real `ddiloco init`, `sync` and M
`learn` processes on a local-directory bucket) with every learner paced to a fixed step
time (`--step-ms`: benchlib's paced tiny GPT waits until that long after its previous step
began), so how many steps fit into a round trip does not depend on the host's speed. The
simulated arm is `ddiloco simulate --train`'s decoupled arm with the same run settings
(bench_convergence's: P = 4, H = 16, tau = 8, int4, batch 16, cosine, outer lr 0.7, RDA),
the same M, steps and step time, the syncer's poll interval of the real arm (0.1 s), and a
local bucket's link: no round trip, no bandwidth limit worth the name, ``--store-latency-ms``
per request. The real runs use the run's default seed (0); the simulator runs seeds
0..S-1 (data order, initialisation, jitter). The check: does each real val loss lie
within [min, max] of the simulator's?

    .venv/bin/python scripts/validate_sim.py --learners 2 --steps 1200 --seeds 5 --real-runs 3 --json /tmp/v.json
    .venv/bin/python scripts/validate_sim.py --learners 2 --steps 24 --seeds 1 --real-runs 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_convergence  # noqa: E402
import benchlib  # noqa: E402
from ddiloco_cli.simtrain.report import _decoupled  # noqa: E402
from ddiloco_cli.simtrain.scenario import Scenario  # noqa: E402
from ddiloco_cli.simtrain.world import World  # noqa: E402

FIGURES = ("val_loss", "merged_token_fraction", "mean_quorum")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, default=2, help="M")
    ap.add_argument("--steps", type=int, default=1200, help="inner steps per learner")
    ap.add_argument("--seeds", type=int, default=5, help="simulated runs, seeds 0..S-1")
    ap.add_argument("--real-runs", type=int, default=3, help="real runs (seed 0; they differ by timing alone)")
    ap.add_argument("--step-ms", type=float, default=100.0, help="the fixed step time of every learner, both arms")
    ap.add_argument("--poll-s", type=float, default=0.1, help="the syncer's poll interval (bench_convergence's)")
    ap.add_argument("--store-latency-ms", type=float, default=1.0, help="simulated: a local bucket's per-request time")
    ap.add_argument("--link-mbps", type=float, default=8000.0, help="simulated: a local bucket's bandwidth")
    ap.add_argument("--workdir", default=None, help="the real runs go here (default: a temp dir, removed after)")
    ap.add_argument("--real-from", default=None,
                    help="take the real runs from this bench_convergence.py --json file (run with the same settings "
                         "and --step-ms) instead of running them")
    ap.add_argument("--sim-only", action="store_true", help="no real runs (the comparison is left out)")
    ap.add_argument("--json", dest="json_path", default=None)
    return ap.parse_args(argv)


def scenario(args, seed: int) -> Scenario:
    return Scenario(learners=args.learners, steps_per_learner=args.steps, seed=seed, learner_id_format="l{i}",
                    step_s=args.step_ms / 1e3,
                    up_mbps=args.link_mbps, down_mbps=args.link_mbps, rtt_ms=0.0, jitter_ms=0.0,
                    store_latency_ms=args.store_latency_ms, syncer_poll_s=args.poll_s, syncer_rtt_ms=0.0,
                    eval_points=0, arms=("decoupled",))


def run_sim(args) -> list[dict]:
    torch.set_num_threads(1)
    runs = []
    for seed in range(args.seeds):
        t0 = time.process_time()
        world = World(scenario(args, seed))
        world.run()
        dec = _decoupled(world)
        led = dec["ledger"]
        runs.append({"seed": seed, "val_loss": dec["val_loss"], "virtual_s": dec["virtual_s"],
                     "merged_token_fraction": led["merged_token_fraction"], "mean_quorum": led["mean_quorum"],
                     "lag_steps_p50": dec["lag_steps_p50"], "lag_steps_p95": dec["lag_steps_p95"],
                     "cpu_s": time.process_time() - t0, "load": os.getloadavg()[0]})
        print(f"[sim] seed {seed}: val {dec['val_loss']:.4f} ({runs[-1]['cpu_s']:.0f} s CPU, "
              f"{benchlib.load_text()})", file=sys.stderr)
    return runs


def run_real(args) -> list[dict]:
    if args.real_from:
        with open(args.real_from) as f:
            dec = json.load(f)["results"]["decoupled"]
        return real_records(dec.get("runs", [dec]))
    argv = ["--learners", str(args.learners), "--steps-per-learner", str(args.steps), "--arms", "decoupled",
            "--step-ms", str(args.step_ms), "--repeats", str(args.real_runs)]
    if args.workdir:
        argv += ["--workdir", args.workdir]
    dec = bench_convergence.main(argv)["results"]["decoupled"]
    return real_records(dec.get("runs", [dec]))


def real_records(runs: list[dict]) -> list[dict]:
    return [{"val_loss": r["val_loss"], "merged_token_fraction": r["merged_token_fraction"],
             "mean_quorum": r["mean_quorum"], "wall_s": r["train_s"], "load": r["mean_load_1m"],
             "steps": r["steps"]} for r in runs]


def summary(runs: list[dict]) -> dict:
    return {key: {"mean": statistics.fmean(r[key] for r in runs), "min": min(r[key] for r in runs),
                  "max": max(r[key] for r in runs)} for key in FIGURES}


def compare(sim: dict, real: list[dict]) -> dict:
    lo, hi = sim["val_loss"]["min"], sim["val_loss"]["max"]
    inside = [lo <= r["val_loss"] <= hi for r in real]
    return {"sim_val_loss_range": [lo, hi], "real_inside": inside, "all_inside": all(inside),
            "real_mean_inside": lo <= statistics.fmean(r["val_loss"] for r in real) <= hi}


def report(out: dict) -> str:
    rows = []
    for arm in ("sim", "real") if "real" in out else ("sim",):
        s = out[arm]["summary"]
        rows.append([arm, len(out[arm]["runs"])] + [f"{s[k]['mean']:.4f} ({s[k]['min']:.4f}-{s[k]['max']:.4f})"
                                                    for k in FIGURES])
    if "comparison" not in out:
        return benchlib.fmt_table(["arm", "runs", "val_loss mean (min-max)", "merged_token_fraction", "mean_quorum"],
                                  rows)
    c = out["comparison"]
    verdict = "inside" if c["all_inside"] else f"NOT all inside ({sum(c['real_inside'])}/{len(c['real_inside'])})"
    return (benchlib.fmt_table(["arm", "runs", "val_loss mean (min-max)", "merged_token_fraction", "mean_quorum"],
                               rows)
            + f"\nreal val losses {[round(r['val_loss'], 4) for r in out['real']['runs']]}: {verdict} the "
              f"simulator's [{c['sim_val_loss_range'][0]:.4f}, {c['sim_val_loss_range'][1]:.4f}]")


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.monotonic()
    print(f"M={args.learners} x {args.steps} steps at {args.step_ms} ms; {benchlib.load_text()}", file=sys.stderr)
    sim_runs = run_sim(args)
    out = {"settings": {k: v for k, v in vars(args).items() if k != "json_path"},
           "sim": {"runs": sim_runs, "summary": summary(sim_runs)}}
    if not args.sim_only:
        real_runs = run_real(args)
        out["real"] = {"runs": real_runs, "summary": summary(real_runs)}
        out["comparison"] = compare(out["sim"]["summary"], real_runs)
    out["wall_s"], out["load_end"] = time.monotonic() - t0, os.getloadavg()
    assert all(math.isfinite(r["val_loss"]) for r in sim_runs + out.get("real", {}).get("runs", []))
    print(report(out))
    print(f"{benchlib.load_text()}; {out['wall_s']:.0f} s")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
