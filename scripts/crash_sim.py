"""Crash points in the deterministic simulation (ddiloco_cli/simtrain/crash.py).

For each seed: one uncrashed run of a small scenario (micro GPT, M = 2, P = 2, H = 4)
counts the points, then the run is repeated once per point with the primary syncer
killed at that point of a commit (before / after each of its writes) or learner 0 at
that point of a send (the contribution queued, its PUT before / after). After each run:
the ledger audit of `inspect --verify` (nothing lost, pending or applied twice) and a
bit-exact replay (restores from checkpoints + ledger and from the ledger alone equal the
live syncer's state). Exit status 1 if any point fails.

    .venv/bin/python scripts/crash_sim.py                          # seed 0: every point (~130)
    .venv/bin/python scripts/crash_sim.py --seeds 4 --json /tmp/crash.json
    .venv/bin/python scripts/crash_sim.py --seeds 100 --budget-s 600   # as many as fit in 10 minutes
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from ddiloco_cli.simtrain.crash import crash_scenario, points_of, run_point, verify


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1, every point of each")
    ap.add_argument("--steps", type=int, default=24, help="inner steps per learner")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting points after this much CPU time")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args(argv)
    logging.disable(logging.ERROR)  # the real code's warnings about the crashes are expected
    t0 = time.process_time()
    ran = fired = 0
    failures: list[dict] = []
    for seed in range(args.seeds):
        scenario = crash_scenario(seed, steps=args.steps)
        world, plan = run_point(scenario, None)
        base_problems = verify(world)
        if base_problems:
            failures.append({"seed": seed, "point": None, "problems": base_problems})
        for point in points_of(plan):
            if args.budget_s is not None and time.process_time() - t0 > args.budget_s:
                break
            world, plan = run_point(scenario, point)
            ran += 1
            fired += plan.fired
            problems = verify(world)
            if problems:
                failures.append({"seed": seed, "point": vars(point), "problems": problems})
                print(f"FAIL seed {seed} {point}: {problems}", file=sys.stderr)
        print(f"seed {seed}: {ran} points so far, {len(failures)} failed, "
              f"{time.process_time() - t0:.0f} s CPU", file=sys.stderr)
    cpu_s = time.process_time() - t0
    out = {"points": ran, "fired": fired, "failed": len(failures), "seeds": args.seeds, "steps": args.steps,
           "cpu_s": cpu_s, "cpu_s_per_point": cpu_s / max(1, ran), "failures": failures[:20]}
    print(f"{ran} crash points ({fired} reached), {len(failures)} failed, {cpu_s:.0f} s CPU "
          f"({out['cpu_s_per_point']:.2f} s per point)")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=1)
    if failures:
        sys.exit(1)
    return out


if __name__ == "__main__":
    main()
