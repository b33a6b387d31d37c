"""Crash points in the deterministic simulation (ddiloco_cli/simtrain/crash.py, crashfork.py).

For each seed: one run of a small scenario (a nano MLP, M = 2, P = 2, H = 4) that, at
every crash point it passes, forks a copy of itself (copy-on-write) in which the primary
syncer is killed at that point of a commit (before / after each of its writes) or
learner 0 at that point of a send (the contribution queued, its PUT before / after).
Each copy runs to the end and checks: the ledger audit of `inspect --verify` (nothing
lost, pending or applied twice) and a bit-exact replay (restores from checkpoints +
ledger and from the ledger alone equal the live syncer's state). Exit status 1 if any
point fails. CPU figures include the forked children.

    .venv/bin/python scripts/crash_sim.py                          # seed 0: every point (~54)
    .venv/bin/python scripts/crash_sim.py --seeds 4 --json /tmp/crash.json
    .venv/bin/python scripts/crash_sim.py --points 10000 --jobs 2  # 10,000 points, two at a time
    .venv/bin/python scripts/crash_sim.py --replay                 # the old way: each point a run from the start
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from ddiloco_cli.simtrain.crash import MICRO, NANO, crash_scenario, points_of, run_point, verify
from ddiloco_cli.simtrain.crashfork import cpu_s, run_seed

TASKS = {"nano": NANO, "micro": MICRO}


def _replayed(scenario, select) -> tuple[list[str], list]:
    """Every point of ``scenario`` as a run from the start (crashfork's results, without the fork)."""
    world, plan = run_point(scenario, None)
    base_problems, out = verify(world), []
    for point in points_of(plan):
        if not select(point):
            break
        crashed_world, crashed = run_point(scenario, point)
        out.append((point, {"problems": verify(crashed_world), "fired": crashed.fired}))
    return base_problems, out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1, every point of each")
    ap.add_argument("--points", type=int, default=None, help="as many seeds as it takes to run this many points")
    ap.add_argument("--steps", type=int, default=12, help="inner steps per learner")
    ap.add_argument("--task", choices=sorted(TASKS), default="nano")
    ap.add_argument("--jobs", type=int, default=1, help="crashed copies running at once")
    ap.add_argument("--replay", action="store_true", help="no fork: replay each point's run from the start")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting points after this much CPU time")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args(argv)
    logging.disable(logging.ERROR)  # the real code's warnings about the crashes are expected
    t0, w0 = cpu_s(), time.perf_counter()
    ran = fired = seeds = 0
    failures: list[dict] = []

    def over() -> bool:
        return (args.budget_s is not None and cpu_s() - t0 > args.budget_s) or (
            args.points is not None and ran >= args.points)

    while not over() and (seeds < args.seeds or args.points is not None):
        seed, seeds = seeds, seeds + 1
        scenario = crash_scenario(seed, steps=args.steps, task=TASKS[args.task])
        left = None if args.points is None else args.points - ran
        budget = (lambda: over()) if left is None else (lambda: over() or len(taken) >= left)
        taken: list = []

        def select(point, budget=budget, taken=taken) -> bool:
            if budget():
                return False
            taken.append(point)
            return True

        base_problems, results = (_replayed(scenario, select) if args.replay
                                  else run_seed(scenario, jobs=args.jobs, select=select)[:2])
        if base_problems:
            failures.append({"seed": seed, "point": None, "problems": base_problems})
        for point, result in results:
            ran += 1
            fired += bool(result.get("fired"))
            if result["problems"] or not result.get("fired"):
                failures.append({"seed": seed, "point": vars(point), "problems": result["problems"] or ["not reached"]})
                print(f"FAIL seed {seed} {point}: {result['problems']}", file=sys.stderr)
        print(f"seed {seed}: {ran} points so far, {len(failures)} failed, {cpu_s() - t0:.0f} s CPU, "
              f"{time.perf_counter() - w0:.0f} s wall", file=sys.stderr)
    used, wall = cpu_s() - t0, time.perf_counter() - w0
    out = {"points": ran, "fired": fired, "failed": len(failures), "seeds": seeds, "steps": args.steps,
           "task": args.task, "jobs": args.jobs, "replay": args.replay, "cpu_s": used, "wall_s": wall,
           "cpu_s_per_point": used / max(1, ran), "failures": failures[:20]}
    print(f"{ran} crash points ({fired} reached) over {seeds} seeds, {len(failures)} failed, {used:.0f} s CPU "
          f"({out['cpu_s_per_point']:.3f} s per point), {wall:.0f} s wall")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=1)
    if failures:
        sys.exit(1)
    return out


if __name__ == "__main__":
    main()
