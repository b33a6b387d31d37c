"""Time to data-parallel's loss over a thin link, by model size: data-parallel, classic
(synchronous) DiLoCo, and Decoupled DiLoCo with each codec, in the deterministic simulation.

    .venv/bin/python scripts/sweep_time_to_loss.py                      # M = 4, 100 Mbps, 3 seeds
    .venv/bin/python scripts/sweep_time_to_loss.py --seeds 1 --steps 64 --dp-steps 24 --sizes 1e8  # smoke

The loss per step is the simulated model's (the tiny GPT); the times are those of a model of
``--sizes`` parameters (``Scenario.model_params``): its payloads cross the learners' links
(``--mbps`` each way, one link per learner shared by its connections), the syncer merges at
``--syncer-shards`` x the one-core rate (``sync --fragments`` processes), and the references
pay a ring all-reduce of fp32 values per step (data-parallel) or per H steps (classic DiLoCo)
with every step at the slowest learner's pace. The target is data-parallel's final loss after
``--dp-steps`` steps (its own run); the other arms train ``--steps`` per learner to reach it.
The references' losses depend only on the seed (run once per seed); each (seed, codec, size)
is one decoupled run, since the link's pace changes what the learners see.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import multiprocessing
import statistics
import sys
import time

import torch

from ddiloco_cli.simtrain.arms import run_dp, run_sync
from ddiloco_cli.simtrain.report import _decoupled, add_times_to_loss, duration
from ddiloco_cli.simtrain.scenario import Scenario
from ddiloco_cli.simtrain.world import World

# the run defaults of each codec; sparse-thin: published deltas at the uploads' density (half the
# default's download bytes, for links whose download is the limit)
CODEC_RUNS = {"int4": {}, "sparse": {"codec": "sparse"}, "sparse-thin": {"codec": "sparse", "publish_density": 0.02}}


def base_scenario(args: argparse.Namespace, seed: int) -> Scenario:
    return Scenario(learners=args.learners, seed=seed, steps_per_learner=args.steps, dp_steps=args.dp_steps,
                    step_s=args.step_s, up_mbps=args.mbps, down_mbps=args.mbps, eval_points=args.eval_points,
                    eval_batches=16, arms=("decoupled",), syncer_cores=args.syncer_shards)


def run_job(job: tuple) -> dict:
    """One job: ("refs", seed) -> data-parallel and classic DiLoCo; ("decoupled", seed, codec,
    size) -> one decoupled run's report."""
    torch.set_num_threads(1)
    logging.disable(logging.ERROR)
    t0 = time.process_time()
    kind, args, seed = job[0], job[1], job[2]
    sc = base_scenario(args, seed)
    if kind == "refs":
        world = World(sc)
        out = dict(kind=kind, seed=seed, dp=run_dp(world.task, sc, world.config, world.inner),
                   sync=run_sync(world.task, sc, world.config, world.inner, curve=True), sync_every=world.config.sync_every)
    else:
        codec, size = job[3], job[4]
        sc = dataclasses.replace(sc, model_params=size, run=dict(CODEC_RUNS[codec]))
        world = World(sc)
        world.run()
        out = dict(kind=kind, seed=seed, codec=codec, size=size, decoupled=_decoupled(world),
                   num_params=world.num_params)
    print(f"{kind} seed {seed} {job[3:] if len(job) > 3 else ''}: {time.process_time() - t0:.0f} s CPU",
          file=sys.stderr, flush=True)
    return out


def times(results: list[dict], args: argparse.Namespace) -> list[dict]:
    """One row per (seed, size, arm): its time to data-parallel's final loss and its final loss."""
    refs = {r["seed"]: r for r in results if r["kind"] == "refs"}
    rows = []
    for r in results:
        if r["kind"] != "decoupled":
            continue
        ref, sc = refs[r["seed"]], dataclasses.replace(base_scenario(args, r["seed"]), model_params=r["size"])
        arms = {"decoupled": dict(r["decoupled"]), "sync": dict(ref["sync"]), "dp": dict(ref["dp"])}
        add_times_to_loss(arms, sc, num_params=r["size"], sync_every=ref["sync_every"])
        dec = arms["decoupled"]
        rows.append(dict(seed=r["seed"], size=r["size"], arm=f"decoupled {r['codec']}",
                         time_s=dec["time_to_dp_loss_s"], val=dec["val_loss"], target=arms["dp"]["val_loss"],
                         up_mb=dec["bytes_up_per_learner"] / 1e6 * r["size"] / r["num_params"],
                         down_mb=dec["bytes_down_per_learner"] / 1e6 * r["size"] / r["num_params"],
                         blocked_s=dec["blocked_s_per_learner"], run_s=dec["virtual_s"],
                         lag_p50=dec["lag_steps_p50"], syncer_busy=dec["syncer_utilisation"]))
        if r["codec"] == args.codecs[0]:  # the references once per (seed, size)
            rows.append(dict(seed=r["seed"], size=r["size"], arm="classic DiLoCo", time_s=arms["sync"]["time_to_dp_loss_s"],
                             val=arms["sync"]["val_loss"], target=arms["dp"]["val_loss"], run_s=arms["sync"]["time_s"]))
            rows.append(dict(seed=r["seed"], size=r["size"], arm="data-parallel", time_s=arms["dp"]["time_to_final_s"],
                             val=arms["dp"]["val_loss"], target=arms["dp"]["val_loss"], run_s=arms["dp"]["time_to_final_s"]))
    return rows


def _cell(values: list[float | None]) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "not reached"
    text = duration(statistics.mean(got))
    if len(got) > 1:
        text += f" ({duration(min(got))}-{duration(max(got))})"
    return text + (f", {len(values) - len(got)} not reached" if len(got) < len(values) else "")


def _median_lag(rows: list[dict]) -> str:
    lags = [r["lag_p50"] for r in rows if r.get("lag_p50") is not None]
    return f"{statistics.median(lags):g} steps (median)" if lags else "nothing received"


def table(rows: list[dict], sizes: list[float]) -> str:
    arms = ["data-parallel", "classic DiLoCo"] + sorted({r["arm"] for r in rows if r["arm"].startswith("decoupled")})
    out = ["| arm | " + " | ".join(f"{s:.3g} params" for s in sizes) + " |", "|---" * (1 + len(sizes)) + "|"]
    for arm in arms:
        out.append(f"| {arm} | " + " | ".join(_cell([r["time_s"] for r in rows if r["arm"] == arm and r["size"] == s])
                                              for s in sizes) + " |")
    return "\n".join(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300, help="inner steps per learner (decoupled, classic DiLoCo)")
    ap.add_argument("--dp-steps", type=int, default=75, help="data-parallel's steps: its final loss is the target")
    ap.add_argument("--sizes", default="1e8,1e9,3e9", help="comma-separated model sizes (parameters)")
    ap.add_argument("--codecs", default="int4,sparse", help=f"comma-separated, of {', '.join(CODEC_RUNS)}")
    ap.add_argument("--mbps", type=float, default=100.0, help="each learner's link, each way")
    ap.add_argument("--step-s", type=float, default=1.0, help="compute time of an inner step")
    ap.add_argument("--syncer-shards", type=int, default=4, help="syncer processes (x the one-core merge rate)")
    ap.add_argument("--eval-points", type=int, default=15, help="val loss this many times along each run")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", default=None, help="write every row and the table here")
    args = ap.parse_args(argv)
    args.codecs = args.codecs.split(",")
    if any(c not in CODEC_RUNS for c in args.codecs):
        ap.error(f"--codecs: choose from {', '.join(CODEC_RUNS)}")
    sizes = [float(s) for s in args.sizes.split(",")]
    jobs = [("decoupled", args, seed, codec, size) for seed in range(args.seeds) for size in sizes
            for codec in args.codecs] + [("refs", args, seed) for seed in range(args.seeds)]
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        results = list(pool.imap_unordered(run_job, jobs))
    rows = times(results, args)
    text = (table(rows, sizes) + f"\n\nTime to data-parallel's final loss after {args.dp_steps} steps (mean over "
            f"{args.seeds} seed(s), range); M = {args.learners}, {args.mbps:g} Mbps links each way, "
            f"{args.step_s:g} s compute steps, {args.steps} steps per learner for the others, the syncer at "
            f"{args.syncer_shards} x one core; the loss per step is the tiny GPT's.")
    for arm in sorted({r["arm"] for r in rows if r["arm"].startswith("decoupled")}):
        for s in sizes:
            rs = [r for r in rows if r["arm"] == arm and r["size"] == s]
            text += (f"\n{arm} at {s:.3g}: final loss {statistics.mean(r['val'] for r in rs):.4f} (target "
                     f"{statistics.mean(r['target'] for r in rs):.4f}), run {duration(statistics.mean(r['run_s'] for r in rs))}, "
                     f"blocked {statistics.mean(r['blocked_s'] for r in rs):.0f} s per learner, send -> receive "
                     f"{_median_lag(rs)}, syncer busy "
                     f"{statistics.mean(r['syncer_busy'] for r in rs):.0%}, up / down "
                     f"{statistics.mean(r['up_mb'] for r in rs):.0f} / {statistics.mean(r['down_mb'] for r in rs):.0f} MB "
                     f"per learner at that size")
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "table": text, "args": {k: v for k, v in vars(args).items()}}, f, indent=1)
    return {"rows": rows, "table": text}


if __name__ == "__main__":
    main()
