"""The outer-loop rows of docs/results.md ("Outer loop"): Decoupled DiLoCo's val loss in the
deterministic simulation for a few scenarios, one JSON line per (row, seed), and with
``--refs`` the references (classic synchronous DiLoCo, data-parallel) of the same M and seeds.

    python scripts/sweep_outer.py --learners 2 --steps 192 --seeds 3 --rows equal,outage
    python scripts/sweep_outer.py --learners 2 --steps 192 --seeds 3 --refs
    python scripts/sweep_outer.py --learners 4 --steps 160 --seeds 3 --rows two

Rows (over sweep_sim.py's base: equal speeds, step time = the round trip): ``equal``; ``two``
(every other learner 1.5x slower); ``outage`` (one syncer outage of 5 cycles, from a quarter
of the run: the learners train through it and catch up); ``lockstep`` and ``lockstep-noef``
(the equal row in lock-step mode, Streaming DiLoCo with K = M and the int4 uploads, with and
without the learners' error feedback); ``chaos`` (preemptions taking 10% of learner time, and one
syncer outage of 10 cycles from a quarter of the run); ``preempt`` (chaos without the outage: the
trend the chaos row's curve returns to, delayed by the outage). ``--eval-points N`` adds each run's curve
of global val loss (virtual seconds, tokens, val loss):

    python scripts/sweep_outer.py --learners 2 --steps 128 --seeds 3 --rows lockstep,lockstep-noef
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time

import numpy
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sweep_sim import scenario_for  # noqa: E402

from ddiloco_cli.simtrain.arms import VAL_BATCH, run_dp, run_sync  # noqa: E402
from ddiloco_cli.simtrain.report import _decoupled  # noqa: E402
from ddiloco_cli.simtrain.world import World  # noqa: E402
from ddiloco_cli.tasks import evaluate  # noqa: E402

ROWS = {"equal": {}, "two": {"speeds": "two", "slow_factor": 1.5}, "outage": {}, "lockstep": {}, "lockstep-noef": {},
        "chaos": {"preempt": True}, "preempt": {"preempt": True}}
OUTAGE_CYCLES = 5
CHAOS_OUTAGE_CYCLES = 10  # the target scenario: 10% of learner time down + one syncer outage of 10 cycles


def scenario(row: str, *, learners: int, seed: int, steps: int, run: dict | None = None):
    sc = scenario_for(ROWS[row], learners=learners, seed=seed, steps=steps)
    sc.run = dict(run or {})
    if row in ("outage", "chaos"):
        cycle_s = sc.run_config().sync_every * sc.step_s
        cycles = OUTAGE_CYCLES if row == "outage" else CHAOS_OUTAGE_CYCLES
        sc.syncer_outages = [{"at_s": 0.25 * steps * sc.step_s, "duration_s": cycles * cycle_s}]
    if row.startswith("lockstep"):  # merge None: the mode's own (mean); every learner in every merge
        sc.run.update(mode="lockstep", merge=None, quorum=learners, error_feedback=row == "lockstep")
    return sc


class LearnerEvalWorld(World):
    """A World whose evaluations along the run also score each learner's own model and the
    average of their parameters (the model a catch-up merge could reach at best), on
    ``eval_batches`` val batches. Read-only: the run is the same to the bit."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.learner_curve: list[tuple] = []  # (virtual s, global, [each learner], their average)

    def evaluate(self, *, final: bool = False) -> float:
        val = super().evaluate(final=final)
        if final:
            return val
        states = [learner.model.state_dict() for learner in self.learners]
        average = copy.deepcopy(self.learners[0].model)
        with torch.no_grad():
            average.load_state_dict({k: sum(s[k] for s in states) / len(states) for k in states[0]})
            own = [evaluate(self.task, learner.model, batch_size=VAL_BATCH, max_batches=self.scenario.eval_batches)
                   for learner in self.learners]
            mean_model = evaluate(self.task, average, batch_size=VAL_BATCH, max_batches=self.scenario.eval_batches)
        self.learner_curve.append(
            (round(self.loop.now, 2), round(val, 4), [round(x, 4) for x in own], round(mean_model, 4)))
        return val


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, default=2)
    ap.add_argument("--steps", type=int, default=192, help="inner steps per learner")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rows", default="equal,outage", help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--refs", action="store_true", help="the references instead of the rows")
    ap.add_argument("--eval-points", type=int, default=0, help="the global val loss this many times along "
                                                                 "each row's run (printed as its curve)")
    ap.add_argument("--learner-evals", type=int, default=0, metavar="BATCHES",
                    help="at each eval point also score every learner's model and their average on this many val "
                         "batches (printed as learner_curve: time, global, learners, average)")
    ap.add_argument("--run", default="{}", help='RunConfig overrides as JSON, for the rows and the references '
                                               '(e.g. \'{"alpha": 0.0}\' or \'{"outer_momentum": 0.5}\')')
    args = ap.parse_args(argv)
    run = json.loads(args.run)
    logging.disable(logging.ERROR)
    torch.set_num_threads(1)
    for seed in range(args.seeds):
        if args.refs:
            ref = scenario_for({}, learners=args.learners, seed=seed, steps=args.steps)
            ref.run = dict(run)
            w = World(ref)
            print(json.dumps(dict(seed=seed, run=run, sync=run_sync(w.task, ref, w.config, w.inner)["val_loss"],
                                  dp=run_dp(w.task, ref, w.config, w.inner)["val_loss"])), flush=True)
            continue
        curves = {}
        for row in args.rows.split(","):
            t0 = time.process_time()
            sc = scenario(row, learners=args.learners, seed=seed, steps=args.steps, run=run)
            sc.eval_points = args.eval_points
            if args.learner_evals:
                sc.eval_batches = args.learner_evals
            w = (LearnerEvalWorld if args.learner_evals else World)(sc)
            w.run()
            d = _decoupled(w)
            print(json.dumps(dict(row=row, seed=seed, run=run, val=d["val_loss"], used=d["ledger"]["used"],
                                  refused=d["ledger"]["refused"], outages=sc.syncer_outages,
                                  curve=[(round(p["t_s"], 2), p["tokens"], round(p["val_loss"], 4)) for p in d["curve"]],
                                  learner_curve=getattr(w, "learner_curve", None),
                                  cpu_s=round(time.process_time() - t0))), flush=True)
            curves[row] = (d["curve"], sc.syncer_outages, sc.run_config().sync_every * sc.step_s)
        if "chaos" in curves and "preempt" in curves and args.eval_points:
            curve, (outage,), cycle_s = curves["chaos"]
            rec = recovery(curve, outage=outage, cycle_s=cycle_s, trend_curve=curves["preempt"][0])
            print(json.dumps(dict(recovery=rec, seed=seed)), flush=True)


RECOVERY_CYCLES = (1, 2, 4, 8)


def recovery(curve: list[dict], *, outage: dict, cycle_s: float, trend_curve: list[dict]) -> dict:
    """How far the chaos row's global val loss lies above its trend after the syncer's return:
    the trend is the same run without the outage (the ``preempt`` row), delayed by the outage's
    length (what an outage that costs only its own time would give). At 1, 2, 4 and 8 cycles
    after the return, each the curve's first point at or after that time, against the trend
    interpolated there. <= 0: back on the trend (the learners' work during the outage counted)."""
    back_s, dur_s = outage["at_s"] + outage["duration_s"], outage["duration_s"]
    ts = [p["t_s"] for p in trend_curve]
    out = {"cycle_s": round(cycle_s, 2)}
    for n in RECOVERY_CYCLES:
        point = next((p for p in curve if p["t_s"] >= back_s + n * cycle_s), None)
        if point is None or point["t_s"] - dur_s > ts[-1]:
            continue
        trend = float(numpy.interp(point["t_s"] - dur_s, ts, [p["val_loss"] for p in trend_curve]))
        out[f"{n}_cycles"] = dict(t_s=round(point["t_s"], 2), val=round(point["val_loss"], 4), trend=round(trend, 4),
                                  above=round(point["val_loss"] - trend, 4))
    return out


if __name__ == "__main__":
    main()
