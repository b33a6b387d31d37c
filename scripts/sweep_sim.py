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

The whole grid of docs/results.md (M = 1-16 with every row and 3 seeds, M = 64 the base row
and one seed, 128 steps) is about 45 min on 2 cores with ``--jobs 2``:

    .venv/bin/python scripts/sweep_sim.py --learners 1,2,4,8,16,64 --seeds 3 --steps 128 --jobs 2 \
        --cells-out /tmp/cells.jsonl --write-results
    .venv/bin/python scripts/sweep_sim.py --learners 1,2,4,8,16,64 --seeds 3 --steps 128 \
        --from-cells /tmp/cells.jsonl --write-results     # the table again, from the saved cells
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
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
ROW_KEYS = dict(zip(("base", "two", "lognormal", "fast", "slow", "preempt"), ROWS))  # --rows' short names


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


def one_pair(M: int, seed: int, steps: int, rows: tuple[str, ...], run: dict | None = None) -> list[dict]:
    """The references and the given rows for one (M, seed): one dict per row. ``run``:
    RunConfig overrides of the rows (the references are classic DiLoCo and data-parallel
    whatever the rows' codec); each row also reports its bytes per parameter per cycle."""
    torch.set_num_threads(1)
    logging.disable(logging.ERROR)
    t0 = time.process_time()
    ref = scenario_for({}, learners=M, seed=seed, steps=steps)
    world = World(ref)
    sync = run_sync(world.task, ref, world.config, world.inner)["val_loss"]
    dp = run_dp(world.task, ref, world.config, world.inner)["val_loss"]
    out = []
    for name in rows:
        sc = scenario_for(ROWS[name], learners=M, seed=seed, steps=steps)
        sc.run = dict(run or {})
        w = World(sc)
        w.run()
        d = _decoupled(w)
        per_cycle = sum(t.numel() for t in w.learners[0].model.parameters()) * steps / w.config.sync_every
        out.append(dict(row=name, M=M, seed=seed, val=d["val_loss"], sync=sync, dp=dp,
                        used=d["ledger"]["used"], refused=d["ledger"]["refused"],
                        merged=d["ledger"]["merged_token_fraction"], run=dict(run or {}),
                        up_b_per_param_cycle=d["bytes_up_per_learner"] / per_cycle,
                        down_b_per_param_cycle=d["bytes_down_per_learner"] / per_cycle))
    print(f"M={M} seed {seed}: sync {sync:.4f} dp {dp:.4f} ({time.process_time() - t0:.0f} s CPU, "
          f"{ref.run_config().num_fragments} fragments)", file=sys.stderr, flush=True)
    return out


def sweep(*, learners: list[int], seeds: int, steps: int, jobs: int = 1, base_only_above: int = 16,
          large_seeds: int = 1, cells_out: str | None = None, rows: tuple[str, ...] = tuple(ROWS),
          run: dict | None = None) -> list[dict]:
    """Every (M, seed) pair's rows, ``jobs`` pairs at a time (processes). Above
    ``base_only_above`` learners only the base row runs, for ``large_seeds`` seeds: all the rows
    at M = 64 are hours of CPU here. Each finished row is appended to ``cells_out`` (JSON lines)."""
    pairs = []
    for M in learners:
        these = rows if M <= base_only_above else rows[:1]
        pairs += [(M, seed, steps, these, run)
                  for seed in range(seeds if M <= base_only_above else min(seeds, large_seeds))]
    pairs.sort(key=lambda t: -t[0] * len(t[3]))  # the longest first, so the pool ends together
    results: list[dict] = []
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for out in pool.imap_unordered(_one_pair_star, pairs):
            results += out
            if cells_out:
                with open(cells_out, "a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in out)
    return results


def _one_pair_star(args: tuple) -> list[dict]:
    return one_pair(*args)


def cells_from(results: list[dict]) -> dict:
    """(row, M) -> [(val / sync, val / dp, refused / (used + refused))] over seeds."""
    cells: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for r in sorted(results, key=lambda r: (r["M"], r["seed"])):
        refused = r["refused"] / max(1, r["used"] + r["refused"])
        cells.setdefault((r["row"], r["M"]), []).append((r["val"] / r["sync"], r["val"] / r["dp"], refused))
    return cells


def _cell(values: list[float]) -> str:
    mean = statistics.mean(values)
    return f"{mean:.3f} ({min(values):.3f}-{max(values):.3f})" if len(values) > 1 else f"{mean:.3f}"


def bytes_line(results: list[dict], *, learners: list[int]) -> str:
    """Each M's mean bytes per parameter per cycle, up and down, over its rows and seeds (rows
    of older cell files without them: left out)."""
    parts = []
    for M in learners:
        rs = [r for r in results if r["M"] == M and "up_b_per_param_cycle" in r]
        if rs:
            parts.append(f"M = {M} {statistics.mean(r['up_b_per_param_cycle'] for r in rs):.3f} / "
                         f"{statistics.mean(r['down_b_per_param_cycle'] for r in rs):.3f}")
    return "Bytes per parameter per cycle per learner, up / down: " + "; ".join(parts) + "." if parts else ""


def table(cells: dict, *, learners: list[int], rows: tuple[str, ...] = tuple(ROWS)) -> str:
    head = "| setting | " + " | ".join(f"M = {M}: / sync | M = {M}: / dp" for M in learners) + " |"
    lines = [head, "|---" * (1 + 2 * len(learners)) + "|"]
    for name in rows:
        row = [name]
        for M in learners:
            pairs = cells.get((name, M), [])
            row += [_cell([c[0] for c in pairs]), _cell([c[1] for c in pairs])] if pairs else ["-", "-"]
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
    ap.add_argument("--jobs", type=int, default=1, help="(M, seed) pairs run at once, one process each")
    ap.add_argument("--base-only-above", type=int, default=16, help="above this M only the base row runs")
    ap.add_argument("--large-seeds", type=int, default=1, help="seeds above --base-only-above")
    ap.add_argument("--cells-out", default=None, help="append each finished row here (JSON lines)")
    ap.add_argument("--from-cells", default=None, help="no runs: the table of a --cells-out file")
    ap.add_argument("--rows", default=",".join(ROW_KEYS), help=f"comma-separated, of {', '.join(ROW_KEYS)}")
    ap.add_argument("--run", default=None, help="RunConfig overrides of the rows as JSON, e.g. "
                                                "'{\"codec\": \"sparse\"}' (not with --write-results)")
    args = ap.parse_args(argv)
    logging.disable(logging.ERROR)
    learners = [int(m) for m in args.learners.split(",")]
    unknown = [k for k in args.rows.split(",") if k not in ROW_KEYS]
    if unknown:
        ap.error(f"unknown rows {unknown}: choose from {', '.join(ROW_KEYS)}")
    rows = tuple(ROW_KEYS[k] for k in args.rows.split(","))
    run = json.loads(args.run) if args.run else None
    if args.write_results and (run or rows != tuple(ROWS)):
        ap.error("--write-results writes the defaults' whole table: not with --run or --rows")
    if args.from_cells:
        with open(args.from_cells) as f:
            results = [json.loads(line) for line in f if line.strip()]
    else:
        results = sweep(learners=learners, seeds=args.seeds, steps=args.steps, jobs=args.jobs,
                        base_only_above=args.base_only_above, large_seeds=args.large_seeds, cells_out=args.cells_out,
                        rows=rows, run=run)
    cells = cells_from(results)
    refused = max((c[2] for v in cells.values() for c in v), default=0.0)
    ref = scenario_for({}, learners=1, seed=0, steps=args.steps)
    ref.run = dict(run or {})
    defaults = ref.run_config()
    large = [M for M in learners if M > args.base_only_above]
    codec = defaults.codec + (f" at density {defaults.codec_density:g}" if defaults.codec == "sparse" else "")
    bytes_text = bytes_line(results, learners=learners)
    extra = "".join(f" --{k} {v}" for k, v in (("rows", args.rows if rows != tuple(ROWS) else None),
                                                ("run", f"'{args.run}'" if run else None),
                                                ("base-only-above", args.base_only_above if large else None),
                                                ("large-seeds", args.large_seeds if large else None)) if v)
    text = (table(cells, learners=learners, rows=rows) + f"\n\nDecoupled val loss / classic DiLoCo and / data-parallel at equal "
            f"tokens; mean (range) over {args.seeds} seed(s)"
            + (f" ({args.large_seeds} at M = {', '.join(map(str, large))}, base row only)" if large else "")
            + f"; tiny GPT, {args.steps} steps per learner, P = 4, H = 16, "
            f"tau = 8, {codec}, {'the run defaults' if not run else 'the run defaults with ' + args.run} (alpha "
            f"{defaults.alpha:g}, held {defaults.alpha if defaults.held_alpha is None else defaults.held_alpha:g}, "
            f"{defaults.merge.upper() if defaults.merge == 'rda' else defaults.merge}, outer lr "
            f"{defaults.outer_lr:g}, momentum {defaults.outer_momentum:g}); links 100 Mbps / 50 ms, "
            f"store 20 ms, syncer poll 0.2 s. Refused contributions: at most {100 * refused:.1f}% of a run's. "
            + (bytes_text + " " if bytes_text else "")
            + f"Made by `python scripts/sweep_sim.py --learners {args.learners} --seeds {args.seeds} --steps {args.steps} "
            f"--jobs {args.jobs}{extra}{' --write-results' if not extra else ''}`.")
    print(text)
    if args.write_results:
        write_results(text)
    return text


if __name__ == "__main__":
    main()
