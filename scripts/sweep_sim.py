"""The sweep table of the deterministic simulation: Decoupled DiLoCo / synchronous DiLoCo
and / data-parallel, mean and range over seeds, for M learners and one setting changed at
a time from a base (equal speeds, step time = the round trip, no preemptions).

    .venv/bin/python scripts/sweep_sim.py                                   # the table on stdout
    .venv/bin/python scripts/sweep_sim.py --write-results                   # and into docs/results.md
    .venv/bin/python scripts/sweep_sim.py --learners 2 --seeds 1 --steps 64 # a smoke run

The round trip is 2 x (link RTT + store latency) + the syncer's poll interval: the time
from a send to the merged version being readable, without the transfers. Preemptions
take 10% of each learner's time: down for 20 steps' time, mean time between them 9x that.
The references (classic DiLoCo, data-parallel) depend only on M and the seed: run once per
pair and shared by the rows.

The issue's full grid (M up to 64, every combination) does not fit on 2 shared cores; the
default here is M in {1, 2, 4}, 192 steps per learner, 3 seeds, one factor at a time.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import statistics
import sys
import time

import torch

from ddiloco_cli.simtrain.arms import run_dp, run_sync
from ddiloco_cli.simtrain.report import _decoupled
from ddiloco_cli.simtrain.scenario import Scenario
from ddiloco_cli.simtrain.world import World

BEGIN, END = "<!-- sweep_sim:begin -->", "<!-- sweep_sim:end -->"
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "docs", "results.md")
ROWS = {  # name -> scenario fields over the base
    "base: equal speeds, step = round trip": {},
    "two speeds (every other 1.5x slower)": {"speeds": "two", "slow_factor": 1.5},
    "lognormal speeds, sigma 0.5": {"speeds": "lognormal", "sigma": 0.5},
    "step = 0.2 x round trip": {"ratio": 0.2},
    "step = 5 x round trip": {"ratio": 5.0},
    "preemptions, 10% of learner time down": {"preempt": True},
}


def round_trip_s(sc: Scenario) -> float:
    return 2 * (sc.rtt_ms + sc.store_latency_ms) / 1e3 + sc.syncer_poll_s


def scenario_for(row: dict, *, learners: int, seed: int, steps: int) -> Scenario:
    fields = {k: v for k, v in row.items() if k not in ("ratio", "preempt")}
    sc = Scenario(learners=learners, seed=seed, steps_per_learner=steps, eval_points=0, arms=("decoupled",), **fields)
    sc.step_s = row.get("ratio", 1.0) * round_trip_s(sc)
    if row.get("preempt"):
        sc.downtime_s = 20 * sc.step_s
        sc.mtbf_s = 9 * sc.downtime_s
    return sc


def sweep(*, learners: list[int], seeds: int, steps: int) -> dict:
    torch.set_num_threads(1)
    cells: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for M in learners:
        for seed in range(seeds):
            t0 = time.process_time()
            ref = scenario_for({}, learners=M, seed=seed, steps=steps)
            config = ref.run_config()
            world = World(ref)
            sync = run_sync(world.task, ref, world.config, world.inner)["val_loss"]
            dp = run_dp(world.task, ref, world.config, world.inner)["val_loss"]
            for name, row in ROWS.items():
                w = World(scenario_for(row, learners=M, seed=seed, steps=steps))
                w.run()
                val = _decoupled(w)["val_loss"]
                cells.setdefault((name, M), []).append((val / sync, val / dp))
            print(f"M={M} seed {seed}: sync {sync:.4f} dp {dp:.4f} ({time.process_time() - t0:.0f} s CPU, "
                  f"{config.num_fragments} fragments)", file=sys.stderr)
    return cells


def _cell(values: list[float]) -> str:
    mean = statistics.mean(values)
    return f"{mean:.3f} ({min(values):.3f}-{max(values):.3f})" if len(values) > 1 else f"{mean:.3f}"


def table(cells: dict, *, learners: list[int]) -> str:
    head = "| setting | " + " | ".join(f"M = {M}: / sync | M = {M}: / dp" for M in learners) + " |"
    lines = [head, "|---" * (1 + 2 * len(learners)) + "|"]
    for name in ROWS:
        row = [name]
        for M in learners:
            pairs = cells.get((name, M), [])
            row += [_cell([a for a, _ in pairs]), _cell([b for _, b in pairs])] if pairs else ["-", "-"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_results(text: str, path: str = RESULTS) -> None:
    with open(path) as f:
        doc = f.read()
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in doc:
        doc = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, doc, flags=re.S)
    else:
        doc = doc.rstrip("\n") + f"\n\n## Simulation sweep\n\n{block}\n"
    with open(path, "w") as f:
        f.write(doc)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", default="1,2,4", help="comma-separated M values")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=192, help="inner steps per learner")
    ap.add_argument("--write-results", action="store_true", help="replace the table in docs/results.md")
    args = ap.parse_args(argv)
    logging.disable(logging.ERROR)
    learners = [int(m) for m in args.learners.split(",")]
    t0 = time.process_time()
    cells = sweep(learners=learners, seeds=args.seeds, steps=args.steps)
    text = (table(cells, learners=learners) + f"\n\nDecoupled val loss / classic DiLoCo and / data-parallel at equal "
            f"tokens; mean (range) over {args.seeds} seed(s); tiny GPT, {args.steps} steps per learner, P = 4, H = 16, "
            f"tau = 8, int4; links 100 Mbps / 50 ms, store 20 ms, syncer poll 0.2 s. Made by `python "
            f"scripts/sweep_sim.py --learners {args.learners} --seeds {args.seeds} --steps {args.steps} "
            f"--write-results` ({time.process_time() - t0:.0f} s CPU).")
    print(text)
    if args.write_results:
        write_results(text)
    return text


if __name__ == "__main__":
    main()
